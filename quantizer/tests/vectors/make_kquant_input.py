#!/usr/bin/env python3
"""Make kquant_input.f32: super-blocks of 256 float32 values for the GGML cross-check of
kiln-quantize's K-quant (Q4_K, Q5_K, Q6_K) and Q5_0/Q5_1 reference quantizers.

Each group exercises one path of GGML's algorithms (make_qkx2_quants' candidate scales and its
max == min shortcut, make_qx_quants' all-zero threshold, 6-bit scales of 0, f16 scales that
flush to zero, clipping, and exact ties in the final requantization, which are planted in a
second pass from the blocks GGML made of the first: `--plant-ties` moves values onto half
steps of their sub-block's grid, `--count-ties` checks that the final blocks still meet them).
kquant_groups.json records the ranges. Needs numpy only.

Like make_vectors.py, the inputs avoid blocks whose largest magnitude is below ~3.7e-37, where
1/d overflows in the Q5 rules and C's float->int conversion is undefined behaviour.
"""
import json
import os
import sys

import numpy as np

QK_K = 256
HERE = os.path.dirname(os.path.abspath(__file__))


def groups():
    rng = np.random.default_rng(20251126)
    out = []

    def add(name, arr):
        arr = np.asarray(arr, dtype=np.float32).reshape(-1, QK_K)
        out.append((name, arr))

    def sub_scaled(n, spread):
        # Normal values whose 32-value sub-blocks differ in magnitude by up to 10^spread.
        x = rng.standard_normal((n, 8, 32)).astype(np.float32)
        x *= (np.float32(10.0) ** rng.uniform(-spread, 0, (n, 8, 1))).astype(np.float32)
        return x.reshape(n, QK_K)

    scales = np.float32(10.0) ** rng.uniform(-4, 2, (8, 1)).astype(np.float32)
    add("normal at scales 1e-4..1e2", rng.standard_normal((8, QK_K)).astype(np.float32) * scales)
    add("sub-blocks of mixed magnitude (10^-1.5..1)", sub_scaled(3, 1.5))
    add("sub-blocks of mixed magnitude (10^-4..1): 6-bit scales of 0", sub_scaled(2, 4))
    bf = sub_scaled(3, 1.0) * np.float32(0.02)
    bf = (bf.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    add("bf16-rounded normal*0.02", bf)
    add("student-t 2 dof", rng.standard_t(2, (2, QK_K)))
    add("uniform -1..1", rng.uniform(-1, 1, (1, QK_K)))
    add("all zero", np.zeros((1, QK_K)))
    z = np.zeros(QK_K, np.float32)
    z[::3] = -0.0
    add("signed zeros", z)
    zs = rng.standard_normal((2, 16, 16)).astype(np.float32)
    zs[0, ::2] = 0.0  # every other 16-value sub-block zero (Q6_K), sub-blocks of 32 half zero
    zs[1, 4:8] = 0.0  # two whole 32-value sub-blocks zero
    add("all-zero sub-blocks among normal ones", zs.reshape(2, QK_K))
    neg = -np.abs(rng.standard_normal((2, QK_K)).astype(np.float32)) - np.float32(0.5)
    add("negative only", neg)
    pos = np.abs(rng.standard_normal((1, QK_K)).astype(np.float32)) + np.float32(0.5)
    add("positive only (min clamped to 0)", pos)
    const = np.stack([np.full(QK_K, v, np.float32) for v in (1.0, -0.3)])
    add("constant (max == min for the negative one)", const)
    cs = rng.standard_normal((1, 8, 32)).astype(np.float32)
    cs[0, 1] = -2.0  # a constant negative sub-block among normal ones
    cs[0, 6] = 3.0
    add("constant sub-blocks among normal ones", cs.reshape(1, QK_K))
    outl = rng.standard_normal((3, QK_K)).astype(np.float32) * np.float32(0.01)
    for i in range(3):
        outl[i, (i * 97) % QK_K] = (100.0, -250.0, 1000.0)[i]
    add("single outlier", outl)
    g = np.arange(QK_K, dtype=np.float32)
    add("codes on the grid: (i % 16) * 0.25, (i % 32) * 0.125 - 2", np.stack([
        (g % 16) * np.float32(0.25), (g % 32) * np.float32(0.125) - np.float32(2.0)]))
    t = (g % 32 - np.float32(15.5))
    t[::32] = -16.0
    add("half steps: max -16 gives Q5_0 d = 1", t)
    for t in TIE_TYPES:
        add(f"{t} requantization ties (planted by --plant-ties)",
            rng.standard_normal((2, QK_K)) * np.float32(0.05))
    add("tiny 1e-6 (f16-subnormal scales)", rng.standard_normal((1, QK_K)) * 1e-6)
    add("tiny 1e-9 (f16 scales flush to 0)", rng.standard_normal((1, QK_K)) * 1e-9)
    add("1e-14 and 1e-16 (around Q6_K's zero threshold 1e-15)",
        np.stack([rng.standard_normal(QK_K) * 1e-14, rng.standard_normal(QK_K) * 1e-16]))
    add("tiny 1e-30", rng.standard_normal((1, QK_K)) * 1e-30)
    add("large 1e3 and 1e4", rng.standard_normal((2, QK_K)) * np.array([[1e3], [1e4]]))
    return out


TIE_TYPES = ("q4_k", "q5_k", "q6_k")
BLOCK_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}
NMAX = {"q4_k": 15, "q5_k": 31}


