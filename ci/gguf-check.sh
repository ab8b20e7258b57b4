#!/usr/bin/env bash
# Check `kiln-convert export-gguf` with an independent GGUF reader (PyPI's `gguf`, the one
# llama.cpp's Python tools use): every tiny fixture and the real SmolLM2 (bf16, f16, and Q8_0
# and Q4_0 made by kiln-quantize) are exported and checked against their Hugging Face
# checkpoint by fixtures/gguf/check_gguf.py (metadata, tokenizer, every tensor's values).
# The fuzz seeds in fuzz/corpus/gguf/ must load in the same reader. Also fetches the Gemma 3
# 270M Q4_K_M GGUF (ci/gemma3.sh) for the Rust tests that import it and check it against
# transformers. Run by ci/check-fixtures.sh.
# Outputs land in target/gguf-check/. Ends with "gguf-check: N files checked".
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="$(ci/python-env.sh)"
ci/smollm2.sh >&2
cargo build --release -p kiln-convert -p kiln-quantize --bins

ci/gemma3.sh > /dev/null
bin=target/release
out=target/gguf-check
mkdir -p "$out"
n=0

for dir in fixtures/tiny/*/; do
    name="$(basename "$dir")"
    [[ -f "$dir/config.json" ]] || continue
    "$bin/kiln-convert" hf "$dir" -o "$out/$name.kiln" --force > /dev/null 2>&1
    if [[ "$name" == gemma3-* ]]; then
        # The tiny Gemma 3 is not a model llama.cpp would run as Kiln does (its layer pattern
        # and score scale): export must refuse (status 2) and write nothing.
        rm -f "$out/$name.gguf"
        status=0
        "$bin/kiln-convert" export-gguf "$out/$name.kiln" -o "$out/$name.gguf" 2> /dev/null || status=$?
        if [[ $status -ne 2 || -e "$out/$name.gguf" ]]; then
            echo "gguf-check: export of $name should be refused with status 2 (got $status)" >&2
            exit 1
        fi
        continue
    fi
    "$bin/kiln-convert" export-gguf "$out/$name.kiln" -o "$out/$name.gguf" --force 2> /dev/null
    "$py" fixtures/gguf/check_gguf.py "$out/$name.gguf" "$dir" --pre gpt-2
    n=$((n + 1))
done

m=target/models/smollm2-bf16
"$bin/kiln-convert" hf "$m" -o "$out/smollm2-bf16.kiln" --force > /dev/null 2>&1
"$bin/kiln-convert" hf "$m" -o "$out/smollm2-f16.kiln" --dtype f16 --force > /dev/null 2>&1
for t in q8_0 q4_0; do
    "$bin/kiln-quantize" "$out/smollm2-bf16.kiln" "$out/smollm2-$t.kiln" --to "$t" --method reference --force > /dev/null
done
for t in bf16 f16 q8_0 q4_0; do
    "$bin/kiln-convert" export-gguf "$out/smollm2-$t.kiln" -o "$out/smollm2-$t.gguf" --force 2> /dev/null
    "$py" fixtures/gguf/check_gguf.py "$out/smollm2-$t.gguf" "$m" --pre smollm
    n=$((n + 1))
done

"$py" - fuzz/corpus/gguf/*.gguf <<'PY'
import sys, gguf
for p in sys.argv[1:]:
    gguf.GGUFReader(p)
print(f"fuzz/corpus/gguf: {len(sys.argv) - 1} seeds load in gguf")
PY
echo "gguf-check: $n files checked"
