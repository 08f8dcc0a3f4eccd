"""The server a serving benchmark measures, when the benchmark starts it:
`sparkinfer serve` in a subprocess (so the load generator and the server do not
share an interpreter), its URL read from the line it prints, ready once /health
answers 200, stopped with SIGTERM.

    with started_server([sys.executable, "-m", "sparkinfer.cli", "serve", "--demo", "--port", "0"], 600) as s:
        ...  # s.url, s.proc, s.output
"""

from __future__ import annotations

import contextlib
import queue
import signal
import subprocess
import threading
import time

__all__ = ["ServerProcess", "started_server"]

# After SIGTERM the server drains (`sparkinfer serve --grace`, 30 s) and closes its ranks.
STOP_TIMEOUT_S = 120


class ServerProcess:
    """A `sparkinfer serve` subprocess: its base URL once it answers, the process, and
    every line it printed."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.url, self.output = proc, None, []


@contextlib.contextmanager
def started_server(cmd: list[str], timeout_s: float, say=lambda line: None, cwd=None):
    """Run `cmd` (a `sparkinfer serve`), yield its ServerProcess once /health answers
    200, stop it with SIGTERM after (killed if it has not exited STOP_TIMEOUT_S later).
    SetupError if it exits, or prints no URL, within timeout_s."""
    import httpx

    from sparkinfer.errors import SetupError

    server = ServerProcess(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=cwd))
    proc, lines = server.proc, queue.Queue()

    def pump():  # the server's stdout, line by line, then None at its end (the pipe never fills)
        for line in proc.stdout:
            server.output.append(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    try:
        while server.url is None:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise SetupError(f"`sparkinfer serve` printed no URL within {timeout_s:.0f} s") from None
            if line is None:
                raise SetupError(f"`sparkinfer serve` exited with status {proc.wait()} before serving")
            say(f"  server: {line.rstrip()}")
            if line.startswith("serving ") and " on http" in line:
                server.url = line.split(" on ")[1].split()[0].removesuffix("/v1")
        while httpx.get(f"{server.url}/health", timeout=30).status_code != 200:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SetupError(f"`sparkinfer serve` at {server.url} never answered /health with 200")
            time.sleep(0.5)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
