#!/usr/bin/env bash
# Calibrated quantization at llama.cpp's sizes below Q4_K_M: for each mix, Kiln's
# `kiln-quantize --to MIX --calibrate` against `llama-quantize --imatrix … MIX` (the same tensor
# types and size), both measured inside llama.cpp (`llama-perplexity --kl-divergence` against the
# F32 GGUF) on two texts neither calibration saw: fixtures/text/gpl-3.txt (legal prose) and
# fixtures/text/ulysses-1.txt (literary prose). Both calibrate on the same text, CAL (default
# fixtures/text/calibration.txt; 12 288 tokens, 24 windows of 512: `llama-imatrix -c 512
# --chunks 24`).
#
#   LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin [CAL=TEXT] [MODEL=smollm2|gemma3] [CHUNKS=N] \
#       benches/lowbit_kld.sh [MIX:LLAMA_TYPE ...]
#
# MODEL is smollm2 (the default; needs target/models/smollm2-bf16, from ci/smollm2.sh) or gemma3
# (Gemma 3 270M dequantized from its Q4_K_M GGUF; benches/f32_model.sh). CHUNKS=N measures the
# first N windows of 512 of each text (default: all).
# Needs release binaries. Prints one line per (mix, text) and leaves everything in
# target/lowbit-kld/ (target/lowbit-kld-gemma3/ for Gemma, and -NAME appended for another CAL,
# NAME its file name without .txt), summary.txt included.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
ll="${LLAMA_CPP_BIN:?set LLAMA_CPP_BIN to the build/bin directory of llama.cpp}"
export LD_LIBRARY_PATH="$ll${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
bin=target/release
cal="${CAL:-fixtures/text/calibration.txt}"
model="${MODEL:-smollm2}"
chunks=()
[ -z "${CHUNKS:-}" ] || chunks=(--chunks "$CHUNKS")
out=target/lowbit-kld
[ "$model" = smollm2 ] || out="$out-$model"
[ "$(basename "$cal")" = calibration.txt ] || out="$out-$(basename "$cal" .txt)"
threads=2
mkdir -p "$out"
mixes=("$@")
if [ ${#mixes[@]} -eq 0 ]; then
    mixes=(q2_k_mix:Q2_K q3_k_s:Q3_K_S q3_k_m:Q3_K_M q3_k_l:Q3_K_L iq4_xs_mix:IQ4_XS
           iq4_nl_mix:IQ4_NL q4_k_s:Q4_K_S)
fi
texts=(fixtures/text/gpl-3.txt fixtures/text/ulysses-1.txt)

benches/f32_model.sh "$model" "$out/f32.kiln"
[ -f "$out/f32.gguf" ] || "$bin/kiln-convert" export-gguf "$out/f32.kiln" -o "$out/f32.gguf" --force
[ -f "$out/imatrix.gguf" ] || "$ll/llama-imatrix" -m "$out/f32.gguf" -f "$cal" -c 512 --chunks 24 \
    -t "$threads" -o "$out/imatrix.gguf" > "$out/imatrix.log" 2>&1
# One Kiln calibration (second moments included) serves every mix.
[ -f "$out/importance.safetensors" ] || "$bin/kiln-quantize" "$out/f32.kiln" "$out/cal-q4_k_m.kiln" \
    --to q4_k_m --calibrate "$cal" --save-importance "$out/importance.safetensors" --threads "$threads" \
    --force > /dev/null
for text in "${texts[@]}"; do
    name="$(basename "$text" .txt)"
    [ -f "$out/base-$name.kld" ] || "$ll/llama-perplexity" -m "$out/f32.gguf" -f "$text" -c 512 \
        "${chunks[@]}" -t "$threads" --kl-divergence-base "$out/base-$name.kld" > "$out/base-$name.log" 2>&1
done

kld() {  # kld GGUF TEXT-NAME: "ppl KLD same-top" as llama-perplexity reports them
    local log="$out/$(basename "$1" .gguf)-$2.log"
    "$ll/llama-perplexity" -m "$1" -t "$threads" --kl-divergence-base "$out/base-$2.kld" \
        --kl-divergence > "$log" 2>&1
    local p k t
    p="$(grep -o 'Mean PPL(Q) *: *[0-9.]*' "$log" | awk '{print $NF}')"
    k="$(grep -o 'Mean    KLD: *[0-9.]*' "$log" | awk '{print $NF}')"
    t="$(grep -o 'Same top p: *[0-9.]*' "$log" | awk '{print $NF}')"
    printf 'ppl %s  KLD %s  same top %s%%' "$p" "$k" "$t"
}

summary="$out/summary.txt"
: > "$summary"
for pair in "${mixes[@]}"; do
    mix="${pair%%:*}" type="${pair##*:}"
    # llama.cpp's file and its measurements are made once per output directory (delete them
    # to remake them); Kiln's are remade on every run.
    [ -f "$out/ll-$mix.gguf" ] || "$ll/llama-quantize" --imatrix "$out/imatrix.gguf" "$out/f32.gguf" \
        "$out/ll-$mix.gguf" "$type" "$threads" > "$out/ll-$mix.quantize.log" 2>&1
    "$bin/kiln-quantize" "$out/f32.kiln" "$out/k-$mix.kiln" --to "$mix" \
        --importance "$out/importance.safetensors" --threads "$threads" --force > /dev/null
    "$bin/kiln-convert" export-gguf "$out/k-$mix.kiln" -o "$out/k-$mix.gguf" --force > /dev/null
    for text in "${texts[@]}"; do
        name="$(basename "$text" .txt)"
        [ -f "$out/ll-$mix-$name.result" ] || kld "$out/ll-$mix.gguf" "$name" > "$out/ll-$mix-$name.result"
        l="$(cat "$out/ll-$mix-$name.result")"
        k="$(kld "$out/k-$mix.gguf" "$name")"
        printf '%-11s %-10s bytes %s/%s | llama.cpp imatrix: %s | Kiln calibrated: %s\n' "$mix" "$name" \
            "$(stat -c %s "$out/ll-$mix.gguf")" "$(stat -c %s "$out/k-$mix.gguf")" "$l" "$k" | tee -a "$summary"
    done
done
