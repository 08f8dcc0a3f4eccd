"""`sparkinfer bench suite`: every command it would run parses with its benchmark's own
options, the budget skips what does not fit, a failed command ends its entry, and
--list runs nothing (no benchmark runs here: the runner is a stand-in)."""

import argparse
import importlib
import os
import sys
import time

import pytest

from sparkinfer.bench import suite


def test_every_bench_command_parses_with_its_benchmarks_options():
    """A typo in an entry (an option its benchmark lacks) fails here, not in a GPU lease."""
    seen = 0
    for e in suite.ENTRIES:
        for cmd in e.commands:
            argv = suite._argv(cmd, "/tmp/out", "h200")
            if argv[2] == "pytest":
                assert argv[-1] == "--junitxml=/tmp/out/gpu_tests.xml"
                files = [a for a in argv if a.startswith("tests")]
                assert os.path.join("tests", "linear") in files and any("test_gpu" in f for f in files), files
                continue
            if argv[2] == "benchmarks.sweeps.flags_ab":  # every variant's flags exist; the command parses
                ab = importlib.import_module(argv[2])
                cut = argv.index("--")
                variants = [argv[i + 1] for i in range(3, cut) if argv[i] == "--variant"]
                assert len(variants) >= 2 and all(ab.parse_variant(v) for v in variants), variants
                assert argv[argv.index("--out") + 1].endswith("_h200.json"), argv
                argv = argv[:2] + ["sparkinfer.cli"] + argv[cut + 1:]
            assert argv[2:4] == ["sparkinfer.cli", "bench"], argv
            mod = importlib.import_module(f"sparkinfer.bench.{argv[4]}")
            p = argparse.ArgumentParser(exit_on_error=False)
            mod.add_arguments(p)
            args = p.parse_args(argv[5:])
            out = getattr(args, "out", None)
            assert out is None or (out.startswith("/tmp/out/") and out.endswith("_h200.json")), (e.name, out)
            assert e.name.startswith("ab-") == (out is None), e.name  # flags_ab gives each run its own --out
            seen += 1
    assert seen >= len(suite.ENTRIES)
    assert "{" not in " ".join(suite._argv(suite.ENTRIES[3].commands[1], "/o", "h100"))  # serve: {tmp} filled


def test_unknown_entries_are_refused_with_the_known_names():
    with pytest.raises(SystemExit, match="unknown --only decode-qwen; the entries: .*decode-qwen3"):
        suite._select("serve,decode-qwen")
    assert [e.name for e in suite._select("serve,gpu-tests")] == ["gpu-tests", "serve"]  # the suite's order


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_the_budget_skips_what_does_not_fit_and_a_failure_ends_its_entry():
    clock, ran = _Clock(), []
    entries = [suite.Entry("a", 50, (("x",), ("y",))), suite.Entry("b", 100, (("z",),)),
               suite.Entry("c", 30, (("w",),), env={"K": "1"})]

    def runner(argv, env, timeout):
        ran.append((argv[-1], env, timeout))
        clock.t += 40
        return 2 if argv[-1] == "x" else 0

    records = suite.run_suite(entries, "/o", "h200", 120, runner=runner, clock=clock, say=lambda s: None)
    assert [(r["name"], r["status"]) for r in records] == [("a", "failed"), ("b", "skipped"), ("c", "ok")]
    assert "x exited 2" in records[0]["why"] and "needs about 100 s, 80 s left" in records[1]["why"]
    assert ran == [("x", {}, 120), ("w", {"K": "1"}, 80)]  # y never ran; each command gets the time left


def test_a_command_past_the_time_left_is_stopped():
    records = suite.run_suite([suite.Entry("a", 10, (("x",),))], "/o", "h200", 60,
                              runner=lambda argv, env, timeout: 124, say=lambda s: None)
    assert records[0]["status"] == "stopped"


def test_list_prints_every_entry_and_runs_nothing(capsys, monkeypatch):
    monkeypatch.setattr(suite, "run_suite", lambda *a, **k: pytest.fail("--list ran the suite"))
    args = argparse.Namespace(only=None, list=True, out_dir=None, budget_s=560.0)
    assert suite.main(args) == 0
    text = capsys.readouterr().out
    for e in suite.ENTRIES:
        assert e.name in text
    assert "SPARKINFER_FLAGS=..." in text
    with pytest.raises(SystemExit, match="--out-dir"):
        suite.main(argparse.Namespace(only="moe", list=False, out_dir=None, budget_s=1.0))


def test_a_stopped_command_takes_its_children_with_it(tmp_path):
    """The real runner at its timeout kills the command's whole process group: a grandchild
    (a server, pytest's workers) does not outlive it."""
    pid_file = tmp_path / "pid"
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    # 10 s: two interpreters start and write the pid well before, even on 2 busy cores
    assert suite._run([sys.executable, "-c", code], {}, timeout=10.0) == 124
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    assert not _alive(pid)
    assert suite._run([sys.executable, "-c", "raise SystemExit(3)"], {}, timeout=30.0) == 3


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed but not yet reaped by its dead parent's reaper, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
