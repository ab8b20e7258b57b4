#!/usr/bin/env python3
"""What the `kiln` Python package costs per generated token: decode speed through
`Model.create_completion(..., stream=True)` against `kiln-run generate --json` on the same
model, prompt, token count and threads, interleaved round by round, each a fresh process.

Both run the same engine; the package adds a forwarding thread that turns each event into the
server's JSON chunk, a channel hop, `json.loads` and a Python loop. Decode speed is measured
the same way on both sides: tokens after the first over the seconds from the first to the
last (the command line's `decode_tok_s`; in Python, from the first chunk's arrival to the
last's). Reports the medians and the overhead, (command line ÷ Python − 1).

Not run in CI: numbers depend on the machine.

    python3 benches/python_decode.py smollm2-q4_0.kiln --python .venv/bin/python -t 2 -n 256 -r 5
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PY_CHILD = r"""
import sys, time, json
import kiln
model, prompt, n, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
m = kiln.Model(model, threads=threads, verify=False, n_parallel=1)
times = []
for chunk in m.create_completion(prompt, max_tokens=n, temperature=0, ignore_eos=True,
                                 stream=True):
    if chunk["choices"][0]["text"]:
        times.append(time.perf_counter())
out = m.create_completion(prompt, max_tokens=n, temperature=0, ignore_eos=True)
tokens = out["usage"]["completion_tokens"]
print(json.dumps({"decode_tok_s": (tokens - 1) / (times[-1] - times[0]), "tokens": tokens}))
"""


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{cmd[0]} failed ({p.returncode}): {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a generative .kiln model")
    ap.add_argument("--python", required=True, help="a Python with the kiln package installed")
    ap.add_argument("--kiln", default=os.path.join(ROOT, "target/release/kiln-run"))
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--tokens", type=int, default=256)
    ap.add_argument("-r", "--rounds", type=int, default=5)
    ap.add_argument("-p", "--prompt", default="Write a long story about a lighthouse keeper.")
    a = ap.parse_args()
    cli, py = [], []
    for r in range(a.rounds):
        c = run([a.kiln, "generate", a.model, "-p", a.prompt, "-n", str(a.tokens), "--temp", "0",
                 "--ignore-eos", "-t", str(a.threads), "--json", "--no-verify"])
        cli.append(c["decode_tok_s"])
        p = run([a.python, "-c", PY_CHILD, a.model, a.prompt, str(a.tokens), str(a.threads)])
        py.append(p["decode_tok_s"])
        print(f"round {r + 1}: kiln-run {cli[-1]:.2f} tok/s, Python {py[-1]:.2f} tok/s")
    mc, mp = statistics.median(cli), statistics.median(py)
    print(f"\nmedian decode: kiln-run {mc:.2f} tok/s, Python stream {mp:.2f} tok/s; "
          f"Python overhead {100 * (mc / mp - 1):+.1f}% per token")


if __name__ == "__main__":
    main()
