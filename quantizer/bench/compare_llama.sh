#!/usr/bin/env bash
# Time kiln-quantize against llama.cpp's llama-quantize on the same model, interleaving the
# runs (A B A B ...) so that load from other processes hits both tools alike, and print the
# median wall time, user+sys CPU time and peak RSS of each, and the load average before and
# after.
#
# Usage: quantizer/bench/compare_llama.sh MODEL.kiln MODEL-bf16.gguf LLAMA_QUANTIZE [RUNS] [THREADS]
# Outputs go to a temporary directory that is removed at the end. KILN_QUANTIZE=PATH times
# another kiln-quantize build (default: target/release/kiln-quantize); KILN_QUANTIZE_BEFORE=PATH
# also times an earlier build in the same rounds (rows "before-q8_0", "before-q4_0").
set -euo pipefail
kiln_in="$1" gguf_in="$2" lq="$3" runs="${4:-7}" threads="${5:-2}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
kq="${KILN_QUANTIZE:-$root/target/release/kiln-quantize}"  # override to time another build
before="${KILN_QUANTIZE_BEFORE:-}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
t() {  # t LABEL CMD...: one timed run, appends "wall cpu rss_kb" to $tmp/LABEL
    local label="$1"; shift
    /usr/bin/time -f "%e %U %S %M" -o "$tmp/t" "$@" >/dev/null 2>&1
    awk '{printf "%s %.2f %s\n", $1, $2 + $3, $4}' "$tmp/t" >> "$tmp/$label"
}
median() { sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
for type in q8_0 q4_0; do
    for _ in $(seq "$runs"); do
        # Every tool starts without an output file (replacing one would time its deletion).
        if [[ -n "$before" ]]; then
            rm -f "$tmp/b.kiln"
            t "before-$type" "$before" "$kiln_in" "$tmp/b.kiln" --to "$type" --threads "$threads" -q
        fi
        rm -f "$tmp/k.kiln"
        t "kiln-$type" "$kq" "$kiln_in" "$tmp/k.kiln" --to "$type" --threads "$threads" -q
        rm -f "$tmp/l.gguf"
        t "llama-$type" "$lq" "$gguf_in" "$tmp/l.gguf" "$type" "$threads"
    done
    ls -l "$tmp/k.kiln" "$tmp/l.gguf" | awk '{print "  " $5, $9}'
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
printf "%-14s %8s %8s %10s\n" tool wall_s cpu_s peak_rss_MiB
rows="kiln-q8_0 llama-q8_0 kiln-q4_0 llama-q4_0"
[[ -n "$before" ]] && rows="before-q8_0 $rows before-q4_0"
for f in $rows; do
    printf "%-14s %8s %8s %10.0f\n" "$f" \
        "$(cut -d' ' -f1 "$tmp/$f" | median)" "$(cut -d' ' -f2 "$tmp/$f" | median)" \
        "$(echo "$(cut -d' ' -f3 "$tmp/$f" | median) / 1024" | bc -l)"
done
for type in q8_0 q4_0; do
    k="$(cut -d' ' -f1 "$tmp/kiln-$type" | median)" l="$(cut -d' ' -f1 "$tmp/llama-$type" | median)"
    printf "%s: kiln/llama wall %.2f" "$type" "$(echo "$k / $l" | bc -l)"
    if [[ -n "$before" ]]; then
        printf ", before/llama %.2f" "$(echo "$(cut -d' ' -f1 "$tmp/before-$type" | median) / $l" | bc -l)"
    fi
    echo
done
