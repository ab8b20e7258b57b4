#!/usr/bin/env python3
"""Fetch llama.cpp's tokenizer test vocabularies and Phi-3.5's chat template from PyPI.

Why: no registry CI can reach carries Phi-3's Hugging Face tokenizer, but the PyPI sdist of
`llama-cpp-python` vendors llama.cpp, whose `models/` holds vocabulary-only GGUF files
converted from the Hugging Face tokenizers of a dozen models (`ggml-vocab-<name>.gguf`, Phi-3's
from microsoft/Phi-3-mini-4k-instruct), each with test texts (`.inp`, texts separated by a line
`__ggml_vocab_test__`) and the ids transformers' `AutoTokenizer` gave for them (`.out`, one
line of ids per text, `encode(text, add_special_tokens=False)`, written by llama.cpp's
convert_hf_to_gguf_update.py). Kiln's GGUF tokenizer import is checked against those ids
(runner/tests/llama_cpp_vocabs.rs). `models/templates/microsoft-Phi-3.5-mini-instruct.jinja` is
Phi-3.5-mini-instruct's chat template, rendered by transformers for
fixtures/tokenizers/phi3.json.

The sdist is fetched by pip (`pip download`, by name and exact version, so a mirror, proxy or
offline cache configured for pip serves it), checked against the sha256 pinned here (so a
replaced file is refused) and cached in target/cache/tokenizers/. Produces
target/tokenizers/phi3/ (Phi-3's vocabulary, tests and chat template) and
target/tokenizers/llama-cpp-vocab/ (every other vocabulary that has tests). A no-op when both
are in place. Standard library and pip only (python3.8+).

    python3 ci/llama_cpp_vocabs.py [--root DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
# The sdist is 77 MB; a larger answer is not the package.
MAX_TARBALL_BYTES = 160 << 20
MODELS = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/models/"
TEMPLATE = "templates/microsoft-Phi-3.5-mini-instruct.jinja"
# Vocabularies with tests in that llama.cpp (gemma-4's is 16 MB, command-r's 11 MB).
VOCABS = [
    "bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2",
    "llama-bpe", "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder",
]


def log(msg: str) -> None:
    print(f"llama-cpp-vocabs: {msg}", file=sys.stderr)


def layout() -> dict:
    """Output directory -> {name in the output: path under MODELS}."""
    out = {"phi3": {"phi3.5-mini-instruct.jinja": TEMPLATE}, "llama-cpp-vocab": {}}
    for v in VOCABS:
        dest = out["phi3" if v == "phi-3" else "llama-cpp-vocab"]
        for ext in ("", ".inp", ".out"):
            dest[f"ggml-vocab-{v}.gguf{ext}"] = f"ggml-vocab-{v}.gguf{ext}"
    return out


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pip_download(into: Path) -> Path:
    """The sdist, downloaded by pip into `into`.

    `--no-binary` names the package alone: pip still prepares the sdist's metadata, and a
    blanket `:all:` would make it build the build backend's own dependencies (cmake among
    them) from source first. `--no-deps`: only the package's own file is wanted."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
        "--no-binary", PACKAGE, "--dest", str(into), f"{PACKAGE}=={VERSION}",
    ]
    log(f"pip download {PACKAGE}=={VERSION}")
    done = subprocess.run(cmd, stdin=subprocess.DEVNULL, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"llama-cpp-vocabs: pip download {PACKAGE}=={VERSION} failed "
                         f"(exit status {done.returncode})")
    got = into / SDIST
    if not got.is_file():
        raise SystemExit(f"llama-cpp-vocabs: pip download left no {SDIST} in {into}")
    return got


def fetch(dest: Path) -> Path:
    """The checked tarball in the cache, downloaded if it is missing or wrong."""
    if dest.is_file() and sha256_of(dest) == SHA256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        got = pip_download(Path(tmp))
        if got.stat().st_size > MAX_TARBALL_BYTES:
            raise SystemExit(f"llama-cpp-vocabs: {SDIST} is larger than {MAX_TARBALL_BYTES} bytes")
        if sha256_of(got) != SHA256:
            raise SystemExit(f"llama-cpp-vocabs: {SDIST} does not match the pinned sha256 {SHA256}")
        os.replace(got, dest)
    return dest


def unpack(tarball: Path, root: Path, stamp_text: str) -> None:
    """Write each output directory of `layout()` whole, replacing what was there."""
    base = root / "target/tokenizers"
    base.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball, mode="r:gz") as tar, tempfile.TemporaryDirectory(dir=base) as tmp:
        for name, files in layout().items():
            staged = Path(tmp) / name
            staged.mkdir()
            for out_name, member_name in files.items():
                member = tar.getmember(MODELS + member_name)
                if not member.isfile():
                    raise SystemExit(f"llama-cpp-vocabs: {member.name} is not a file")
                src = tar.extractfile(member)
                assert src is not None
                (staged / out_name).write_bytes(src.read())
            (staged / ".source").write_text(stamp_text)
            out = base / name
            if out.exists():
                os.replace(out, Path(tmp) / f"old-{name}")
            os.replace(staged, out)
            log(f"{out}: {len(files)} files from {SDIST}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = ap.parse_args(argv)
    stamp_text = f"{SDIST} sha256:{SHA256}\n"
    fresh = all(
        (args.root / "target/tokenizers" / name / ".source").is_file()
        and (args.root / "target/tokenizers" / name / ".source").read_text() == stamp_text
        and all((args.root / "target/tokenizers" / name / f).is_file() for f in files)
        for name, files in layout().items()
    )
    if fresh:
        log("target/tokenizers/{phi3,llama-cpp-vocab} are up to date")
        return 0
    tarball = fetch(args.root / "target/cache/tokenizers" / SDIST)
    unpack(tarball, args.root, stamp_text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
