#!/usr/bin/env python3
"""Draw Kiln's and llama.cpp's throughput against model size and against context depth.

    python benches/chart.py OUT.png --kiln K1.json [K2.json …] [--llama L1.json …]
        [--bandwidth GBS] [--depth-model NAME]

Inputs are the tools' own JSON: `kiln-run bench … --json` (one object per run, with
`size_bytes` and `results`) and `llama-bench … -o json` (a list of results, with
`model_size`, `n_prompt`, `n_gen`, `n_depth`, `flash_attn`, `samples_ts`). Each point is the
median of a run's samples; several runs of the same test and file are combined by their
median.

Three panels:
1. decode (`tgN` at depth 0) against the file's size, with the ceiling a decode step cannot
   pass when it reads every weight once at `--bandwidth` GB/s (the probe of
   kernels/examples/bandwidth.rs): tok/s = bandwidth / bytes;
2. decode against depth (`tgN @ dD`), for the files whose name contains `--depth-model`;
3. prefill (`ppN`, `ppN @ dD`) against depth, same files.

llama.cpp's runs are drawn per flash-attention setting (`-fa 0`, `-fa 1`). Needs matplotlib
(`pip install matplotlib`); the chart is documentation, not a test, so CI does not draw it.
"""
import argparse
import json
import os
import statistics
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def kiln_points(paths):
    """(label, file, size, kind, n, depth) -> [tok/s] from kiln-run bench JSON."""
    pts = defaultdict(list)
    for p in paths:
        run = json.load(open(p))
        name = os.path.basename(run["model"])
        for r in run["results"]:
            kind = "tg" if r["test"].startswith("tg") else "pp"
            key = ("Kiln", name, run["size_bytes"], kind, r["n_tokens"], r["n_depth"])
            pts[key].append(statistics.median(r["samples"]))
    return pts


def llama_points(paths):
    """The same keys from llama-bench JSON, labelled by flash attention."""
    pts = defaultdict(list)
    for p in paths:
        for r in json.load(open(p)):
            kind, n = ("tg", r["n_gen"]) if r["n_gen"] else ("pp", r["n_prompt"])
            label = f"llama.cpp -fa {int(bool(r.get('flash_attn')))}"
            name = os.path.basename(r["model_filename"])
            key = (label, name, r["model_size"], kind, n, r.get("n_depth", 0))
            pts[key].append(statistics.median(r["samples_ts"]))
    return pts


def series(pts, kind, x_of, want):
    """label -> sorted [(x, tok/s)] of the points of `kind` that `want` keeps."""
    out = defaultdict(list)
    for key, v in pts.items():
        label, name, size, k, n, depth = key
        if k == kind and want(name, depth):
            out[label].append((x_of(size, depth), statistics.median(v)))
    return {label: sorted(xy) for label, xy in out.items()}


STYLE = {"Kiln": dict(color="#c0392b", marker="o", lw=2),
         "llama.cpp -fa 0": dict(color="#2c3e50", marker="s", ls="--"),
         "llama.cpp -fa 1": dict(color="#7f8c8d", marker="^", ls=":")}


def draw(ax, ser, title, xlabel, logx=False):
    for label, xy in sorted(ser.items()):
        xs, ys = zip(*xy)
        ax.plot(xs, ys, label=label, **STYLE.get(label, {}))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("tokens / s")
    if logx:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--kiln", nargs="+", required=True)
    ap.add_argument("--llama", nargs="*", default=[])
    ap.add_argument("--bandwidth", type=float, help="probe GB/s, for the decode ceiling")
    ap.add_argument("--depth-model", default="1b", help="substring of the depth panels' files")
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    pts = kiln_points(a.kiln)
    pts.update(llama_points(a.llama))

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    size = series(pts, "tg", lambda s, d: s / 1e9, lambda n, d: d == 0)
    draw(axes[0], size, "decode at depth 0 against file size", "file size (GB)", logx=True)
    if a.bandwidth:
        xs = sorted({x for xy in size.values() for x, _ in xy})
        if xs:
            lo, hi = xs[0] * 0.8, xs[-1] * 1.25
            grid = [lo * (hi / lo) ** (i / 40) for i in range(41)]
            axes[0].plot(grid, [a.bandwidth / g for g in grid], color="#27ae60", lw=1,
                         label=f"reads every weight at {a.bandwidth:g} GB/s")
            axes[0].legend(fontsize=8)
    deep = lambda n, d: a.depth_model in n  # noqa: E731
    draw(axes[1], series(pts, "tg", lambda s, d: d, deep), "decode against depth",
         "tokens already in the KV cache")
    draw(axes[2], series(pts, "pp", lambda s, d: d, deep), "prefill against depth",
         "tokens already in the KV cache")
    if a.title:
        fig.suptitle(a.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
