#!/usr/bin/env python3
"""Make the GGML cross-check vectors for kiln-quantize's reference Q8_0/Q4_0 quantizers.

The expected bytes come from PyPI's `gguf` package (`gguf.quants.quantize`), an independent
numpy implementation that is bit-exact with ggml-quants.c's quantize_row_q8_0_ref /
quantize_row_q4_0_ref. The Rust test `quantizer/tests/ggml_vectors.rs` asserts byte equality.

Usage (CI venv made by ci/python-env.sh, or any venv with gguf + numpy):

    target/pyenv/bin/python quantizer/tests/vectors/make_vectors.py

Writes, next to this script:
    input.f32     N blocks x 32 little-endian float32 values
    q8_0.bin      N x 34 bytes (f16 scale, 32 int8 codes)
    q4_0.bin      N x 18 bytes (f16 scale, 16 bytes of nibbles)
    manifest.json versions, block count, what each range of blocks exercises, sha256s

The inputs avoid one range on purpose: blocks whose largest magnitude is below ~3.7e-37, where
1/d overflows to infinity and C's float->int conversion in GGML is undefined behaviour.
"""
import hashlib
import json
import os
import sys

import numpy as np
import gguf
from gguf.quants import quantize
from gguf import GGMLQuantizationType as T

QK = 32
HERE = os.path.dirname(os.path.abspath(__file__))


def blocks():
    rng = np.random.default_rng(20240611)
    groups = []

    def add(name, arr):
        arr = np.asarray(arr, dtype=np.float32).reshape(-1, QK)
        groups.append((name, arr))

    # Random normal at scales spanning typical weights and beyond.
    scales = np.float32(10.0) ** rng.uniform(-4, 2, size=(120, 1)).astype(np.float32)
    add("normal at scales 1e-4..1e2", rng.standard_normal((120, QK)).astype(np.float32) * scales)
    # Uniform, heavy-tailed (Student t, 2 dof) and bf16-rounded values (what a bf16 model holds).
    add("uniform -1..1", rng.uniform(-1, 1, (30, QK)))
    add("student-t 2 dof", rng.standard_t(2, (30, QK)))
    bf = rng.standard_normal((20, QK)).astype(np.float32) * np.float32(0.02)
    bf = (bf.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    add("bf16-rounded normal*0.02", bf)
    # Q8_0 ties: max 127 gives d = 1 exactly, so k + 0.5 values hit roundf's tie rule.
    t8 = []
    for s in (1.0, -1.0):
        b = np.arange(-15.5, 16.5, 1.0, dtype=np.float32)
        b[0] = 127.0 * s
        t8.append(b)
        b2 = np.full(QK, 0.5, np.float32) * np.sign(np.arange(QK) - 15.5).astype(np.float32)
        b2[3] = -127.0 * s
        t8.append(b2)
    add("q8_0 exact half steps", t8)
    # Q4_0 ties: max -8 gives d = 1, x*id + 8.5 lands on integers and half integers.
    t4 = []
    for s in (1.0, -1.0):
        b = (np.arange(QK, dtype=np.float32) % 16 - 7.5) * s
        b[5] = -8.0 * s
        t4.append(b)
        b = (np.arange(QK, dtype=np.float32) % 16 - 8.0) * np.float32(0.5) * s
        b[0] = -8.0 * s
        t4.append(b)
    add("q4_0 exact half steps", t4)
    # All zero (scale 0, codes 0 / nibble 8) and signed zeros.
    add("all zero", np.zeros((2, QK)))
    z = np.zeros(QK, np.float32)
    z[::2] = -0.0
    add("signed zeros", z)
    # One large outlier among small values, at different positions and signs.
    out = rng.standard_normal((12, QK)).astype(np.float32) * np.float32(0.01)
    for i in range(12):
        out[i, (i * 5) % QK] = (100.0 if i % 2 else -100.0) * (i + 1)
    add("single outlier", out)
    # Equal-magnitude extremes of both signs (the first one wins in Q4_0), both orders.
    ext = rng.uniform(-1, 1, (6, QK)).astype(np.float32)
    for i in range(6):
        a, b = (i * 3) % QK, (i * 7 + 1) % QK
        ext[i, a], ext[i, b] = (3.0, -3.0) if i % 2 else (-3.0, 3.0)
    add("+/- extremes of equal magnitude", ext)
    # Values hitting the +7 clip opposite the extreme: extreme -1, others near +1.
    clip = rng.uniform(0.8, 1.0, (6, QK)).astype(np.float32)
    clip[:, 0] = -1.0
    clip[3:] *= -1.0
    add("q4_0 +7 clip", clip)
    # Tiny values: f16-subnormal scales, scales that flush to 0 in f16, f32 near-denormal data.
    add("tiny 1e-6 (f16-subnormal scale)", rng.standard_normal((4, QK)) * 1e-6)
    add("tiny 1e-9 (f16 scale flushes to 0)", rng.standard_normal((4, QK)) * 1e-9)
    add("tiny 1e-30", rng.standard_normal((4, QK)) * 1e-30)
    # Large values (f16 scale near its range) and constant blocks.
    add("large 1e4..6e6", rng.standard_normal((4, QK)) * np.array([[1e4], [1e5], [1e6], [6e6]]))
    add("constant", np.stack([np.full(QK, v, np.float32) for v in (1.0, -1.0, 0.3, -7.25)]))
    return groups


def main():
    groups = blocks()
    x = np.concatenate([g for _, g in groups]).astype(np.float32)
    assert x.shape[1] == QK and np.isfinite(x).all()
    assert (np.abs(x).max(axis=1)[np.abs(x).max(axis=1) > 0] > 3.7e-37).all()
    q8 = quantize(x, T.Q8_0)
    q4 = quantize(x, T.Q4_0)
    assert q8.shape == (x.shape[0], 34) and q4.shape == (x.shape[0], 18)
    files = {
        "input.f32": x.astype("<f4").tobytes(),
        "q8_0.bin": q8.tobytes(),
        "q4_0.bin": q4.tobytes(),
    }
    for name, data in files.items():
        with open(os.path.join(HERE, name), "wb") as f:
            f.write(data)
    ranges, start = [], 0
    for name, g in groups:
        ranges.append({"blocks": [start, start + len(g)], "what": name})
        start += len(g)
    manifest = {
        "generator": "quantizer/tests/vectors/make_vectors.py",
        "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf"),
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "blocks": int(x.shape[0]),
        "groups": ranges,
        "sha256": {n: hashlib.sha256(d).hexdigest() for n, d in files.items()},
    }
    with open(os.path.join(HERE, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    print(f"{x.shape[0]} blocks, {sum(len(d) for d in files.values())} bytes")


def _dist_version(name):
    from importlib.metadata import version
    return version(name)


if __name__ == "__main__":
    main()
