#!/usr/bin/env python3
"""What the prompt cache and structured output cost or save in `kiln-run serve`.

Starts two servers on the same model, one keeping conversations (`--cache-mb 256`) and one not
(`--cache-mb 0`), and measures, interleaved round by round so both see the same machine:

- time to first token of a chat's second turn, after a long first turn (the whole
  conversation is sent again, as chat clients do): with the cache only the new turn is read;
- the streamed inter-token latency of answers held to a JSON schema against free answers of
  the same questions (on the caching server), i.e. the per-token cost of the grammar's mask.

Only the Python standard library. Not run in CI: numbers depend on the machine.

    python3 benches/serve_features.py --model target/serve/q8_0.kiln -t 2
"""

import argparse
import http.client
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"kiln-run serve: listening on (http://\S+)")
LONG = " ".join(
    f"Note {i}: the kiln at the north end of the yard was fired on day {i} and held its heat "
    f"for {i % 7 + 3} hours." for i in range(40))
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "hobbies"],
}


def start(args, cache_mb):
    cmd = [args.kiln_run, "serve", args.model, "--port", "0", "-t", str(args.threads),
           "--cache-mb", str(cache_mb), "--cache-reuse", args.cache_reuse]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        line = p.stderr.readline()
        if not line:
            break
        m = READY.search(line)
        if m:
            return p, m.group(1)
    p.kill()
    sys.exit(f"serve_features: {' '.join(cmd)} did not start")


def stream_chat(url, body):
    """POST a streamed chat; return (seconds to first text, [gaps between text chunks], usage,
    text, finish_reason)."""
    u = urlsplit(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = dict(body, stream=True, stream_options={"include_usage": True})
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", json.dumps(body),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        sys.exit(f"serve_features: HTTP {r.status}: {r.read()[:300]!r}")
    first, last, gaps, usage, text, finish = None, None, [], None, "", None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for ch in chunk.get("choices", []):
            finish = ch.get("finish_reason") or finish
            piece = ch.get("delta", {}).get("content")
            if piece:
                now = time.perf_counter()
                if first is None:
                    first = now - t0
                else:
                    gaps.append(now - last)
                last = now
                text += piece
    c.close()
    return first, gaps, usage, text, finish


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a .kiln file")
    ap.add_argument("--kiln-run", default=str(ROOT / "target/release/kiln-run"))
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--cache-reuse", default="exact", choices=["exact", "prefix"],
                    help="what the caching server may reuse (kiln-run serve --cache-reuse)")
    args = ap.parse_args()
    servers = {}
    try:
        for name, mb in (("cache", 256), ("no cache", 0)):
            servers[name] = start(args, mb)
        ttft = {name: [] for name in servers}
        prompt_tokens = cached = 0
        for r in range(args.rounds):
            for name, (_, url) in servers.items():
                first = [{"role": "system", "content": f"Round {r}. Answer briefly."},
                         {"role": "user", "content": LONG + " Which day was the kiln fired?"}]
                _, _, _, answer, _ = stream_chat(url, {"messages": first, "temperature": 0,
                                                    "max_tokens": args.max_tokens})
                second = first + [{"role": "assistant", "content": answer},
                                  {"role": "user", "content": "And how long did it hold heat?"}]
                t, _, usage, _, _ = stream_chat(url, {"messages": second, "temperature": 0,
                                                   "max_tokens": 8})
                ttft[name].append(t)
                if name == "cache":
                    prompt_tokens = usage["prompt_tokens"]
                    cached = usage["prompt_tokens_details"]["cached_tokens"]
        gaps = {"free": [], "json_schema": []}
        tokens = {"free": 0, "json_schema": 0}
        url = servers["cache"][1]
        for r in range(args.rounds):
            for kind in gaps:
                body = {"messages": [{"role": "user", "content":
                                      f"Describe person number {r}: name, age and hobbies, as JSON."}],
                        "temperature": 0, "max_tokens": 4 * args.max_tokens}
                if kind == "json_schema":
                    body["response_format"] = {"type": "json_schema", "json_schema": {
                        "name": "person", "schema": SCHEMA}}
                _, g, usage, text, finish = stream_chat(url, body)
                gaps[kind].extend(g)
                tokens[kind] += usage["completion_tokens"]
                if kind == "json_schema" and finish == "stop":
                    json.loads(text)
    finally:
        for p, _ in servers.values():
            p.terminate()
            p.wait(timeout=30)
    med = {k: statistics.median(v) for k, v in ttft.items()}
    print(f"second turn: {prompt_tokens} prompt tokens, {cached} from the cache")
    for k, v in med.items():
        print(f"  time to first token, {k}: median {v * 1e3:.0f} ms over {len(ttft[k])}")
    print(f"  ratio cache / no cache: {med['cache'] / med['no cache']:.3f}")
    itl = {k: statistics.median(v) for k, v in gaps.items()}
    for k, v in itl.items():
        print(f"inter-token latency, {k}: median {v * 1e3:.2f} ms over {len(gaps[k])} gaps "
              f"({tokens[k]} tokens)")
    print(f"  ratio json_schema / free: {itl['json_schema'] / itl['free']:.3f}")


if __name__ == "__main__":
    main()
