#!/usr/bin/env python3
"""Draw KL-divergence against file size: Kiln's `--to auto` files beside the other measured
files (llama.cpp's importance-matrix files, Kiln's calibrated mixes), one panel per text.

    python benches/kld_chart.py OUT.png --auto target/auto-kld/summary.txt --points POINTS.csv

`--auto` is benches/auto_kld.sh's summary (the last line of each budget and text counts).
`--points` is a CSV with the header `tool,file,text,mb,kld`: one measured file per row, `mb`
its GGUF size in MB (10^6 bytes), `kld` its mean KL-divergence against F32 on `text` (gpl-3,
ulysses-1); docs/kld-size.csv holds docs/ACCURACY.md's measured files.
Needs matplotlib (`pip install matplotlib`); the chart is documentation, not a test.
"""
import argparse
import csv
import re
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LINE = re.compile(
    r"^(?P<budget>\S+)\s+(?P<bytes>\d+) gguf-bytes\s+(?P<text>\S+)\s+mean KL-divergence (?P<kld>[0-9.]+)"
)


def read_auto(path):
    last = {}
    with open(path) as f:
        for line in f:
            m = LINE.match(line)
            if m:
                last[(m["budget"], m["text"])] = (int(m["bytes"]), float(m["kld"]))
    points = defaultdict(list)
    for (budget, text), (size, kld) in last.items():
        points[text].append((size, kld, budget))
    return points


def read_points(path):
    series = defaultdict(lambda: defaultdict(list))
    with open(path) as f:
        for row in csv.DictReader(f):
            series[row["text"]][row["tool"]].append(
                (float(row["mb"]) * 1e6, float(row["kld"]), row["file"])
            )
    return series


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--auto", required=True)
    ap.add_argument("--points", required=True)
    ap.add_argument("--title", default="SmolLM2-135M: KL-divergence against F32 by file size")
    args = ap.parse_args()
    auto = read_auto(args.auto)
    other = read_points(args.points)
    texts = sorted(set(auto) | set(other))
    fig, axes = plt.subplots(1, len(texts), figsize=(6.5 * len(texts), 5), squeeze=False)
    markers = ["s", "^", "D", "v", "P"]
    for ax, text in zip(axes[0], texts):
        for i, (tool, pts) in enumerate(sorted(other[text].items())):
            pts.sort()
            ax.scatter(
                [p[0] / 1e6 for p in pts],
                [p[1] for p in pts],
                marker=markers[i % len(markers)],
                label=tool,
                zorder=3,
            )
            for size, kld, name in pts:
                ax.annotate(name, (size / 1e6, kld), fontsize=7, xytext=(4, 3),
                            textcoords="offset points")
        pts = sorted(auto.get(text, []))
        if pts:
            ax.plot(
                [p[0] / 1e6 for p in pts],
                [p[1] for p in pts],
                "o-",
                color="black",
                label="Kiln --to auto (calibrated)",
                zorder=4,
            )
            for size, kld, budget in pts:
                ax.annotate(budget, (size / 1e6, kld), fontsize=7, xytext=(4, -10),
                            textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xlabel("GGUF file size (MB)")
        ax.set_ylabel("mean KL-divergence against F32")
        ax.set_title(f"{text} (unseen by calibration)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
