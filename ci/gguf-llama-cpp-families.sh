#!/usr/bin/env bash
# Phi-3, GLM and GLM-4 exported to GGUF, in llama.cpp: the evidence recorded in
# docs/ACCURACY.md ("GGUF export in llama.cpp", the tiny families). Not run by CI (llama.cpp is
# not built there); run it by hand with llama.cpp's tools built:
#
#   LLAMA_CPP_BIN=/path/to/llama.cpp/build/bin ci/gguf-llama-cpp-families.sh
#
# Each tiny fixture (random weights, 320-token vocabulary) is converted, exported with
# `kiln-convert export-gguf`, and scored by `kiln-verify perplexity` (the .kiln) and
# `llama-perplexity` (the .gguf) on fixtures/text/gpl-3.txt with the same context. Phi-3 is run
# three ways: as committed (a window of 8, which llama.cpp ignores, so the two differ by
# design), without its window (LongRoPE's long factors: llama.cpp rounds its context up to 256,
# past the original 16), and without its window with an original context of 256 (the short
# factors on both sides). GLM, GLM-4 and the windowless Phi-3 are also quantized to Q8_0 and
# Q4_0 (kiln-quantize, reference method; fused tensors of quantized parts) and compared the same
# way. The .kiln files are named tiny-* because llama.cpp special-cases
# models whose general.name (the file stem) contains "phi3".
# Outputs land in target/gguf-llama-cpp-families/ (results in summary.txt).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bin_ll="${LLAMA_CPP_BIN:?set LLAMA_CPP_BIN to the build/bin directory of llama.cpp}"
export LD_LIBRARY_PATH="$bin_ll${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
py="$(ci/python-env.sh)"
cargo build --release -p kiln-convert -p kiln-quantize -p kiln-verify --bins
bin=target/release
out=target/gguf-llama-cpp-families
mkdir -p "$out"
text=fixtures/text/gpl-3.txt
threads="${THREADS:-2}"
summary="$out/summary.txt"
: > "$summary"

# Phi-3 variants of the committed fixture, edited in config.json only (same weights).
variant() {
    local name="$1" edit="$2"
    rm -rf "${out:?}/$name"
    cp -r fixtures/tiny/phi3-f32 "$out/$name"
    "$py" - "$out/$name/config.json" "$edit" <<'PY'
import json, sys
path, edit = sys.argv[1], sys.argv[2]
c = json.load(open(path))
c.pop("sliding_window", None)
if edit == "short":
    c["original_max_position_embeddings"] = 256
    c["rope_parameters"]["original_max_position_embeddings"] = 256
json.dump(c, open(path, "w"), indent=2)
PY
}
variant p3-nowin long
variant p3-short short

score() {
    local name="$1" ctx="$2"
    k="$("$bin/kiln-verify" perplexity "$out/$name.kiln" --text "$text" -c "$ctx" -t "$threads" 2>&1 | tail -1)"
    l="$("$bin_ll/llama-perplexity" -m "$out/$name.gguf" -f "$text" -c "$ctx" -b "$ctx" -t "$threads" 2>&1 | grep 'Final estimate')"
    printf '%-18s -c %-4s kiln-verify: %s\n                            llama-perplexity: %s\n' "$name" "$ctx" "$k" "$l" | tee -a "$summary"
}

run() {
    local src="$1" name="$2" ctx="$3"
    "$bin/kiln-convert" hf "$src" -o "$out/$name.kiln" --force > /dev/null 2>&1
    "$bin/kiln-convert" export-gguf "$out/$name.kiln" -o "$out/$name.gguf" --force > /dev/null 2>&1
    score "$name" "$ctx"
}

echo "== perplexity on $text" | tee -a "$summary"
run fixtures/tiny/glm-f32 tiny-glm 128
run fixtures/tiny/glm4-f32 tiny-glm4 128
for ctx in 64 128; do
    run "$out/p3-nowin" tiny-p3-nowin "$ctx"
    run fixtures/tiny/phi3-f32 tiny-p3-window "$ctx"
done
run "$out/p3-short" tiny-p3-short 128
for name in tiny-glm tiny-glm4 tiny-p3-nowin; do
    for t in q8_0 q4_0; do
        "$bin/kiln-quantize" "$out/$name.kiln" "$out/$name-$t.kiln" --to "$t" --method reference --force > /dev/null
        "$bin/kiln-convert" export-gguf "$out/$name-$t.kiln" -o "$out/$name-$t.gguf" --force > /dev/null 2>&1
        score "$name-$t" 128
    done
done
echo "gguf-llama-cpp-families: results in $summary"
