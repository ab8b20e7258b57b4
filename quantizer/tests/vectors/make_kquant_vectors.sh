#!/bin/sh
# Regenerate the GGML reference blocks for the Q2_K…Q6_K/Q5_0/Q5_1/IQ4_NL/IQ4_XS cross-checks
# (quantizer/tests/ggml_kquants.rs, format/tests/ggml_q2_q3.rs, format/tests/ggml_iq4.rs) from
# GGML's own quantizers.
#
#   LLAMA_CPP=/path/to/llama.cpp quantizer/tests/vectors/make_kquant_vectors.sh [PYTHON]
#
# LLAMA_CPP is a llama.cpp source tree whose build/bin holds libggml-base.so (cmake build of
# the tree; Kiln's figures use the sources vendored in PyPI's llama-cpp-python 0.3.36). PYTHON
# (default python3) needs numpy. Writes next to this script:
#   kquant_input.f32, kquant_groups.json    the inputs and what each range exercises
#   kq_q4_k.bin kq_q5_k.bin kq_q6_k.bin     blocks of kquant_input.f32
#   kq_q5_0.bin kq_q5_1.bin                 blocks of kquant_input.f32
#   kq_q2_k.bin kq_q3_k.bin                 blocks of kquant_input.f32
#   kq_iq4_nl.bin kq_iq4_xs.bin             blocks of kquant_input.f32 (quantize_iq4_*, no imatrix)
#   kq[w]_<type>.deq.f32                    GGML's dequantization of those four types' blocks
#   q5_0.bin q5_1.bin                       blocks of input.f32 (the Q8_0/Q4_0 vectors' input)
#   kquant_imatrix.f32                      1024 importance weights
#   kqw_<type>.bin                          kquant_input.f32 as rows of 1024, quantized with
#                                           the importance (GGML's quantize_<type> + imatrix)
#   kquant_manifest.json                    sources, compiler, sha256 of every file
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
: "${LLAMA_CPP:?set LLAMA_CPP to a llama.cpp source tree with build/bin/libggml-base.so}"
PYTHON=${1:-python3}
LIB="$LLAMA_CPP/build/bin"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

cc -O2 -std=c11 -o "$TMP/ggml_kquants" "$HERE/ggml_kquants.c" \
    -I"$LLAMA_CPP/ggml/include" -I"$LLAMA_CPP/ggml/src" -L"$LIB" -lggml-base -Wl,-rpath,"$LIB"
# The ties of the final requantization are planted from GGML's blocks, a few rounds over.
"$PYTHON" "$HERE/make_kquant_input.py"
for round in 1 2 3 4; do
    "$TMP/ggml_kquants" "$HERE/kquant_input.f32" "$HERE" kq_ q4_k q5_k q6_k >/dev/null
    "$PYTHON" "$HERE/make_kquant_input.py" --plant-ties
done
"$TMP/ggml_kquants" "$HERE/kquant_input.f32" "$HERE" kq_ q4_k q5_k q6_k q5_0 q5_1 q2_k q3_k iq4_nl iq4_xs
"$PYTHON" "$HERE/make_kquant_input.py" --count-ties
# Importance-weighted (llama-quantize --imatrix): the same input as rows of 1024.
"$TMP/ggml_kquants" --imatrix "$HERE/kquant_imatrix.f32" 1024 "$HERE/kquant_input.f32" "$HERE" \
    kqw_ q4_k q5_k q6_k q5_0 q5_1 q2_k q3_k iq4_nl iq4_xs
"$TMP/ggml_kquants" "$HERE/input.f32" "$HERE" "" q5_0 q5_1

cd "$HERE"
{
    printf '{\n "generator": "quantizer/tests/vectors/make_kquant_vectors.sh",\n'
    printf ' "ggml": "%s",\n' "$(git -C "$LLAMA_CPP" describe --always 2>/dev/null || basename "$(dirname "$LLAMA_CPP")")"
    printf ' "libggml_base": "%s",\n' "$(basename "$(readlink -f "$LIB/libggml-base.so")")"
    printf ' "sha256": {\n'
    first=1
    for f in kquant_input.f32 kquant_imatrix.f32 kqw_q4_k.bin kqw_q5_k.bin kqw_q6_k.bin \
        kqw_q5_0.bin kqw_q5_1.bin kq_q4_k.bin kq_q5_k.bin kq_q6_k.bin kq_q5_0.bin kq_q5_1.bin q5_0.bin q5_1.bin \
        kq_q2_k.bin kq_q3_k.bin kq_iq4_nl.bin kq_iq4_xs.bin kqw_q2_k.bin kqw_q3_k.bin kqw_iq4_nl.bin \
        kqw_iq4_xs.bin kq_q2_k.deq.f32 kq_q3_k.deq.f32 kq_iq4_nl.deq.f32 kq_iq4_xs.deq.f32 \
        kqw_q2_k.deq.f32 kqw_q3_k.deq.f32 kqw_iq4_nl.deq.f32 kqw_iq4_xs.deq.f32; do
        [ $first = 1 ] || printf ',\n'
        first=0
        printf '  "%s": "%s"' "$f" "$(sha256sum "$f" | cut -d' ' -f1)"
    done
    printf '\n }\n}\n'
} > kquant_manifest.json
cat kquant_manifest.json
