#!/usr/bin/env bash
# `kiln-quantize --to auto` at several sizes: each budget's file measured by KL-divergence
# against F32 inside Kiln (`kiln-verify perplexity --kl-base`) on the two texts the calibration
# never saw (fixtures/text/gpl-3.txt, legal prose; fixtures/text/ulysses-1.txt, literary
# prose), calibrated on CAL (default fixtures/text/calibration.txt) like benches/lowbit_kld.sh,
# so the rows sit beside that script's llama.cpp files of the same size.
#
#   [CAL=TEXT] [MODEL=smollm2|gemma3] [CHUNKS=N] benches/auto_kld.sh [BUDGET ...]
#                                           BUDGET: bpw:B or bytes:N
#
# MODEL, CHUNKS and CAL as in benches/lowbit_kld.sh; needs release binaries. Each file is also
# exported to GGUF (`kiln-convert export-gguf`), whose size is the one printed, so the rows
# compare with llama.cpp's files by size. Prints one line per (budget, text) and leaves
# everything in target/auto-kld/ (target/auto-kld-gemma3/ for Gemma, and -NAME appended for
# another CAL; summary.txt, the input of benches/kld_chart.py).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bin=target/release
model="${MODEL:-smollm2}"
cal="${CAL:-fixtures/text/calibration.txt}"
chunks=()
[ -z "${CHUNKS:-}" ] || chunks=(--chunks "$CHUNKS")
out=target/auto-kld
[ "$model" = smollm2 ] || out="$out-$model"
[ "$(basename "$cal")" = calibration.txt ] || out="$out-$(basename "$cal" .txt)"
threads=2
mkdir -p "$out"
budgets=("$@")
if [ ${#budgets[@]} -eq 0 ]; then
    # 4.5 bpw is Q4_0's size; the byte budgets make GGUF files no larger than llama.cpp's Q2_K
    # (88.2 MB), IQ4_NL (91.7 MB), Q3_K_L (97.5 MB) and Q4_K_M (105.45 MB) files of
    # benches/lowbit_kld.sh and docs/ACCURACY.md: SmolLM2's GGUF export is 1.10 MB larger than
    # its .kiln (the tokenizer's vocabulary as GGUF arrays), which --max-bytes bounds.
    budgets=(bpw:4.5 bytes:87040000 bytes:90540000 bytes:96340000 bytes:104340000)
fi
texts=(fixtures/text/gpl-3.txt fixtures/text/ulysses-1.txt)

benches/f32_model.sh "$model" "$out/f32.kiln"
[ -f "$out/importance.safetensors" ] || "$bin/kiln-quantize" "$out/f32.kiln" "$out/cal-q4_k_m.kiln" \
    --to q4_k_m --calibrate "$cal" --save-importance "$out/importance.safetensors" --threads "$threads" \
    --force > /dev/null
for text in "${texts[@]}"; do
    name="$(basename "$text" .txt)"
    [ -f "$out/base-$name.safetensors" ] || "$bin/kiln-verify" perplexity "$out/f32.kiln" --text "$text" -c 512 \
        "${chunks[@]}" -t "$threads" --save-logits "$out/base-$name.safetensors" > "$out/base-$name.log" 2>&1
done

summary="$out/summary.txt"
touch "$summary"  # appended to: the chart takes the last line of each (budget, text)
for b in "${budgets[@]}"; do
    kind="${b%%:*}" value="${b##*:}"
    case "$kind" in
        bpw) flag=(--bpw "$value") ;;
        bytes) flag=(--max-bytes "$value") ;;
        *) echo "auto_kld.sh: budget '$b' is not bpw:B or bytes:N" >&2; exit 2 ;;
    esac
    file="$out/auto-$kind-$value.kiln"
    if ! "$bin/kiln-quantize" "$out/f32.kiln" "$file" --to auto "${flag[@]}" \
        --importance "$out/importance.safetensors" --threads "$threads" --force \
        > "$out/auto-$kind-$value.report" 2> "$out/auto-$kind-$value.log"; then
        echo "$b: $(tail -1 "$out/auto-$kind-$value.log")" | tee -a "$summary"
        continue
    fi
    "$bin/kiln-convert" export-gguf "$file" -o "${file%.kiln}.gguf" --force > /dev/null
    size="$(stat -c %s "${file%.kiln}.gguf")"
    for text in "${texts[@]}"; do
        name="$(basename "$text" .txt)"
        log="$out/auto-$kind-$value-$name.log"
        "$bin/kiln-verify" perplexity "$file" --text "$text" -c 512 \
            "${chunks[@]}" -t "$threads" --kl-base "$out/base-$name.safetensors" > "$log" 2>&1
        line="$(printf '%-16s %10d gguf-bytes  %-10s %s' "$b" "$size" "$name" "$(grep -i 'kl' "$log" | tail -1)")"
        echo "$line" | tee -a "$summary"
    done
done
