"""The one-GPU benchmarks behind the README's and docs' tables, in one call inside a time budget.

    sparkinfer bench suite --out-dir DIR [--budget-s 560] [--only decode-qwen3,serve] [--list]

GPU time comes in leases of minutes, so one command that runs what is owed, most important
first, beats a hand-written script per session. Each entry is one or more `sparkinfer bench`
commands (the GPU test files: pytest, then `bench summarize --junit`; the `ab-` entries: a
checkout's `benchmarks/sweeps/flags_ab.py`, the flag A/Bs owed), run as child processes
in the order of ENTRIES. An entry whose estimate does not fit the time left is skipped, and a
command that runs past the time left is stopped (what it wrote stays). Its rows go to
`DIR/<file>_<machine>.json`, the names `benchmarks/results/` uses, so each file can be copied
there as it is. The estimates are seconds on one H100, measured where the comment of an entry
says so (2026-12-07), else guessed. Prints a line as each entry starts and
ends and a table at the end; exits 1 if a command failed, 0 otherwise (skips included).
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from sparkinfer.bench.common import gpu_info, machine_label

__all__ = ["add_arguments", "main", "ENTRIES", "Entry"]

# The nine PDL flags off: the batch-1 step's kernels then add up (docs/decode.md).
NO_PDL = ",".join(f"sparkinfer.{flag}=False" for flag in (
    "attention.launch.COMBINE_PDL", "attention.launch.ATTENTION_PDL", "attention.launch.COMBINE_LETS_NEXT",
    "norm.launch.NORM_WAIT", "linear.launch.LINEAR_PDL", "moe.routing.launch.ROUTING_PDL",
    "moe.runner.MICRO_PDL", "moe.runner.FC1_PDL", "rope.launch.ROPE_PDL"))
_DECODE = ("--weights", "random-direct", "--impls", "sparkinfer", "--hf-batches", "", "--overlap-batches", "")


@dataclass(frozen=True)
class Entry:
    """name; est_s: seconds on one GPU; commands: argv lists after `python -m`, where
    {out} stands for the output directory and {m} for the machine label (`_argv`); env: extra
    environment of every command; checkout: a folder of a checkout the commands read (the
    entry is skipped where the working directory has none)."""

    name: str
    est_s: int
    commands: tuple[tuple[str, ...], ...]
    env: dict = field(default_factory=dict)
    checkout: str = ""


def _bench(*args: str) -> tuple[str, ...]:
    return ("sparkinfer.cli", "bench", *args)


def _ab(out: str, variants: tuple[str, ...], *command: str) -> tuple[str, ...]:
    """`benchmarks/sweeps/flags_ab.py` (a checkout's): three interleaved rounds of `command`
    under each variant (`name:module.FLAG=value,...`), every run's rows in {out}/<out>_{m}.json."""
    flags = [a for v in variants for a in ("--variant", v)]
    return ("benchmarks.sweeps.flags_ab", "--rounds", "3", "--out", f"{{out}}/{out}_{{m}}.json", *flags, "--", *command)


def _decode(preset: str, *extra: str, full_depth: bool = False) -> tuple[str, ...]:
    """`bench decode` of our decoder alone on random weights made on the GPU: 8 layers, or
    the preset's own count."""
    depth = ("--full-depth",) if full_depth else ("--layers", "8")
    return _bench("decode", "--presets", preset, *depth, *_DECODE, *extra)


ENTRIES = (
    # 190 s on an H100 at 0b019ab (237 tests, 4 workers), 180 s at c95a5fa (240), 241 s at 9d3dfae
    # (240; another H100 lease), then the conversion
    Entry("gpu-tests", 250, (
        ("pytest", "-rA", "-q", "-n", "4", "--dist", "loadgroup", "-o", "faulthandler_timeout=120", "{gpu_tests}",
         "--junitxml={out}/gpu_tests.xml"),
        _bench("summarize", "--junit", "{out}/gpu_tests.xml", "--out", "{out}/gpu_tests_{m}.json")), checkout="tests"),
    # 26 and 30 s at 0b019ab, 24 and 28 s at c95a5fa, 37 s (with PDL) at 9d3dfae
    Entry("decode-profile", 37, (_decode("qwen3-30b-a3b", "--formats", "bf16,nvfp4", "--batches", "1", "--profile",
                                         "--out", "{out}/decode_profile_{m}.json"),)),
    Entry("decode-profile-nopdl", 32, (_decode("qwen3-30b-a3b", "--formats", "bf16,nvfp4", "--batches", "1",
                                               "--profile", "--out", "{out}/decode_profile_nopdl_{m}.json"),),
          env={"SPARKINFER_FLAGS": NO_PDL}),
    # 107 s for both at 0b019ab, 90 s at c95a5fa, 134 s at 9d3dfae
    Entry("serve", 135, (
        _decode("qwen3-30b-a3b", "--formats", "bf16", "--batches", "1,8,32,64",
                "--out", "{out}/decode_beside_serve_{m}.json"),
        _bench("serve", "--preset", "qwen3-30b-a3b", "--layers", "8",
               "--checkpoint-dir", "{tmp}/sparkinfer_serve_checkpoint", "--concurrency", "1,8,32,64",
               "--input-len", "512", "--output-len", "128",
               "--decode-results", "{out}/decode_beside_serve_{m}.json", "--out", "{out}/serve_{m}.json"))),
    # at c95a5fa (the suite's H100 run): Qwen3-30B-A3B 22 s, GLM-4.5-Air 69, Mixtral-8x7B 48; at
    # 9d3dfae 31, 102 and 69 s
    *(Entry(f"decode-{short}", est, (_decode(preset, "--formats", "bf16,nvfp4", "--batches", "1,8,32,64",
                                             "--out", "{out}/decode_{m}.json"),))
      for short, preset, est in (("qwen3", "qwen3-30b-a3b", 32), ("glm", "glm-4.5-air", 100),
                                 ("mixtral", "mixtral-8x7b", 70))),
    # its own --budget-s stops it starting shapes past 200 s; 58 s at c95a5fa, 102 s at 9d3dfae (H100s)
    Entry("moe", 100, (_bench("moe", "--m", "1,8,64,1024,4096", "--budget-s", "200", "--out", "{out}/moe_{m}.json"),)),
    # 37 s for these rows at 0b019ab, 23 s at c95a5fa
    Entry("prefill-mixed", 35, (_bench("prefill", "--preset", "qwen3-30b-a3b", "--layers", "8", "--beside", "64",
                                       "--rows", "1,4", "--context", "512", "--replays", "20",
                                       "--out", "{out}/prefill_mixed_{m}.json"),)),
    # full depth (refused at once where the GPU's memory is short): Qwen3-30B-A3B bf16 52 s at
    # e3a277d, GLM-4.5-Air NVFP4 181 s at 83b8bfb, Mixtral-8x7B bf16 not timed on an H100
    *(Entry(f"full-depth-{short}", est, (_decode(preset, "--formats", fmt, "--batches", "1,8",
                                                 "--out", "{out}/decode_full_depth_{m}.json", full_depth=True),))
      for short, preset, fmt, est in (("qwen3", "qwen3-30b-a3b", "bf16", 60), ("glm", "glm-4.5-air", "nvfp4", 190),
                                      ("mixtral", "mixtral-8x7b", "bf16", 150))),
    # the flags of `linear` whose defaults wait on a timing (docs/decode.md): the preload
    # projections' early loads, coarse calls from the first row, and the coarse qkv
    # (timed on an H100 only). Its 12 runs took about 31 s each on an H100 at 9d3dfae: 10 of
    # them in the 327 s the 280 s guessed left it.
    Entry("ab-linear", 380, (_ab("decode_linear_ab", (
        "base:", "late:sparkinfer.linear.launch.PRELOAD_EARLY=False",
        "coarse0:sparkinfer.linear.config.COARSE_MIN_ROWS=0",
        "fine_qkv:sparkinfer.linear.config.COARSE_SMALL_SLICES=False"),
        "bench", "decode", "--presets", "qwen3-30b-a3b", "--layers", "8", *_DECODE, "--formats", "bf16,nvfp4",
        "--batches", "1,8,64"),), checkout="benchmarks"),
    # decode attention alone against the copy rate and torch SDPA: 40 s at batches 1, 8 and 64 on an
    # H100 at e1ff944 (sweeps/attention_variants_h100.json's base rows)
    Entry("attention", 60, (_bench("attention", "--contexts", "512,4096", "--out", "{out}/attention_{m}.json"),)),
)


def add_arguments(p) -> None:
    p.add_argument("--out-dir", required=False, help="where every result file goes (created)")
    p.add_argument("--budget-s", type=float, default=560.0, help="seconds for all of it (default %(default)s)")
    p.add_argument("--only", default=None, help="comma-separated entry names, in the suite's order (default all)")
    p.add_argument("--list", action="store_true", help="print the entries and their commands; run nothing")


def _select(only: str | None) -> list[Entry]:
    if not only:
        return list(ENTRIES)
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = {e.name for e in ENTRIES}
    if bad := [n for n in names if n not in known]:
        raise SystemExit(f"bench suite: unknown --only {', '.join(bad)}; the entries: {', '.join(known)}")
    return [e for e in ENTRIES if e.name in names]


def _argv(cmd: tuple[str, ...], out: str, label: str) -> list[str]:
    """The child's argv: `python -m ...` with {out}, {m} and {tmp} (the system's temporary
    directory: the served checkpoint's gigabytes stay out of the results) filled in, and
    {gpu_tests} the GPU test files of this checkout."""
    argv = [sys.executable, "-m"]
    for a in cmd:
        if a == "{gpu_tests}":
            argv += sorted(glob.glob(os.path.join("tests", "*", "test_gpu*.py"))) + [os.path.join("tests", "linear")]
        else:
            argv.append(a.replace("{out}", out).replace("{m}", label).replace("{tmp}", tempfile.gettempdir()))
    return argv


def _run(argv: list[str], env: dict, timeout: float) -> int:
    """One command in a process group of its own; its return code, or 124 when stopped at
    `timeout`: then the whole group is killed (a server `bench serve` started, pytest's
    workers), so nothing of it holds the GPU for the next entry."""
    proc = subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124
    finally:  # stopped, or Ctrl-C here: the group goes too (the interrupt then goes on)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_suite(entries: list[Entry], out: str, label: str, budget_s: float, runner=_run, clock=time.monotonic,
              say=print) -> list[dict]:
    """Run `entries` in order inside `budget_s`; one record per entry: name, status
    (ok, failed, skipped, stopped), seconds, and why where skipped or failed."""
    t0, records = clock(), []
    for e in entries:
        left = budget_s - (clock() - t0)
        why = (f"no {e.checkout}/ here (run in a checkout)" if e.checkout and not os.path.isdir(e.checkout) else
               f"needs about {e.est_s} s, {left:.0f} s left" if e.est_s > left else "")
        if why:
            records.append(dict(name=e.name, status="skipped", seconds=0.0, why=why))
            say(f"suite: skip {e.name}: {why}")
            continue
        say(f"suite: {e.name} at {clock() - t0:.0f} s (about {e.est_s} s; {left:.0f} s left)")
        start, status, why = clock(), "ok", ""
        for cmd in e.commands:
            left = budget_s - (clock() - t0)
            rc = runner(_argv(cmd, out, label), e.env, max(1.0, left))
            if rc:
                status = "stopped" if rc == 124 else "failed"
                why = f"{' '.join(cmd[:3])} exited {rc}"
                break
        records.append(dict(name=e.name, status=status, seconds=round(clock() - start, 1), why=why))
        say(f"suite: {e.name} {status} in {clock() - start:.0f} s" + (f" ({why})" if why else ""))
    return records


def main(args) -> int:
    entries = _select(args.only)
    if args.list:
        for e in entries:
            env = "".join(f"{k}=... " for k in e.env)
            print(f"{e.name:22s} about {e.est_s:4d} s")
            for cmd in e.commands:
                print("    " + env + " ".join(repr(a) if a == "" else a for a in _argv(cmd, "{out}", "{m}")[1:]))
        return 0
    if not args.out_dir:
        raise SystemExit("bench suite: pass --out-dir DIR (the result files go there), or --list")
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    label = machine_label(gpu_info(), 1)
    records = run_suite(entries, args.out_dir, label, args.budget_s)
    print(f"\n{'entry':22s} {'status':8s} {'s':>6s}  why")
    for r in records:
        print(f"{r['name']:22s} {r['status']:8s} {r['seconds']:6.0f}  {r['why']}")
    return 1 if any(r["status"] in ("failed", "stopped") for r in records) else 0
