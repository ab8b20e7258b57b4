#!/usr/bin/env bash
# Exported GGUF files in llama.cpp: the evidence recorded in docs/ACCURACY.md ("GGUF export in
# llama.cpp"). Not run by CI (building llama.cpp takes too long there); run it by hand with
# llama.cpp's tools built:
#
#   LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin ci/gguf-llama-cpp.sh [CHUNKS]
#
# 1. Converts SmolLM2-135M-Instruct (bf16, and f16), quantizes it with kiln-quantize's
#    reference method to q8_0 and q4_0 (every matrix, embedding included), and exports all four
#    with `kiln-convert export-gguf`.
# 2. Block identity: `llama-quantize --pure` of the exported bf16 GGUF to Q8_0, Q4_0, Q2_K, Q3_K,
#    IQ4_NL and IQ4_XS (every matrix in that type, like Kiln's default policy) must hold the
#    same bytes, tensor by tensor, as Kiln's exported `--to` of the same type; and llama.cpp's
#    mixes (`llama-quantize` Q2_K, Q3_K_S/M/L, Q4_K_S/M, Q5_K_S/M, IQ4_NL, IQ4_XS) the same bytes
#    and tensor types as Kiln's `--to` of that mix (fixtures/gguf/compare_blocks.py).
# 3. Perplexity: `llama-perplexity -c 512` of each exported file next to `kiln-verify
#    perplexity -c 512` of the .kiln it came from, on fixtures/text/gpl-3.txt (CHUNKS chunks of
#    512 tokens; default all 14).
# Outputs land in target/gguf-llama-cpp/ (results in summary.txt).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bin_ll="${LLAMA_CPP_BIN:?set LLAMA_CPP_BIN to the build/bin directory of llama.cpp}"
export LD_LIBRARY_PATH="$bin_ll${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
chunks="${1:-}"
cargs=()
if [[ -n "$chunks" ]]; then cargs=(--chunks "$chunks"); fi
py="$(ci/python-env.sh)"
ci/smollm2.sh >&2
cargo build --release -p kiln-convert -p kiln-quantize -p kiln-verify --bins
bin=target/release
out=target/gguf-llama-cpp
mkdir -p "$out"
text=fixtures/text/gpl-3.txt
threads="${THREADS:-2}"
summary="$out/summary.txt"
: > "$summary"

"$bin/kiln-convert" hf target/models/smollm2-bf16 -o "$out/bf16.kiln" --force > /dev/null 2>&1
"$bin/kiln-convert" hf target/models/smollm2-bf16 -o "$out/f16.kiln" --dtype f16 --force > /dev/null 2>&1
for t in q8_0 q4_0; do
    "$bin/kiln-quantize" "$out/bf16.kiln" "$out/$t.kiln" --to "$t" --method reference --force > /dev/null
done
for t in bf16 f16 q8_0 q4_0; do
    "$bin/kiln-convert" export-gguf "$out/$t.kiln" -o "$out/$t.gguf" --force
done

echo "== block identity: llama-quantize --pure of the exported bf16 vs Kiln's export" | tee -a "$summary"
for t in Q8_0 Q4_0 Q2_K Q3_K IQ4_NL IQ4_XS; do
    lc="$(echo "$t" | tr 'A-Z' 'a-z')"
    if [[ ! -f "$out/$lc.gguf" ]]; then
        "$bin/kiln-quantize" "$out/bf16.kiln" "$out/$lc.kiln" --to "$lc" --force > /dev/null
        "$bin/kiln-convert" export-gguf "$out/$lc.kiln" -o "$out/$lc.gguf" --force > /dev/null
    fi
    "$bin_ll/llama-quantize" --pure "$out/bf16.gguf" "$out/llama-quantize-$lc.gguf" "$t" "$threads" > "$out/llama-quantize-$lc.log" 2>&1
    echo "-- $t" | tee -a "$summary"
    "$py" fixtures/gguf/compare_blocks.py "$out/$lc.gguf" "$out/llama-quantize-$lc.gguf" | tee -a "$summary"
done
echo "== block identity: llama-quantize's mixes vs Kiln's" | tee -a "$summary"
for pair in q2_k_mix:Q2_K q3_k_s:Q3_K_S q3_k_m:Q3_K_M q3_k_l:Q3_K_L q4_k_s:Q4_K_S q4_k_m:Q4_K_M \
    q5_k_s:Q5_K_S q5_k_m:Q5_K_M iq4_nl_mix:IQ4_NL iq4_xs_mix:IQ4_XS; do
    mix="${pair%%:*}" t="${pair##*:}"
    "$bin/kiln-quantize" "$out/bf16.kiln" "$out/$mix.kiln" --to "$mix" --force > /dev/null
    "$bin/kiln-convert" export-gguf "$out/$mix.kiln" -o "$out/$mix.gguf" --force > /dev/null
    "$bin_ll/llama-quantize" "$out/bf16.gguf" "$out/llama-quantize-$mix.gguf" "$t" "$threads" > "$out/llama-quantize-$mix.log" 2>&1
    echo "-- $t: $(stat -c %s "$out/$mix.gguf") bytes (Kiln), $(stat -c %s "$out/llama-quantize-$mix.gguf") (llama-quantize)" | tee -a "$summary"
    "$py" fixtures/gguf/compare_blocks.py "$out/$mix.gguf" "$out/llama-quantize-$mix.gguf" | tee -a "$summary"
done

echo "== perplexity (-c 512, chunks: ${chunks:-all}) on $text" | tee -a "$summary"
for t in bf16 f16 q8_0 q4_0; do
    k="$("$bin/kiln-verify" perplexity "$out/$t.kiln" --text "$text" -c 512 "${cargs[@]}" -t "$threads" 2>&1 | tail -1)"
    l="$("$bin_ll/llama-perplexity" -m "$out/$t.gguf" -f "$text" -c 512 -t "$threads" "${cargs[@]}" 2>&1 | grep 'Final estimate')"
    printf '%-5s kiln-verify: %s\n      llama-perplexity: %s\n' "$t" "$k" "$l" | tee -a "$summary"
done
for t in q8_0 q4_0; do
    l="$("$bin_ll/llama-perplexity" -m "$out/llama-quantize-$t.gguf" -f "$text" -c 512 -t "$threads" "${cargs[@]}" 2>&1 | grep 'Final estimate')"
    printf '%-5s llama-quantize --pure, llama-perplexity: %s\n' "$t" "$l" | tee -a "$summary"
done
echo "gguf-llama-cpp: results in $summary"
