#!/usr/bin/env python3
"""Speculative decoding (`kiln-run generate --lookup N` or `--draft DRAFT.kiln`) against plain
decoding.

For each prompt file, runs greedy `kiln-run generate --chat --json` without and with the
speculative flags, interleaved round by round, and reports the median decode rate of each
(every generated token over the whole decode time, drafting and checking included), their
ratio, the guesses' acceptance and tokens per pass of the model. Fails if the two ever produce
different tokens: speculative decoding is lossless at temperature 0.

With --llama DIR (llama.cpp's build/bin) and --gguf (the same model exported with
`kiln-convert export-gguf`, and --draft-gguf for the draft), llama.cpp's `llama-lookup` or
`llama-speculative` runs the same prompt in the same rounds, at temperature 0, with its own
default settings besides the lookup length. Those programs take raw text, so the prompts are
then rendered by this script as ChatML (the template of SmolLM2 and Qwen; --system sets the
system turn) and both engines read that text.

Nothing beyond the Python standard library. Not run in CI: numbers depend on the machine.

    python3 benches/speculative.py MODEL.kiln benches/prompts/edit-*.txt -t 2 --lookup 8
    python3 benches/speculative.py MODEL-f16.kiln benches/prompts/chat-*.txt -t 2 \\
        --draft MODEL-q4_0.kiln
    python3 benches/speculative.py MODEL-f16.kiln benches/prompts/chat-*.txt -t 2 \\
        --draft MODEL-q4_0.kiln --llama llama.cpp/build/bin --gguf MODEL-f16.gguf \\
        --draft-gguf MODEL-q4_0.gguf
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(system, user):
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n")


def run(args, prompt, extra):
    chat = [] if args.llama else ["--chat"]
    cmd = [args.kiln_run, "generate", args.model, "-f", prompt, *chat, "--greedy", "--json",
           "-n", str(args.max_tokens), "--no-verify", *extra]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        sys.exit(f"speculative: {' '.join(cmd)} failed: {out.stderr.strip()}")
    return json.loads(out.stdout)


def run_llama(args, prompt):
    """llama-lookup or llama-speculative on the rendered prompt: (tok/s, tokens, drafted,
    accepted) from its report."""
    bin_dir = Path(args.llama)
    if args.lookup is not None:
        cmd = [str(bin_dir / "llama-lookup"), "--spec-draft-n-max", str(args.lookup)]
    else:
        cmd = [str(bin_dir / "llama-speculative"), "-md", args.draft_gguf]
        if args.threads:
            cmd += ["-td", str(args.threads)]
    cmd += ["-m", args.gguf, "-f", prompt, "-n", str(args.max_tokens), "--temp", "0",
            "-c", "4096"]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    env = {**os.environ, "LD_LIBRARY_PATH": str(bin_dir)}
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    log = out.stdout + out.stderr
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    if out.returncode != 0 or not m:
        sys.exit(f"speculative: {' '.join(cmd)} failed: {log[-2000:]}")
    num = lambda key: int(re.search(rf"{key}\s*=\s*(\d+)", log).group(1))  # noqa: E731
    tokens, secs = int(m.group(1)), float(m.group(2))
    return tokens / secs, tokens, num("n_drafted"), num("n_accept")


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
    ap.add_argument("--llama", metavar="DIR", help="llama.cpp's bin directory: run "
                    "llama-lookup / llama-speculative beside")
    ap.add_argument("--gguf", help="the model as GGUF (with --llama)")
    ap.add_argument("--draft-gguf", help="the draft as GGUF (with --llama and --draft)")
    ap.add_argument("--system", default=SMOLLM2_SYSTEM,
                    help="the system turn of the ChatML prompts rendered for --llama")
    args = ap.parse_args()
    if args.llama and not (args.gguf and (args.lookup is not None or args.draft_gguf)):
        ap.error("--llama needs --gguf, and --draft-gguf with --draft")
    if args.llama:
        # Both engines read the same rendered text.
        tmp = tempfile.mkdtemp(prefix="speculative-")
        rendered = []
        for p in args.prompts:
            out = Path(tmp) / Path(p).name
            out.write_text(chatml(args.system, Path(p).read_text().strip()))
            rendered.append((p, str(out)))
    else:
        rendered = [(p, p) for p in args.prompts]

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
    head = "| prompt | tokens | plain tok/s | speculative tok/s | ratio | accepted | tokens per pass |"
    rule = "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    if args.llama:
        peer = "llama-lookup" if args.lookup is not None else "llama-speculative"
        head += f" {peer} tok/s | its tokens | its accepted | Kiln ÷ {peer} |"
        rule += " ---: | ---: | ---: | ---: |"
    print(head)
    print(rule)
    for name, prompt in rendered:
        plain, spec, peer_runs = [], [], []
        for _ in range(args.rounds):
            a = run(args, prompt, [])
            b = run(args, prompt, extra)
            if a["tokens"] != b["tokens"]:
                sys.exit(f"speculative: {name}: {what} changed the output")
            plain.append(a)
            spec.append(b)
            if args.llama:
                peer_runs.append(run_llama(args, prompt))
        p = statistics.median(r["decode_tok_s"] for r in plain)
        s = statistics.median(r["decode_tok_s"] for r in spec)
        last = spec[-1]
        row = (f"| {Path(name).name} | {last['generated_tokens']} | {p:.1f} | {s:.1f} "
               f"| {s / p:.2f}× | {last['accepted_tokens']} of {last['drafted_tokens']} "
               f"| {last['tokens_per_pass']:.2f} |")
        if args.llama:
            q = statistics.median(r[0] for r in peer_runs)
            _, tokens, drafted, accepted = peer_runs[-1]
            row += f" {q:.1f} | {tokens} | {accepted} of {drafted} | {s / q:.2f}× |"
        print(row)


if __name__ == "__main__":
    main()
