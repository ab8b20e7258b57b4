#!/usr/bin/env python3
"""What `kiln-run serve`'s prompt cache really costs in memory, against what it reports.

Starts a server with `--cache-mb N`, sends one warm-up request, reads the process's resident
memory (VmRSS), then sends many distinct requests (four at a time), each of which leaves a
finished conversation in the prompt cache, and reads VmRSS and `/health`'s `cached_bytes`
again. With the cache charged for the memory it holds, the growth stays near `--cache-mb`;
charged for its values' bytes alone, short conversations (a page per head and layer however
few positions) made it grow 2.5 times past it (issue #65).

Workloads: `short` (a 4-token completion prompt and 8 generated tokens: the worst case for
pages per value) and `chat` (a chat turn of 60-170 tokens with the template's system prompt).

Only the Python standard library; Linux only (reads /proc). Not run in CI.

    python3 benches/serve_cache_memory.py --model target/serve/q8_0.kiln --cache-mb 64 \\
        --workload short --requests 300 [--bin target/release/kiln-run]
"""

import argparse
import concurrent.futures as cf
import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"listening on http://[\d.]+:(\d+)")


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


def request(port, method, path, body=None):
    data = json.dumps(body).encode() if body is not None else b""
    head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=300) as s:
        s.sendall(head + data)
        buf = b""
        while chunk := s.recv(65536):
            buf += chunk
    status, _, body = buf.partition(b"\r\n\r\n")
    if not status.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(buf[:300])
    return json.loads(body)


def one(port, workload, i):
    """One distinct request; its tokens (prompt and generated)."""
    if workload == "short":
        r = request(port, "POST", "/v1/completions",
                    {"prompt": f"Item {i}:", "max_tokens": 8, "temperature": 0,
                     "ignore_eos": True})
    else:
        words = " ".join(f"w{i}x{k}" for k in range(i % 5 * 4))
        r = request(port, "POST", "/v1/chat/completions",
                    {"messages": [{"role": "user",
                                   "content": f"Question {i}: what is {i} plus {i * 3}? {words}"}],
                     "max_tokens": 16, "temperature": 0})
    return r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--bin", default=str(ROOT / "target/release/kiln-run"))
    ap.add_argument("--cache-mb", type=int, default=64)
    ap.add_argument("--workload", choices=["short", "chat"], default="short")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("extra", nargs="*", help="more `kiln-run serve` flags, after --")
    a = ap.parse_args()
    server = subprocess.Popen(
        [a.bin, "serve", a.model, "--port", "0", "--cache-mb", str(a.cache_mb), *a.extra],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        port = None
        while port is None:
            line = server.stderr.readline()
            if not line:
                sys.exit("kiln-run serve exited before listening")
            if m := READY.search(line):
                port = int(m.group(1))
        threading.Thread(target=lambda: [None for _ in server.stderr], daemon=True).start()
        one(port, a.workload, 10 ** 6)
        time.sleep(0.5)
        before = rss_kib(server.pid)
        with cf.ThreadPoolExecutor(4) as ex:
            tokens = list(ex.map(lambda i: one(port, a.workload, i), range(a.requests)))
        time.sleep(1)
        health = request(port, "GET", "/health")
        after = rss_kib(server.pid)
    finally:
        server.terminate()
        server.wait()
    print(json.dumps({
        "workload": a.workload, "cache_mb": a.cache_mb, "requests": a.requests,
        "tokens_min_mean_max": [min(tokens), round(sum(tokens) / len(tokens), 1), max(tokens)],
        "rss_before_mib": round(before / 1024, 1), "rss_after_mib": round(after / 1024, 1),
        "growth_mib": round((after - before) / 1024, 1),
        "cached_sequences": health["cached_sequences"],
        "cached_mib": round(health["cached_bytes"] / 2 ** 20, 1),
    }))


if __name__ == "__main__":
    main()
