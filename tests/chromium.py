"""Headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`), with no extra package.

A test opens a page and evaluates JavaScript in it, awaiting its promises, so it reads the page once the page says
it is done (not after a fixed budget of virtual time, which a streamed reply may outlast).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync")


class Chromium:
    def __init__(self, profile: Path, width: int = 900, height: int = 700):
        to_chrome, self._to = os.pipe()  # Chromium reads commands on fd 3 and writes replies on fd 4
        self._from, from_chrome = os.pipe()

        def fds():
            os.dup2(to_chrome, 3)
            os.dup2(from_chrome, 4)

        self.proc = subprocess.Popen(["chromium", *FLAGS, "--remote-debugging-pipe", f"--user-data-dir={profile}",
                                      f"--window-size={width},{height}", "about:blank"],
                                     preexec_fn=fds, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_chrome)
        os.close(from_chrome)
        self._id, self._buf, self.session, self.events = 0, b"", None, []

    def _read(self) -> dict:
        while b"\0" not in self._buf:
            chunk = os.read(self._from, 1 << 16)
            assert chunk, "chromium closed the DevTools pipe"
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def _send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}, **({"sessionId": session} if session else {})}
        os.write(self._to, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._id:
                assert "error" not in reply, reply["error"]
                return reply["result"]
            self.events.append(reply.get("method"))  # an event, kept for `open`

    def open(self, url: str) -> None:
        """Load url in a new tab; returns once its load event has fired."""
        target = self._send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self._send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self._send("Page.enable", session=self.session)
        self.events.clear()
        self._send("Page.navigate", {"url": url}, self.session)
        while "Page.loadEventFired" not in self.events:
            self.events.append(self._read().get("method"))

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the open page, its promise awaited."""
        out = self._send("Runtime.evaluate", {"expression": expression, "awaitPromise": True, "returnByValue": True}, self.session)
        assert "exceptionDetails" not in out, out["exceptionDetails"]
        return out["result"].get("value")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)
        os.close(self._to)
        os.close(self._from)
