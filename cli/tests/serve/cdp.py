"""A headless Chromium driven over the DevTools protocol: just what the chat-page test needs
(open a page, run JavaScript, type, click, press Enter, take a screenshot).

Debian's `chromium` package and a websocket client are all it takes: no browser download, no
driver binary. Chromium is started with `--remote-debugging-port=0` and a fresh profile
directory; the port it picked is read from its `DevTools listening on ws://...` line.
"""

import base64
import itertools
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time

import websocket

START_TIMEOUT_S = 30
COMMAND_TIMEOUT_S = 30
LISTENING = re.compile(r"DevTools listening on (ws://127\.0\.0\.1:(\d+)/\S+)")


def chromium_path():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise FileNotFoundError("no chromium on PATH (Debian: apt-get install chromium)")


class Browser:
    """One headless Chromium with one page; close it (or use `with`) to end the process."""

    def __init__(self, width=1000, height=760):
        self.profile = tempfile.TemporaryDirectory(prefix="kiln-chromium-",
                                                   ignore_cleanup_errors=True)
        cmd = [chromium_path(), "--headless", "--no-sandbox", "--disable-gpu",
               "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
               "--hide-scrollbars", f"--window-size={width},{height}",
               "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
               f"--user-data-dir={self.profile.name}", "about:blank"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, errors="replace")
        self.log = []
        found = {}
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.log.append(line)
                m = LISTENING.search(line)
                if m and not found:
                    found["port"] = int(m.group(2))
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(START_TIMEOUT_S)
        if "port" not in found:
            self.close()
            raise RuntimeError("chromium did not print its DevTools address:\n"
                               + "".join(self.log[-20:]))
        self.port = found["port"]
        self._ids = itertools.count(1)
        self.ws = None
        # The page target chromium opened with about:blank.
        targets = self._http_json("/json/list")
        page = next(t for t in targets if t.get("type") == "page")
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"],
                                              timeout=COMMAND_TIMEOUT_S,
                                              suppress_origin=True)
        self.send("Page.enable")
        self.send("Runtime.enable")

    def _http_json(self, path):
        import http.client
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", path)
                return json.loads(conn.getresponse().read())
            except (OSError, ValueError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def send(self, method, **params):
        """One DevTools command; returns its result (events in between are dropped)."""
        i = next(self._ids)
        self.ws.send(json.dumps({"id": i, "method": method, "params": params}))
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while time.monotonic() < deadline:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == i:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
        raise TimeoutError(f"{method}: no answer in {COMMAND_TIMEOUT_S} s")

    def eval(self, expression):
        """Evaluate JavaScript in the page (awaiting a promise) and return its value."""
        r = self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                      awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression, timeout, what):
        """Poll until `expression` is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            v = self.eval(expression)
            if v:
                return v
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.1)

    def open(self, url, timeout=30):
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'",
                      timeout, f"{url} to load")

    def type_into(self, selector, text):
        """Focus an element and type into it as a keyboard would insert text."""
        self.eval(f"document.querySelector({json.dumps(selector)}).focus()")
        self.send("Input.insertText", text=text)

    def click(self, selector):
        """A real mouse click in the middle of an element."""
        box = self.eval(f"""(() => {{
            const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();
            return [r.left + r.width / 2, r.top + r.height / 2];
        }})()""")
        x, y = box
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left",
                      clickCount=1)

    def press_enter(self, shift=False):
        params = dict(key="Enter", code="Enter", windowsVirtualKeyCode=13,
                      nativeVirtualKeyCode=13, modifiers=8 if shift else 0)
        self.send("Input.dispatchKeyEvent", type="rawKeyDown", **params)
        if shift:
            self.send("Input.dispatchKeyEvent", type="char", text="\r", **params)
        self.send("Input.dispatchKeyEvent", type="keyUp", **params)

    def screenshot(self):
        """The page as PNG bytes."""
        return base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"])

    def close(self):
        if self.ws is not None:
            try:
                self.ws.close()
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.profile.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
