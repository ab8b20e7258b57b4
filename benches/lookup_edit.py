#!/usr/bin/env python3
"""Speculative decoding by prompt lookup (`kiln-run generate --lookup N`) against plain decoding.

For each prompt file (an edit or rewrite task that repeats its input), runs greedy
`kiln-run generate --chat --json` without and with `--lookup N`, interleaved round by round,
and reports the median decode rate of each (every generated token over the whole decode time,
guessing and checking included), their ratio, the guesses' acceptance and tokens per pass.
Fails if the two ever produce different tokens: the lookup is lossless at temperature 0.

Nothing beyond the Python standard library. Not run in CI: numbers depend on the machine.

    python3 benches/lookup_edit.py MODEL.kiln benches/prompts/edit-*.txt -t 2 --lookup 8
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(args, prompt, lookup):
    cmd = [args.kiln_run, "generate", args.model, "-f", prompt, "--chat", "--greedy", "--json",
           "-n", str(args.max_tokens), "--lookup", str(lookup), "--no-verify"]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.exit(f"lookup_edit: {' '.join(cmd)} failed: {out.stderr.strip()}")
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("prompts", nargs="+", help="prompt files (rendered as a user turn)")
    ap.add_argument("--kiln-run", default=str(ROOT / "target/release/kiln-run"))
    ap.add_argument("-t", "--threads", type=int)
    ap.add_argument("--lookup", type=int, default=8, help="guesses per pass [8]")
    ap.add_argument("-n", "--max-tokens", type=int, default=256, help="tokens per answer [256]")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per prompt [3]")
    args = ap.parse_args()

    print(f"{Path(args.model).name}, greedy, {args.max_tokens} tokens at most, "
          f"--lookup {args.lookup}, {args.rounds} rounds, medians")
    print("| prompt | tokens | plain tok/s | lookup tok/s | ratio | accepted | tokens per pass |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for prompt in args.prompts:
        plain, spec = [], []
        for _ in range(args.rounds):
            a = run(args, prompt, 0)
            b = run(args, prompt, args.lookup)
            if a["tokens"] != b["tokens"]:
                sys.exit(f"lookup_edit: {prompt}: --lookup {args.lookup} changed the output")
            plain.append(a)
            spec.append(b)
        p = statistics.median(r["decode_tok_s"] for r in plain)
        s = statistics.median(r["decode_tok_s"] for r in spec)
        last = spec[-1]
        print(f"| {Path(prompt).name} | {last['generated_tokens']} | {p:.1f} | {s:.1f} "
              f"| {s / p:.2f}× | {last['accepted_tokens']} of {last['drafted_tokens']} "
              f"| {last['tokens_per_pass']:.2f} |")


if __name__ == "__main__":
    main()
