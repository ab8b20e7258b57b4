#!/usr/bin/env bash
# Create (or reuse) the Python environment for Kiln's fixture tooling.
#
# Why: the SmolLM2 fixture is rebuilt in CI from a GGUF with numpy/gguf/tokenizers,
# and the committed fixtures are checked with safetensors. None of that needs torch,
# so this venv stays small and installs in seconds from PyPI wheels.
#
# Usage: run it (do not source it). It is idempotent: the venv at target/pyenv
# (relative to the repository root) is rebuilt only when ci/python-requirements.txt
# changed or the venv is broken. On success the venv's python path is the only thing
# printed on stdout, so callers can do:
#
#     PY="$(ci/python-env.sh)"
#     "$PY" fixtures/smollm2/make_checkpoint.py --out ...
#
# Needs: python3.11 (or $PYTHON) with the venv module and pip available.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/target/pyenv"
req="$root/ci/python-requirements.txt"
stamp="$venv/.kiln-requirements.sha256"

py="${PYTHON:-}"
if [[ -z "$py" ]]; then
    for cand in python3.11 python3; do
        if command -v "$cand" >/dev/null 2>&1; then py="$cand"; break; fi
    done
fi
if [[ -z "$py" ]]; then
    echo "python-env.sh: no python3.11/python3 found (set PYTHON=...)" >&2
    exit 1
fi

want="$(sha256sum "$req" | cut -d' ' -f1)"
if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]] \
    && "$venv/bin/python" -c 'import gguf, numpy, safetensors, tokenizers' >/dev/null 2>&1; then
    echo "$venv/bin/python"
    exit 0
fi

echo "python-env.sh: creating $venv with $("$py" --version 2>&1)" >&2
rm -rf "$venv"
mkdir -p "$root/target"
if ! "$py" -m venv "$venv" >&2; then
    echo "python-env.sh: '$py -m venv' failed (on Debian: apt-get install python3-venv)" >&2
    rm -rf "$venv"
    exit 1
fi
"$venv/bin/python" -m pip install --disable-pip-version-check --no-input -q -r "$req" >&2
"$venv/bin/python" -c 'import gguf, numpy, safetensors, tokenizers' >&2
echo "$want" > "$stamp"
echo "$venv/bin/python"
