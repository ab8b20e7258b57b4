#!/usr/bin/env python3
"""kiln-run bench beside llama-bench at context depth, interleaved, on the same weights.

    compare_depth.py KILN_RUN LLAMA_BENCH MODEL.kiln MODEL.gguf [ROUNDS]

Each round runs `kiln-run bench -p PP -n TG -d DEPTHS -r REPS` (f16 KV cache, Kiln's default)
and then `llama-bench -p PP -n TG -d DEPTHS -r REPS -fa 0,1` (f16 KV cache, llama.cpp's
default; flash attention off and on); both run a prompt in 512-token passes (Kiln's `-b` and
llama-bench's `-ub` defaults), 2 threads unless THREADS says otherwise. Each run
counts as the median of its repetitions; the table reports each tool's median over the rounds
and the ratios Kiln / llama.cpp. Progress goes to stderr, the Markdown table to stdout.

Environment: PP, TG, DEPTHS (comma list), REPS, THREADS (defaults 512, 32, "0,4096", 2, 2).
The GGUF is the .kiln exported by `kiln-convert export-gguf`, so both tools read the same
blocks.
"""
import json
import os
import statistics
import subprocess
import sys

if len(sys.argv) < 5:
    sys.exit(__doc__)
KILN, LLAMA, KILN_MODEL, GGUF = sys.argv[1:5]
ROUNDS = int(sys.argv[5]) if len(sys.argv) > 5 else 2
PP, TG = os.environ.get("PP", "512"), os.environ.get("TG", "32")
DEPTHS, REPS = os.environ.get("DEPTHS", "0,4096"), os.environ.get("REPS", "2")
THREADS = os.environ.get("THREADS", "2")
ENV = dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(os.path.abspath(LLAMA)))


def name(n_prompt, n_gen, depth):
    test = f"pp{n_prompt}" if n_prompt else f"tg{n_gen}"
    return f"{test} @ d{depth}" if depth else test


def kiln():
    args = [KILN, "bench", KILN_MODEL, "-p", PP, "-n", TG, "-d", DEPTHS, "-r", REPS,
            "-t", THREADS, "--no-verify", "--json"]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return {("kiln", r["test"]): statistics.median(r["samples"])
            for r in json.loads(out)["results"]}


def llama():
    args = [LLAMA, "-m", GGUF, "-p", PP, "-n", TG, "-d", DEPTHS, "-r", REPS, "-t", THREADS,
            "-fa", "0,1", "-o", "json"]
    out = subprocess.run(args, capture_output=True, text=True, check=True, env=ENV).stdout
    return {(f"llama fa{int(bool(r['flash_attn']))}",
             name(r["n_prompt"], r["n_gen"], r.get("n_depth", 0))): statistics.median(r["samples_ts"])
            for r in json.loads(out)}


res = {}
for rnd in range(ROUNDS):
    for run in (kiln, llama):
        for k, v in run().items():
            res.setdefault(k, []).append(v)
        print(rnd, {f"{k[0]}/{k[1]}": round(v[-1], 1) for k, v in res.items()},
              file=sys.stderr, flush=True)

tests = [t for tool, t in res if tool == "kiln"]
print("| test | Kiln (f16 cache) | llama.cpp -fa 0 | llama.cpp -fa 1 | Kiln / fa 0 | Kiln / fa 1 |")
print("|---|--:|--:|--:|--:|--:|")
for t in tests:
    m = {tool: statistics.median(res[(tool, t)]) for tool in ("kiln", "llama fa0", "llama fa1")
         if (tool, t) in res}
    if len(m) < 3:
        continue
    k, l0, l1 = m["kiln"], m["llama fa0"], m["llama fa1"]
    print(f"| {t} | {k:.1f} | {l0:.1f} | {l1:.1f} | {k / l0:.2f} | {k / l1:.2f} |")
