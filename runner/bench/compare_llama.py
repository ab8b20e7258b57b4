#!/usr/bin/env python3
"""kiln-run bench beside llama-bench, interleaved, on the same checkpoint.

    compare_llama.py KILN_RUN LLAMA_BENCH DIR [ROUNDS] [DTYPES] [THREADS]

DIR holds `sm-{dtype}.kiln` and `smollm2-{dtype}.gguf` for each dtype (the GGUFs exported
from the .kiln files by `kiln-convert export-gguf`). Each round runs, for every dtype and
thread count, `kiln-run bench -p 128 -n 64 -r 3` and then `llama-bench -p 128 -n 64 -r 3`
back to back; each run counts as the median of its repetitions, and the table reports each
tool's median over the rounds. Progress goes to stderr, the Markdown table to stdout.

Environment: PP and TG change the prompt and generation lengths (default 128 and 64);
KILN_PREFIX and GGUF_PREFIX the file names' prefixes (default `sm` and `smollm2`), so that
other checkpoints (the 1B shape of benches/random_checkpoint.py) run the same way.
"""
import json
import os
import statistics
import subprocess
import sys

if len(sys.argv) < 4:
    sys.exit(__doc__)
KILN, LLAMA, DIR = sys.argv[1:4]
ROUNDS = int(sys.argv[4]) if len(sys.argv) > 4 else 3
DTYPES = sys.argv[5].split(",") if len(sys.argv) > 5 else ["f16", "q8_0", "q4_0"]
THREADS = [int(t) for t in sys.argv[6].split(",")] if len(sys.argv) > 6 else [1, 2]
ENV = dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(os.path.abspath(LLAMA)))
PP, TG = os.environ.get("PP", "128"), os.environ.get("TG", "64")
KILN_PREFIX = os.environ.get("KILN_PREFIX", "sm")
GGUF_PREFIX = os.environ.get("GGUF_PREFIX", "smollm2")


def kiln(dtype, threads):
    out = subprocess.run(
        [KILN, "bench", f"{DIR}/{KILN_PREFIX}-{dtype}.kiln", "-p", PP, "-n", TG, "-r", "3",
         "-t", str(threads), "--json"],
        capture_output=True, text=True, check=True).stdout
    return {r["test"]: statistics.median(r["samples"]) for r in json.loads(out)["results"]}


def llama(dtype, threads):
    out = subprocess.run(
        [LLAMA, "-m", f"{DIR}/{GGUF_PREFIX}-{dtype}.gguf", "-p", PP, "-n", TG, "-r", "3",
         "-t", str(threads), "-o", "json"],
        capture_output=True, text=True, check=True, env=ENV, timeout=600).stdout
    res = {}
    for r in json.loads(out):
        name = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
        res[name] = statistics.median(r["samples_ts"])
    return res


res = {}
for rnd in range(ROUNDS):
    for d in DTYPES:
        for t in THREADS:
            for tool, run in (("kiln", kiln), ("llama", llama)):
                for test, v in run(d, t).items():
                    res.setdefault((d, t, tool, test), []).append(v)
            last = {f"{k[2]}/{k[3]}": round(v[-1], 1) for k, v in res.items() if k[:2] == (d, t)}
            print(rnd, d, t, last, file=sys.stderr, flush=True)

pp, tg = f"pp{PP}", f"tg{TG}"
print(f"| weights | threads | Kiln {pp} | llama.cpp {pp} | ratio | Kiln {tg} | llama.cpp {tg} | ratio |")
print("|---|---|---|---|---|---|---|---|")
for d in DTYPES:
    for t in THREADS:
        m = lambda tool, test: statistics.median(res[(d, t, tool, test)])
        kp, lp, kt, lt = m("kiln", pp), m("llama", pp), m("kiln", tg), m("llama", tg)
        print(f"| {d.upper()} | {t} | {kp:.1f} | {lp:.1f} | {kp/lp:.2f} | {kt:.1f} | {lt:.1f} | {kt/lt:.2f} |")
