"""What the Python package's tests share: where the models and the command-line binaries are.

ci/python.sh makes the models (SmolLM2-135M-Instruct at Q4_0, all-MiniLM-L6-v2 at Q4_0, and
tiny fixtures of other families) with the release binaries, and points the tests at them:

- KILN_BIN: the directory of kiln-run, kiln-convert, kiln-quantize, kiln-verify
  (default target/release);
- KILN_PY_MODELS: the directory of the models (default target/python).

A test whose model or binary is missing is skipped, naming what is missing.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("KILN_BIN", ROOT / "target" / "release"))
MODELS = Path(os.environ.get("KILN_PY_MODELS", ROOT / "target" / "python"))
THREADS = 2


def model_path(name: str) -> Path:
    path = MODELS / name
    if not path.is_file():
        pytest.skip(f"{path} is missing: ci/python.sh makes it")
    return path


def binary(name: str) -> Path:
    path = BIN / name
    if not path.is_file():
        pytest.skip(f"{path} is missing: cargo build --release --bins")
    return path


def run_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run a Kiln binary (the first argument names it) with the given arguments."""
    exe = binary(args[0])
    return subprocess.run(
        [str(exe), *args[1:]], capture_output=True, text=True, timeout=300, check=check
    )


@pytest.fixture(scope="session")
def chat_model():
    import kiln

    return kiln.Model(model_path("smollm2-q4_0.kiln"), threads=THREADS, n_ctx=1024)


@pytest.fixture(scope="session")
def embed_model():
    import kiln

    return kiln.Model(model_path("minilm-q4_0.kiln"), threads=THREADS)
