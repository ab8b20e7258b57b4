"""A bounded load-and-fault run against `kiln-run serve`, on 127.0.0.1 only, that ends by
itself: a warm-up round, then the same round again with faults mixed in (clients that hang up
mid-stream, an oversized body, malformed JSON, requests that stall half-sent, a burst of
connections). Afterwards the server still answers, every slot is free, nothing is queued, and
its resident memory is back within a stated tolerance of where it was after the warm-up.
"""

import concurrent.futures as cf
import json
import socket
import struct
import threading
import time
import unittest

import serve_util as su

SLOTS = 4
CLIENTS = 32           # concurrent streaming clients per round
MAX_TOKENS = 8         # small: the run is about the server, not the model
HANGUPS = 6            # clients that disconnect after their first chunk
BURST = 128            # connections opened at once
BODY_LIMIT = 1 << 20   # the server's default body limit (1 MiB)
CACHE_MB = 16          # a small prompt cache, so its growth stays inside the tolerance
# How long a server may keep a half-sent request before closing it.
STALL_TIMEOUT_S = 60
# The whole test's bound.
OVERALL_TIMEOUT_S = 240
# Memory after the faults may exceed the warm-up's by this fraction plus this many MiB (the
# prompt cache's budget included).
RSS_TOLERANCE = 0.10
RSS_SLACK_MIB = CACHE_MB + 32


def prompt(i):
    return f"Count from {i} to {i + 5}, separated by commas."


