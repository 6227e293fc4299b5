"""A real headless Chromium driven over the DevTools protocol, for page tests.

The protocol runs over ``--remote-debugging-pipe`` (Chromium reads commands on fd 3 and
writes answers on fd 4, each a JSON message ending in a NUL byte), so no websocket client
is needed. Every wait is bounded.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


class PageError(AssertionError):
    """Chromium answered a protocol call with an error."""


class Browser:
    """One headless Chromium with one page attached (``goto``, ``evaluate``, ``screenshot``)."""

    def __init__(self, binary: str, profile: Path, width: int = 1280, height: int = 1500) -> None:
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def fds() -> None:  # in the child: the pipe ends on the fds Chromium expects
            os.dup2(to_child_r, 3)
            os.dup2(from_child_w, 4)

        self.proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-dev-shm-usage", "--remote-debugging-pipe", f"--user-data-dir={profile}",
             f"--window-size={width},{height}", "about:blank"],
            preexec_fn=fds, pass_fds=(3, 4), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        os.close(to_child_r)
        os.close(from_child_w)
        self._next = 0
        self._answers: dict[int, dict[str, Any]] = {}
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.session = ""

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._from_child, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buf += chunk
            *msgs, buf = buf.split(b"\0")
            with self._cond:
                for raw in msgs:
                    msg = json.loads(raw)
                    if "id" in msg:
                        self._answers[msg["id"]] = msg
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def call(self, method: str, timeout: float = 30, session: str | None = None,
             **params: Any) -> dict[str, Any]:
        with self._cond:
            self._next += 1
            mid = self._next
        msg: dict[str, Any] = {"id": mid, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        with self._cond:
            ok = self._cond.wait_for(lambda: mid in self._answers or not self._reader.is_alive(),
                                     timeout)
            answer = self._answers.pop(mid, None)
        if not ok or answer is None:
            raise AssertionError(f"chromium gave no answer to {method} in {timeout} s")
        if "error" in answer:
            raise PageError(f"chromium: {method}: {answer['error']}")
        return answer.get("result", {})

    def goto(self, url: str) -> None:
        target = self.call("Target.createTarget", url=url)["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target,
                                 flatten=True)["sessionId"]

    def evaluate(self, expression: str, timeout: float = 30) -> Any:
        """``expression``'s value in the page. While the page is still being created or
        navigated it has no execution context for a moment ("Cannot find default execution
        context", "Execution context was destroyed"): that is retried (bounded), any other
        error is raised."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                res = self.call("Runtime.evaluate", session=self.session,
                                expression=expression, returnByValue=True)
                return res.get("result", {}).get("value")
            except PageError as e:
                if "context" not in str(e).lower() or time.monotonic() > deadline:
                    raise
            time.sleep(0.05)  # the page's context appears on its own: sample again

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", session=self.session, format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=5)
        except (AssertionError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=10)
        for fd in (self._to_child, self._from_child):
            try:
                os.close(fd)
            except OSError:
                pass
