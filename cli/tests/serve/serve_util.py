"""What every `kiln-run serve` test needs: the binaries and model, a server it starts and always
stops, raw HTTP for what a client library will not send, and `kiln-run generate` as the
reference the server's output is held to.

Paths come from the environment so CI and a developer can point at their own files:

    KILN_BIN          directory with kiln-run (default: target/release)
    KILN_SERVE_MODEL  the .kiln model (default: target/serve/q8_0.kiln, made by ci/serve.sh)
    KILN_THREADS      compute threads for the server and generate (default: their default)
"""

import http.client
import json
import os
import re
import socket
import subprocess
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(os.environ.get("KILN_BIN", ROOT / "target/release"))
KILN_RUN = BIN / "kiln-run"
MODEL = Path(os.environ.get("KILN_SERVE_MODEL", ROOT / "target/serve/q8_0.kiln"))
THREADS = os.environ.get("KILN_THREADS")

# How long a server may take to load the model and print its address.
START_TIMEOUT_S = 60
# How long one reference `kiln-run generate` may take.
GENERATE_TIMEOUT_S = 120
# Default timeout for one HTTP exchange in these tests.
HTTP_TIMEOUT_S = 60

READY = re.compile(r"kiln-run serve: listening on (http://(\S+):(\d+))")


def thread_args():
    return ["-t", THREADS] if THREADS else []


class Server:
    """A `kiln-run serve` on 127.0.0.1 with a port the system picks.

    Use as a context manager (or call `stop`): the process is killed however the test ends.
    Everything it writes on stderr is kept in `log` (read by a thread, so a chatty server
    never blocks on a full pipe).
    """

    def __init__(self, *args, api_key=None, model=MODEL):
        self.api_key = api_key
        cmd = [str(KILN_RUN), "serve", str(model), "--host", "127.0.0.1", "--port", "0",
               *thread_args(), *map(str, args)]
        if api_key is not None:
            cmd += ["--api-key", api_key]
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, errors="replace")
        self.pid = self.proc.pid
        self._lines = []
        self._ready = threading.Event()
        self.url = None
        self.port = None
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()
        if not self._ready.wait(START_TIMEOUT_S) or self.url is None:
            self.stop()
            raise RuntimeError(f"kiln-run serve did not say it was listening within "
                               f"{START_TIMEOUT_S} s: {' '.join(cmd)}\n{self.log}")

    def _read_stderr(self):
        for line in self.proc.stderr:
            self._lines.append(line)
            m = READY.search(line)
            if m and self.url is None:
                self.url = m.group(1)
                self.port = int(m.group(3))
                self._ready.set()
        self._ready.set()  # the process ended: stop waiting

    @property
    def log(self):
        return "".join(self._lines)

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    # --- talking to it ---------------------------------------------------------------------

    def openai(self, **kw):
        """The official OpenAI client pointed at this server (no retries: a test sees the
        first answer)."""
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none",
                             max_retries=0, timeout=kw.pop("timeout", HTTP_TIMEOUT_S), **kw)

    def request(self, method, path, body=None, headers=None, auth=True, timeout=HTTP_TIMEOUT_S):
        """One HTTP exchange: (status, headers dict with lowercase names, body bytes).
        `body` may be bytes, str, or anything JSON-serializable."""
        h = dict(headers or {})
        if body is not None and not isinstance(body, (bytes, str)):
            body = json.dumps(body)
            h.setdefault("Content-Type", "application/json")
        if isinstance(body, str):
            body = body.encode()
        if auth and self.api_key is not None:
            h.setdefault("Authorization", f"Bearer {self.api_key}")
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=h)
            r = conn.getresponse()
            data = r.read()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, data
        finally:
            conn.close()

    def json(self, method, path, body=None, **kw):
        """`request`, with the body parsed as JSON: (status, value)."""
        status, _, data = self.request(method, path, body, **kw)
        return status, json.loads(data)

    def health(self):
        status, value = self.json("GET", "/health", auth=False, timeout=10)
        if status != 200:
            raise AssertionError(f"/health answered {status}: {value}")
        return value

    def wait_idle(self, timeout=30):
        """Wait until every slot is free and nothing is queued; returns the last /health."""
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if h.get("active") == 0 and h.get("queued") == 0:
                return h
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout} s: {h}")
            time.sleep(0.1)

    def rss_kib(self):
        """The server's resident memory (VmRSS), in KiB."""
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise AssertionError("no VmRSS line")


def raw_exchange(port, data, timeout=HTTP_TIMEOUT_S, read_limit=1 << 20):
    """Send raw bytes on a fresh connection and read until the server closes or `timeout`
    passes: (bytes read, whether the server closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        deadline = time.monotonic() + timeout
        while sum(map(len, chunks)) < read_limit:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                b = s.recv(65536)
            except socket.timeout:
                return b"".join(chunks), False
            except ConnectionResetError:
                return b"".join(chunks), True
            if not b:
                return b"".join(chunks), True
            chunks.append(b)
        return b"".join(chunks), False


def status_of(response_bytes):
    """The status code of a raw HTTP response, or None."""
    m = re.match(rb"HTTP/1\.[01] (\d{3})", response_bytes)
    return int(m.group(1)) if m else None


def error_of(response_bytes):
    """The parsed OpenAI-shaped `error` object of a raw HTTP response (Content-Length body)."""
    head, _, body = response_bytes.partition(b"\r\n\r\n")
    return json.loads(body)["error"]


def sse_events(body_bytes):
    """The `data:` payloads of a text/event-stream body, in order."""
    events = []
    for block in body_bytes.decode().replace("\r\n", "\n").split("\n\n"):
        data = [line[5:].removeprefix(" ") for line in block.split("\n")
                if line.startswith("data:")]
        if data:
            events.append("\n".join(data))
    return events


def generate(prompt, n, chat=True, system=None, ignore_eos=False, model=MODEL, batch=None):
    """`kiln-run generate --temp 0 --json` for the same question: the reference output
    (`batch`: its `-b`, which must be the server's for the same bits)."""
    cmd = [str(KILN_RUN), "generate", str(model), "-p", prompt, "-n", str(n), "--temp", "0",
           "--json", *thread_args()]
    if batch is not None:
        cmd += ["-b", str(batch)]
    if chat:
        cmd.append("--chat")
    if system is not None:
        cmd += ["--system", system]
    if ignore_eos:
        cmd.append("--ignore-eos")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=GENERATE_TIMEOUT_S)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr}")
    return json.loads(p.stdout)


def require_files():
    """Raise with a remedy when the binary or model is missing (rather than skipping: a test
    that cannot run must not pass)."""
    for path in (KILN_RUN, MODEL):
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: run ci/serve.sh, or set KILN_BIN and "
                                    f"KILN_SERVE_MODEL")
