"""Ranks die with their launcher: a launcher killed with SIGKILL (no cleanup of
its own) leaves no rank process and no `sparkinfer_launch_*` directory behind."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

LAUNCHER = """
import sys
from sparkinfer.runtime import run_ranks
from tests.faults.test_launcher import report_and_wait
run_ranks(report_and_wait, 2, backend="cpu", args=(sys.argv[1],), timeout_s=600)
"""


def report_and_wait(world, pid_dir):
    Path(pid_dir, f"rank{world.rank}").write_text(str(os.getpid()))
    time.sleep(600)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie is dead, only not yet reaped
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:  # reaped between the kill(0) and the open
        return False


def test_ranks_exit_and_clean_up_when_the_launcher_is_killed(tmp_path):
    pids, tmp = tmp_path / "pids", tmp_path / "tmp"
    pids.mkdir()
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=os.pathsep.join(sys.path))
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(pids)], env=env, cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 120
        while len(list(pids.iterdir())) < 2:
            assert time.monotonic() < deadline and launcher.poll() is None, "ranks did not start"
            time.sleep(0.2)
        ranks = [int(p.read_text()) for p in pids.iterdir()]
        assert list(tmp.glob("sparkinfer_launch_*"))
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in ranks if _alive(p)]
        for p in left:
            os.kill(p, signal.SIGKILL)
        assert left == [], f"ranks {left} outlived their launcher"
        assert list(tmp.glob("sparkinfer_launch_*")) == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
