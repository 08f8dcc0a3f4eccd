#!/usr/bin/env python3
"""Interleaved A/B runs of one `sparkinfer bench` command under module flags: the evidence
behind a flag's default (`attention.launch.MERGE_IN_ATTENTION`, `moe.runner.FC2_PRELOAD`, ...).

    python3 benchmarks/sweeps/flags_ab.py --rounds 3 --out decode_fc2_preload_ab.json \\
        --variant off: \\
        --variant on:sparkinfer.moe.runner.FC2_PRELOAD=4,sparkinfer.moe.runner.FC1_LETS_FC2_EARLY=True \\
        -- bench decode --layers 8 --weights random-direct --presets qwen3-30b-a3b --formats bf16 \\
           --batches 1,8 --impls sparkinfer --hf-batches '' --overlap-batches ''

A variant is `name:` followed by comma-separated `module.path.NAME=value` settings (a
Python literal, else the text itself); `name:` alone runs the defaults. Every setting is
checked in this process first (its module imports and already has the attribute), so a
typo fails before any run. Each round runs every variant once, in the order given,
each in a fresh interpreter that sets its flags and then runs `sparkinfer <command>
--out <its own file>`: rounds interleave the variants, so a drift of the machine over
the runs reaches them alike. The rows of every run go to --out, each tagged with
`variant`, `flags` (the settings as given) and `ab_round`; then a table of the median of
`--metric` per variant and row key (preset, experts, batch for `bench decode`).

Only commands that run in one process take the flags (`bench decode` at TP 1, `bench
moe`, `bench attention`): a command that starts ranks or a server in processes of its own
would run those on the defaults. Runs the checkout it is started in (the working
directory first on the path).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile

KEYS = ("preset", "experts", "impl", "batch", "shape", "format", "m")


def parse_variant(text: str) -> tuple[str, dict[str, object]]:
    """'name:mod.path.NAME=value,...' -> (name, {'mod.path.NAME': value})."""
    name, sep, rest = text.partition(":")
    if not sep or not name:
        raise SystemExit(f"flags_ab: variant {text!r}: write name:module.path.NAME=value,... (name: alone for "
                         "the defaults)")
    flags = {}
    for item in filter(None, rest.split(",")):
        path, eq, raw = item.partition("=")
        if not eq or "." not in path:
            raise SystemExit(f"flags_ab: variant {name!r}: {item!r} is not module.path.NAME=value")
        try:
            flags[path] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            flags[path] = raw
    return name, flags


def _target(path: str):
    """(module, attribute name) of 'module.path.NAME'; SystemExit naming what does not exist."""
    mod, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(mod)
    except ImportError as e:
        raise SystemExit(f"flags_ab: {path}: module {mod!r} does not import ({e})") from None
    if not hasattr(module, attr):
        raise SystemExit(f"flags_ab: {path}: {mod} has no attribute {attr!r}")
    return module, attr


def check_flags(flags: dict[str, object]) -> None:
    """Every setting names an existing module attribute (nothing is set)."""
    for path in flags:
        _target(path)


def apply_flags(flags: dict[str, object]) -> None:
    """Set each module attribute (checked as `check_flags` does)."""
    for path, value in flags.items():
        setattr(*_target(path), value)


def _child(flags_json: str, argv: list[str]) -> int:
    """In the run's own interpreter: the flags, then `sparkinfer <argv>`."""
    apply_flags(json.loads(flags_json))
    from sparkinfer.cli import main

    return main(argv)


def _subprocess_run(flags: dict, argv: list[str]) -> int:
    code = "import sys; from benchmarks.sweeps.flags_ab import _child; sys.exit(_child(sys.argv[1], sys.argv[2:]))"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-c", code, json.dumps(flags), *argv], env=env).returncode


def run_ab(variants: list[tuple[str, dict]], rounds: int, argv: list[str],
           runner=_subprocess_run) -> tuple[list[dict], list[str]]:
    """(rows, failed runs): every variant once a round, in order; each run's rows tagged
    (module docstring). runner(flags, argv) runs one `sparkinfer argv`, returns its exit status."""
    rows, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for name, flags in variants:
                out = os.path.join(tmp, f"{name}_{r}.json")
                print(f"flags_ab: round {r + 1} / {rounds}, {name} {flags or '(defaults)'}", flush=True)
                status = runner(flags, [*argv, "--out", out])
                got = json.loads(open(out).read()) if os.path.exists(out) else []
                if status != 0 or not got:
                    failed.append(f"{name} in round {r + 1} exited {status} with {len(got)} rows")
                    print(f"flags_ab: {failed[-1]}", flush=True)
                text = ",".join(f"{k}={v!r}" for k, v in flags.items())
                rows += [dict(row, variant=name, flags=text, ab_round=r + 1, ab_status=status) for row in got]
    return rows, failed


def medians(rows: list[dict], metric: str) -> list[tuple[tuple, str, float, list[float]]]:
    """(row key, variant, median of metric, every value) for each key and variant, keys in first-seen order."""
    groups: dict[tuple, dict[str, list[float]]] = {}
    for row in rows:
        if isinstance(row.get(metric), (int, float)):
            key = tuple((k, row[k]) for k in KEYS if k in row)
            groups.setdefault(key, {}).setdefault(row["variant"], []).append(float(row[metric]))
    return [(key, name, statistics.median(vals), vals) for key, by in groups.items() for name, vals in by.items()]


def main(argv=None) -> int:
    sys.path.insert(0, os.getcwd())  # the checkout timed: its sparkinfer, and this script as a module
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", action="append", required=True, help="name:module.path.NAME=value,...")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--metric", default="us_per_step", help="the row field the table compares")
    ap.add_argument("--out", required=True, help="the JSON file of every run's rows")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the sparkinfer command (bench decode ...)")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or "--out" in command:
        raise SystemExit("flags_ab: give the sparkinfer command after --, without --out (each run gets its own)")
    variants = [parse_variant(v) for v in args.variant]
    if len({name for name, _ in variants}) != len(variants):
        raise SystemExit("flags_ab: variant names must differ")
    for _, flags in variants:
        check_flags(flags)  # every setting checked before the first run
    rows, failed = run_ab(variants, args.rounds, command)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
        f.write("\n")
    for key, name, med, vals in medians(rows, args.metric):
        shown = " ".join(f"{k}={v}" for k, v in key)
        print(f"{shown:<48} {name:<12} median {args.metric} {med:10.1f}  ({', '.join(f'{v:.1f}' for v in vals)})")
    print(f"rows -> {args.out}")
    return 0 if rows and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
