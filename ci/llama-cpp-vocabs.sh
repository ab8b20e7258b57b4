#!/usr/bin/env bash
# Fetch llama.cpp's tokenizer test vocabularies (ggml-vocab-*.gguf with their .inp texts and
# the .out ids transformers gave) and Phi-3.5-mini-instruct's chat template from the PyPI sdist
# of llama-cpp-python, checked against the sha256 pinned in ci/llama_cpp_vocabs.py, into
# target/tokenizers/{phi3,llama-cpp-vocab}/; the 77 MB tarball is cached in
# target/cache/tokenizers/. A no-op when they are already there. Needs python3 with pip: the
# sdist comes through `pip download`, so whatever index, proxy or cache pip is configured with
# serves it. Used by
# ci/check-fixtures.sh (hence CI) before runner/tests/llama_cpp_vocabs.rs and
# real_tokenizers.rs, and by fixtures/tokenizers/make_expected.py.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-}"
if [[ -z "$py" ]]; then
    for cand in python3.11 python3; do
        if command -v "$cand" >/dev/null 2>&1; then py="$cand"; break; fi
    done
fi
exec "${py:?llama-cpp-vocabs.sh: no python3 found}" ci/llama_cpp_vocabs.py --root "$root"
