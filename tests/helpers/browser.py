"""A real headless Chromium driven over the DevTools protocol, for page tests.

The protocol runs over ``--remote-debugging-pipe`` (Chromium reads commands on fd 3 and
writes answers on fd 4, each a JSON message ending in a NUL byte), so no websocket client
is needed. Every wait is bounded.
"""

from __future__ import annotations

import base64
import fcntl
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
        profile.mkdir(parents=True, exist_ok=True)
        # Chromium's own messages, kept so that a failure can say why it ended.
        self.log_path = profile.parent / f"{profile.name}.chromium.log"
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        # Chromium wants its pipe ends on fds 3 and 4. No Python runs in the child to put them
        # there (a ``preexec_fn``): this process holds gRPC threads, whose fork handler
        # starts a poller in the child whose epoll fd a dup2 onto 3 or 4 could close, and
        # Chromium then died of SIGABRT before it ran (2 runs in 19). bash moves them at exec.
        # The ends are first put at 10 or above, so that moving one cannot overwrite the other.
        read_end = fcntl.fcntl(to_child_r, fcntl.F_DUPFD, 10)
        write_end = fcntl.fcntl(from_child_w, fcntl.F_DUPFD, 10)
        for fd in (to_child_r, from_child_w):
            os.close(fd)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                ["bash", "-c", f'exec "$@" 3<&{read_end} 4>&{write_end} '
                 f'{read_end}<&- {write_end}>&-', "chromium",
                 binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-dev-shm-usage", "--remote-debugging-pipe",
                 f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"],
                pass_fds=(read_end, write_end), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        os.close(read_end)
        os.close(write_end)
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
        try:
            os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        except OSError as e:
            raise AssertionError(f"chromium cannot take {method} ({e}); {self._ended()}") from e
        with self._cond:
            ok = self._cond.wait_for(lambda: mid in self._answers or not self._reader.is_alive(),
                                     timeout)
            answer = self._answers.pop(mid, None)
        if not ok or answer is None:
            raise AssertionError(f"chromium gave no answer to {method} in {timeout} s; "
                                 + self._ended())
        if "error" in answer:
            raise PageError(f"chromium: {method}: {answer['error']}")
        return answer.get("result", {})

    def _ended(self) -> str:
        """Whether Chromium is still running, and the end of what it wrote."""
        code = self.proc.poll()
        state = "still running" if code is None else f"it ended with {code}"
        try:
            tail = self.log_path.read_bytes()[-3000:].decode(errors="replace")
        except OSError:
            tail = ""
        return f"{state}; its log ends:\n{tail}"

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
