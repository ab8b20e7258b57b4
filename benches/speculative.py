#!/usr/bin/env python3
"""Speculative decoding (`kiln-run generate --lookup N` or `--draft DRAFT.kiln`) against plain
decoding.

For each prompt file, runs greedy `kiln-run generate --chat --json` without and with the
speculative flags, interleaved round by round, and reports the median decode rate of each
(every generated token over the whole decode time, drafting and checking included), their
ratio, the guesses' acceptance and tokens per pass of the model. Fails if the two ever produce
different tokens: speculative decoding is lossless at temperature 0.

Nothing beyond the Python standard library. Not run in CI: numbers depend on the machine.

    python3 benches/speculative.py MODEL.kiln benches/prompts/edit-*.txt -t 2 --lookup 8
    python3 benches/speculative.py MODEL-f16.kiln benches/prompts/chat-*.txt -t 2 \\
        --draft MODEL-q4_0.kiln
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(args, prompt, extra):
    cmd = [args.kiln_run, "generate", args.model, "-f", prompt, "--chat", "--greedy", "--json",
           "-n", str(args.max_tokens), "--no-verify", *extra]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.exit(f"speculative: {' '.join(cmd)} failed: {out.stderr.strip()}")
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("prompts", nargs="+", help="prompt files (rendered as a user turn)")
    ap.add_argument("--kiln-run", default=str(ROOT / "target/release/kiln-run"))
    ap.add_argument("-t", "--threads", type=int)
    how = ap.add_mutually_exclusive_group(required=True)
    how.add_argument("--lookup", type=int, help="prompt lookup: guesses per pass")
    how.add_argument("--draft", help="a draft model (.kiln)")
    ap.add_argument("--draft-max", type=int)
    ap.add_argument("--draft-min", type=int)
    ap.add_argument("--draft-p-min", type=float)
    ap.add_argument("-n", "--max-tokens", type=int, default=256, help="tokens per answer [256]")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per prompt [3]")
    args = ap.parse_args()

    if args.lookup is not None:
        extra = ["--lookup", str(args.lookup)]
        what = f"--lookup {args.lookup}"
    else:
        extra = ["--draft", args.draft]
        for flag in ("draft_max", "draft_min", "draft_p_min"):
            v = getattr(args, flag)
            if v is not None:
                extra += ["--" + flag.replace("_", "-"), str(v)]
        what = " ".join(extra[:1] + [Path(args.draft).name] + extra[2:])

    print(f"{Path(args.model).name}, greedy, {args.max_tokens} tokens at most, {what}, "
          f"{args.rounds} rounds, medians")
    print("| prompt | tokens | plain tok/s | speculative tok/s | ratio | accepted "
          "| tokens per pass |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for prompt in args.prompts:
        plain, spec = [], []
        for _ in range(args.rounds):
            a = run(args, prompt, [])
            b = run(args, prompt, extra)
            if a["tokens"] != b["tokens"]:
                sys.exit(f"speculative: {prompt}: {what} changed the output")
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