def stream_one(server, i, hang_up=False):
    """One streamed chat request over a raw socket; returns the number of content chunks, or
    -1 for a client that hung up after its first chunk."""
    body = json.dumps({"messages": [{"role": "user", "content": prompt(i)}],
                       "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as s:
        s.sendall(head + body)
        buf = b""
        while True:
            b = s.recv(65536)
            if not b:
                break
            buf += b
            if hang_up and b"data: {" in buf:
                # Gone without a word, mid-stream: the server must cancel the sequence.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return -1
    status = su.status_of(buf)
    if status != 200:
        raise AssertionError(f"client {i}: status {status}: {buf[:300]!r}")
    _, _, body = buf.partition(b"\r\n\r\n")
    events = [e for e in su.sse_events(dechunk(body)) if e != "[DONE]"]
    chunks = [json.loads(e) for e in events]
    if not any(c["choices"] and c["choices"][0].get("finish_reason") for c in chunks):
        raise AssertionError(f"client {i}: no finish chunk")
    return sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content"))


def dechunk(body):
    """The payload of a body sent with chunked transfer encoding (as-is when it is not)."""
    out, rest = b"", body
    while rest:
        size_line, sep, rest = rest.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            return body  # not chunked
        if not sep or size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2:]
    return out


def burst(server, n):
    """`n` connections at once, each asking for /health; returns the status codes."""
    socks = []
    try:
        for _ in range(n):
            socks.append(socket.create_connection(("127.0.0.1", server.port), timeout=30))
        for s in socks:
            try:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            except OSError:
                pass  # refused at once (503 and closed): its answer is read below
        codes = []
        for s in socks:
            buf = b""
            while True:
                try:
                    b = s.recv(65536)
                except (ConnectionResetError, socket.timeout):
                    break
                if not b:
                    break
                buf += b
            codes.append(su.status_of(buf))
        return codes
    finally:
        for s in socks:
            s.close()


def stall(server, data):
    """Send part of a request and wait: (seconds until the server closed, what it sent)."""
    t0 = time.monotonic()
    got, closed = su.raw_exchange(server.port, data, timeout=STALL_TIMEOUT_S)
    return (time.monotonic() - t0 if closed else None), got


class LoadAndFaults(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        su.require_files()
        cls.server = su.Server("--parallel", SLOTS, "--ctx", "1024", "--queue", 64,
                               "--cache-mb", CACHE_MB)
        cls.deadline = time.monotonic() + OVERALL_TIMEOUT_S

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()

    def left(self):
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.fail(f"the load test ran past its {OVERALL_TIMEOUT_S} s bound")
        return left

    def round(self, pool, hangups=0):
        futures = [pool.submit(stream_one, self.server, i, hang_up=i < hangups)
                   for i in range(CLIENTS)]
        results = [f.result(timeout=self.left()) for f in futures]
        for i, r in enumerate(results):
            if i < hangups:
                self.assertEqual(r, -1)
            else:
                self.assertGreater(r, 0, f"client {i} got no text")
        return results

    def test_load_and_faults(self):
        s = self.server
        with cf.ThreadPoolExecutor(CLIENTS + 8) as pool:
            # Warm-up: the same round and burst the fault round repeats, so allocator arenas,
            # thread stacks and KV pages are as large as they will get.
            self.round(pool)
            burst(s, BURST)
            s.wait_idle(timeout=self.left())
            time.sleep(0.5)
            rss_warm = s.rss_kib()

            # Faults, all at once: half-sent requests (in the body, and in the headers) that
            # stall; a round with clients hanging up mid-stream; an oversized body; bad JSON;
            # a burst of connections.
            stall_body = pool.submit(stall, s, b"POST /v1/chat/completions HTTP/1.1\r\n"
                                     b"Host: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                     b"Content-Length: 200\r\n\r\n{\"messages\": [")
            stall_head = pool.submit(stall, s, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 1")
            fault_round = pool.submit(self.round, pool, HANGUPS)

            big = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" \
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (
                      BODY_LIMIT + 4096)
            # Only the headers: the size they declare is enough to refuse the request.
            got, _ = su.raw_exchange(s.port, big, timeout=30)
            self.assertEqual(su.status_of(got), 413, got[:300])
            self.assertTrue(su.error_of(got)["message"])

            bad = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": }'
            got, _ = su.raw_exchange(s.port, b"POST /v1/chat/completions HTTP/1.1\r\n"
                                     b"Host: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                     b"Connection: close\r\n"
                                     b"Content-Length: %d\r\n\r\n%s" % (len(bad), bad),
                                     timeout=30)
            self.assertEqual(su.status_of(got), 400, got[:300])

            # The burst comes once the round's streams hold their connections: /health is
            # outside the in-flight limit (--max-connections), so the burst is served.
            time.sleep(1.0)
            codes = burst(s, BURST)
            # Every connection was answered: served, or refused with 503 when over a limit.
            self.assertTrue(all(c in (200, 503) for c in codes), sorted(map(str, codes)))
            self.assertGreater(codes.count(200), 0)

            fault_round.result(timeout=self.left())
            for name, fut in (("body", stall_body), ("headers", stall_head)):
                closed_after, sent = fut.result(timeout=self.left())
                self.assertIsNotNone(closed_after, f"a request stalled in its {name} was kept "
                                     f"open for {STALL_TIMEOUT_S} s")
                # Either closed silently or with an error status, never a 200.
                self.assertNotEqual(su.status_of(sent), 200, sent[:300])

            # Hang-ups are noticed and their slots freed; then one more clean round.
            s.wait_idle(timeout=min(30, self.left()))
            self.round(pool)

        h = s.wait_idle(timeout=min(30, self.left()))
        self.assertEqual(h["slots_idle"], h["slots"], h)
        self.assertEqual(h["slots"], SLOTS)
        self.assertTrue(s.alive(), s.log[-2000:])
        self.assertNotIn("panicked", s.log)
        time.sleep(0.5)
        rss = s.rss_kib()
        limit = rss_warm * (1 + RSS_TOLERANCE) + RSS_SLACK_MIB * 1024
        print(f"\n    VmRSS after warm-up {rss_warm / 1024:.1f} MiB, after faults "
              f"{rss / 1024:.1f} MiB (limit {limit / 1024:.1f} MiB)")
        self.assertLessEqual(rss, limit)
        # And it still answers a request.
        r = s.openai().chat.completions.create(
            model="kiln", messages=[{"role": "user", "content": prompt(0)}], max_tokens=4,
            temperature=0)
        self.assertTrue(r.choices[0].message.content)


if __name__ == "__main__":
    unittest.main()
