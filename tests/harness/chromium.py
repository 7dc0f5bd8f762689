"""A headless Chromium driven over the DevTools protocol on a pipe, for the page tests.

``--remote-debugging-pipe``: commands on fd 3, replies on fd 4, one NUL-terminated JSON
message each; stdlib only.  The browser runs in its own process group with a temporary
profile and is killed by its id whatever happens.  ``browser_fixture`` skips, saying so,
when no Chromium or Chrome binary is found.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import signal
import time

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _browser() -> str | None:
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


class Chromium:
    """A headless browser and its DevTools pipe; ``call`` sends one command and waits for its reply."""

    def __init__(self, binary: str, profile, log_path):
        cmd_r, cmd_w = os.pipe()  # we write commands, the browser reads them on fd 3
        res_r, res_w = os.pipe()  # the browser writes replies on fd 4
        # move the child's ends above 10 so that placing them on 3 and 4 cannot overwrite one another
        child_r, child_w = (fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (cmd_r, res_w))
        os.close(cmd_r)
        os.close(res_w)
        args = [
            binary,
            "--headless=new",
            "--remote-debugging-pipe",
            f"--user-data-dir={profile}",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-gpu",
            "--disable-extensions",
            "--disable-dev-shm-usage",
            "--no-proxy-server",
            "--disable-background-networking",
            "about:blank",
        ]
        if os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
        actions = [
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, str(log_path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600),
            (os.POSIX_SPAWN_DUP2, 1, 2),
            (os.POSIX_SPAWN_DUP2, child_r, 3),
            (os.POSIX_SPAWN_DUP2, child_w, 4),
        ]
        try:
            # a process group of its own: its renderer and GPU processes are killed with it
            self.pid = os.posix_spawn(binary, args, os.environ, file_actions=actions, setpgroup=0)
        except OSError:
            os.close(cmd_w)
            os.close(res_r)
            raise
        finally:
            os.close(child_r)
            os.close(child_w)
        self.commands, self.replies = cmd_w, res_r
        self.buffer, self.events, self.next_id = b"", [], 0
        self.log_path = log_path

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.replies], [], [], left)[0]:
                raise TimeoutError(f"no DevTools reply in time; browser log:\n{self.log()}")
            chunk = os.read(self.replies, 1 << 16)
            if not chunk:
                raise RuntimeError(f"the browser closed its DevTools pipe; browser log:\n{self.log()}")
            self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)

    def call(
        self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 15.0
    ) -> dict:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self.commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)  # an event, or a reply to nobody

    def evaluate(self, session: str, expression: str):
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, session: str, expression: str, timeout: float = 20.0):
        """Poll ``expression`` until it is truthy; bounded."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(session, expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expression} still false after {timeout} s")
            time.sleep(0.05)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=5)
        except (OSError, RuntimeError, TimeoutError):
            pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and os.waitpid(self.pid, os.WNOHANG) == (0, 0):
            time.sleep(0.05)
        try:
            os.killpg(self.pid, signal.SIGKILL)  # the group is the browser's own (its id): whatever is left
        except ProcessLookupError:
            pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass  # already reaped above
        for fd in (self.commands, self.replies):
            os.close(fd)


def browser_fixture(tmp_path):
    """The body of a ``browser`` fixture: ``yield from browser_fixture(tmp_path)``."""
    binary = _browser()
    if binary is None:
        pytest.skip(
            f"no headless browser found (looked for {', '.join(BROWSERS)} on PATH); "
            "`apt-get install chromium` to run this test"
        )
    chrome = Chromium(binary, tmp_path / "profile", tmp_path / "chromium.log")
    try:
        yield chrome
    finally:
        chrome.close()
