#!/usr/bin/env python3
"""Sentence embedding throughput: `kiln-run embed` against sentence-transformers on PyTorch
(CPU) and, with --llama, llama.cpp's `llama-embedding`, and with --kiln-python, the `kiln`
Python package's `Model.embed` (the same embedder in-process), interleaved round by round.

The texts: 1,000 sentences of mixed length (1 to ~120 words) cut from the repository's text
fixtures, the same for every engine. Each round runs every engine once over all of them as a
fresh process (model load included, and reported apart where the engine says), and records
sentences per second and the process's peak memory (maximum resident set, from wait4). The
report gives each engine's median and Kiln's ratio to each peer.

sentence-transformers runs in a child Python (--st-python: an interpreter with
sentence-transformers and torch installed) with `torch.set_num_threads(T)`, batch size 32
(its default), on the model directory (--st-model). llama-embedding runs on a GGUF of the same
weights (--gguf, e.g. `kiln-convert export-gguf`), with `-t T`, texts joined by a separator,
and a context, batch and micro-batch of 512 tokens: each batch holds whole texts, and a
non-causal model's attention spans its whole micro-batch, so larger ones cost llama.cpp time
and memory (8192 ran at a third of the speed with eight times the memory). llama.cpp does not
truncate: the 9 of the 1,000 texts longer than all-MiniLM-L6-v2's 256-token limit (the longest
287 tokens) run whole there, a little more work than the other engines do.

Not run in CI: numbers depend on the machine.

    python3 benches/embed.py minilm.kiln --st-python /path/venv/bin/python \\
        --st-model ./all-MiniLM-L6-v2 --llama llama.cpp/build/bin --gguf minilm.gguf -t 2
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ST_CHILD = r"""
import sys, time, json, torch
torch.set_num_threads(int(sys.argv[3]))
t0 = time.perf_counter()
from sentence_transformers import SentenceTransformer
m = SentenceTransformer(sys.argv[1], device="cpu")
texts = open(sys.argv[2], encoding="utf-8").read().split("\n")[:-1]
t1 = time.perf_counter()
with torch.inference_mode():
    e = m.encode(texts, batch_size=32, convert_to_numpy=True)
t2 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "embed_s": t2 - t1, "n": len(e)}))
"""


KILN_PY_CHILD = r"""
import sys, time, json
t0 = time.perf_counter()
import kiln
m = kiln.Model(sys.argv[1], threads=int(sys.argv[3]), verify=False)
texts = open(sys.argv[2], encoding="utf-8").read().split("\n")[:-1]
t1 = time.perf_counter()
e = m.embed(texts)
t2 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "embed_s": t2 - t1, "n": len(e)}))
"""


def sentences(n):
    """`n` texts of mixed length from the text fixtures: sentences and runs of them."""
    text = ""
    for name in ["calibration.txt", "gpl-3.txt"]:
        with open(os.path.join(ROOT, "fixtures/text", name), encoding="utf-8") as f:
            text += " " + f.read()
    parts = [p.strip() for p in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if p.strip()]
    out, i, k = [], 0, 0
    while len(out) < n:
        take = [1, 1, 2, 1, 3, 1, 5][k % 7]
        chunk = " ".join(parts[i % len(parts):i % len(parts) + take])
        words = chunk.split()
        out.append(" ".join(words[:120]))
        i += take
        k += 1
    return out


def run_measured(cmd, env=None):
    """Run `cmd` under /usr/bin/time-like accounting: wall seconds, peak RSS MiB, stdout."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    out = p.stdout.read()
    err = p.stderr.read()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        sys.exit(f"{cmd[0]} failed ({status}): {err.decode(errors='replace')[-2000:]}")
    return wall, usage.ru_maxrss / 1024, out.decode(), err.decode()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="the .kiln embedding model")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--texts", type=int, default=1000)
    ap.add_argument("-r", "--rounds", type=int, default=3)
    ap.add_argument("--kiln", default=os.path.join(ROOT, "target/release/kiln-run"))
    ap.add_argument("--kiln-python", help="a Python with the kiln package installed")
    ap.add_argument("--st-python")
    ap.add_argument("--st-model")
    ap.add_argument("--llama", help="llama.cpp's build/bin")
    ap.add_argument("--gguf")
    a = ap.parse_args()
    texts = sentences(a.texts)
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "texts.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(texts) + "\n")
    words = [len(t.split()) for t in texts]
    print(f"{len(texts)} texts, {min(words)}-{max(words)} words (median {statistics.median(words)}), "
          f"{a.threads} threads, {a.rounds} rounds")
    results = {}
    for r in range(a.rounds):
        out_npy = os.path.join(tmp, "k.npy")
        wall, rss, _, err = run_measured([a.kiln, "embed", a.model, "-f", path, "-t", str(a.threads),
                                          "--format", "npy", "-o", out_npy, "--force", "--no-verify"])
        m = re.search(r"in ([0-9.]+) s", err)
        embed_s = float(m.group(1)) if m else wall
        results.setdefault("kiln", []).append((len(texts) / embed_s, len(texts) / wall, rss))
        if a.kiln_python:
            wall, rss, out, _ = run_measured([a.kiln_python, "-c", KILN_PY_CHILD, a.model, path,
                                              str(a.threads)])
            py = json.loads(out.strip().splitlines()[-1])
            results.setdefault("kiln (Python)", []).append(
                (len(texts) / py["embed_s"], len(texts) / wall, rss))
        if a.st_python and a.st_model:
            wall, rss, out, _ = run_measured([a.st_python, "-c", ST_CHILD, a.st_model, path,
                                              str(a.threads)],
                                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
            st = json.loads(out.strip().splitlines()[-1])
            results.setdefault("sentence-transformers", []).append(
                (len(texts) / st["embed_s"], len(texts) / wall, rss))
        if a.llama and a.gguf:
            sep = "<#kiln#>"
            lib = {**os.environ, "LD_LIBRARY_PATH": a.llama}
            cmd = [os.path.join(a.llama, "llama-embedding"), "-m", a.gguf, "-f", os.path.join(tmp, "joined.txt"),
                   "--embd-separator", sep, "--embd-output-format", "array", "-t", str(a.threads),
                   "-c", "512", "-b", "512", "-ub", "512"]
            with open(os.path.join(tmp, "joined.txt"), "w", encoding="utf-8") as f:
                f.write(sep.join(texts))
            wall, rss, out, err = run_measured(cmd, env=lib)
            m = re.search(r"prompt eval time =\s*([0-9.]+) ms", err)
            embed_s = float(m.group(1)) / 1000 if m else wall
            results.setdefault("llama-embedding", []).append((len(texts) / embed_s, len(texts) / wall, rss))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1][0]:.1f}/s" for k, v in results.items()))
    print(f"\n| engine | texts/s embedding (median) | texts/s incl. load | peak RSS MiB |")
    print("|---|--:|--:|--:|")
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v),
               statistics.median(x[2] for x in v)) for k, v in results.items()}
    for k, (e, w, rss) in med.items():
        print(f"| {k} | {e:.1f} | {w:.1f} | {rss:.0f} |")
    for k in med:
        if k != "kiln":
            print(f"Kiln ÷ {k}: {med['kiln'][0] / med[k][0]:.2f}× (embedding), "
                  f"{med['kiln'][1] / med[k][1]:.2f}× (with load)")


if __name__ == "__main__":
    main()