def f16(b, off):
    return np.frombuffer(b[off:off + 2], "<f2")[0].astype(np.float32)


def sub_scales(t, blk):
    """(ds, dm) per sub-block as GGML's requantization computes them (float32)."""
    if t == "q6_k":
        d = f16(blk, 208)
        sc = np.frombuffer(blk[192:208], np.int8).astype(np.float32)
        return [(np.float32(d * s), np.float32(0.0)) for s in sc]
    d, dmin, s = f16(blk, 0), f16(blk, 2), blk[4:16]
    out = []
    for j in range(8):
        if j < 4:
            sc, m = s[j] & 63, s[j + 4] & 63
        else:
            sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4)
            m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4)
        out.append((np.float32(d * np.float32(sc)), np.float32(dmin * np.float32(m))))
    return out


def tie_sites(gs, t):
    start = 0
    for name, g in gs:
        if name.startswith(f"{t} requantization ties"):
            return range(start, start + len(g))
        start += len(g)
    raise SystemExit(f"no tie group for {t}")


def plant_or_count(x, gs, plant):
    """Move the values that lie near a half step of their sub-block's grid
    (within 2% of a step, as the blocks GGML made from them say) exactly onto it, so that GGML's requantization
    rounds a tie; or, with plant false, count the exact ties the final blocks meet."""
    counts = {}
    for t in TIE_TYPES:
        with open(os.path.join(HERE, f"kq_{t}.bin"), "rb") as f:
            q = f.read()
        n = 0
        for sb in tie_sites(gs, t):
            blk = q[sb * BLOCK_BYTES[t]:(sb + 1) * BLOCK_BYTES[t]]
            subs = sub_scales(t, blk)
            size = QK_K // len(subs)
            lo, hi = (-32, 30) if t == "q6_k" else (0, NMAX[t] - 1)
            for j, (ds, dm) in enumerate(subs):
                if ds == 0:
                    continue
                for i in range(sb * QK_K + j * size, sb * QK_K + (j + 1) * size):
                    v = np.float32(np.float32(x.flat[i] + dm) / ds)
                    k = np.floor(v)
                    if plant and lo <= k <= hi and abs(v - (k + 0.5)) < 0.02:
                        y = np.float32(np.float32(np.float32(k + 0.5) * ds) - dm)
                        if np.float32(np.float32(y + dm) / ds) == np.float32(k + 0.5):
                            x.flat[i] = y
                            n += 1
                    elif not plant and v == k + 0.5:
                        n += 1
        counts[t] = n
    return counts


def imatrix():
    """1024 importance weights (one per column of a row): mean squares of activations span
    orders of magnitude, a few columns dominate, some are never used (zero)."""
    rng = np.random.default_rng(7)
    w = np.exp(rng.normal(0, 1.5, 1024)).astype("<f4")
    w[rng.choice(1024, 8, replace=False)] *= np.float32(1e3)
    w[rng.choice(1024, 40, replace=False)] = 0.0
    w[:32] = 0.0  # a whole block (and sub-block) of zero importance
    return w


def main():
    gs = groups()
    x = np.concatenate([g for _, g in gs]).astype("<f4")
    assert x.shape[1] == QK_K and np.isfinite(x).all()
    if "--count-ties" in sys.argv:
        x = np.fromfile(os.path.join(HERE, "kquant_input.f32"), "<f4").reshape(-1, QK_K)
        counts = plant_or_count(x, gs, plant=False)
        print("exact requantization ties in the final blocks:", counts)
        if min(counts.values()) == 0:
            raise SystemExit("no ties left for some type; change the seed")
        return
    if "--plant-ties" in sys.argv:
        x = np.fromfile(os.path.join(HERE, "kquant_input.f32"), "<f4").reshape(-1, QK_K)
        print("planted:", plant_or_count(x, gs, plant=True))
    with open(os.path.join(HERE, "kquant_input.f32"), "wb") as f:
        f.write(x.tobytes())
    with open(os.path.join(HERE, "kquant_imatrix.f32"), "wb") as f:
        f.write(imatrix().tobytes())
    ranges, start = [], 0
    for name, g in gs:
        ranges.append({"super_blocks": [start, start + len(g)], "what": name})
        start += len(g)
    with open(os.path.join(HERE, "kquant_groups.json"), "w") as f:
        json.dump({"super_blocks": int(x.shape[0]), "groups": ranges}, f, indent=1)
        f.write("\n")
    print(f"{x.shape[0]} super-blocks")


if __name__ == "__main__":
    main()
