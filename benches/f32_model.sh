#!/usr/bin/env bash
# The F32 .kiln both quantizers start from in benches/lowbit_kld.sh and benches/auto_kld.sh,
# written to OUT unless it is already there:
#
#   benches/f32_model.sh MODEL OUT
#
# MODEL=smollm2: target/models/smollm2-bf16 (ci/smollm2.sh) converted to F32. MODEL=gemma3:
# Gemma 3 270M from its only published file, a Q4_K_M GGUF (ci/gemma3.sh), every weight
# dequantized to F32; that F32 model is then the reference both quantizers are measured
# against.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
model="$1" out="$2"
[ ! -f "$out" ] || exit 0
case "$model" in
    smollm2) target/release/kiln-convert hf target/models/smollm2-bf16 -o "$out" --dtype f32 --force ;;
    gemma3) target/release/kiln-convert gguf "$(ci/gemma3.sh)" -o "$out" --dequantize-to f32 \
                --dequantize-all --force ;;
    *) echo "f32_model.sh: MODEL must be smollm2 or gemma3, not $model" >&2; exit 2 ;;
esac
