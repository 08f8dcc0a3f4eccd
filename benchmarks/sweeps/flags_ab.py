#!/usr/bin/env python3
"""Interleaved A/B runs of one `sparkinfer bench` command under module flags: the evidence
behind a flag's default (`attention.launch.MERGE_IN_ATTENTION`, `moe.plan.BF16_WIDE_BM64_MAX_ROWS`, ...).

    python3 benchmarks/sweeps/flags_ab.py --rounds 3 --out decode_attention_merge_ab.json \\
        --variant on: \\
        --variant off:sparkinfer.attention.launch.MERGE_IN_ATTENTION=False \\
        -- bench decode --layers 8 --weights random-direct --presets qwen3-30b-a3b --formats bf16 \\
           --batches 1,8 --impls sparkinfer --hf-batches '' --overlap-batches ''

A variant is `name:` followed by the value of SPARKINFER_FLAGS for its runs
(`module.path.NAME=value,...`; `sparkinfer/envs.py`); `name:` alone runs the defaults. Every
setting is checked here first (its module imports and already has the attribute), so a
typo fails before any run. Each round runs every variant once, in the order given, as
`python -m sparkinfer.cli <command> --out <its own file>` with the variant's
SPARKINFER_FLAGS: the command line, its ranks and a server's engine process apply them,
and the rows record them (`flags`). Rounds interleave the variants, so a drift of the
machine over the runs reaches them alike. Every run's rows go to --out, each tagged with
`variant` and `ab_round`, appended after each run: a sweep stopped part way (a time
limit kills it) keeps every run it finished. Then a table of the median of `--metric` per variant and row key
(preset, experts, batch for `bench decode`; concurrency for `bench serve`). Runs the
checkout it is started in (the working directory first on the path).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

KEYS = ("preset", "experts", "impl", "batch", "shape", "format", "m", "concurrency", "rate", "decode_rows", "chunks")


def parse_variant(text: str) -> tuple[str, str]:
    """'name:module.path.NAME=value,...' -> (name, its SPARKINFER_FLAGS text), checked:
    SystemExit naming what is malformed or does not exist (nothing is set here)."""
    from sparkinfer import envs
    from sparkinfer.errors import SetupError

    name, sep, flags = text.partition(":")
    if not sep or not name:
        raise SystemExit(f"flags_ab: variant {text!r}: write name:module.path.NAME=value,... (name: alone for "
                         "the defaults)")
    try:
        envs.check_flags(flags)
    except SetupError as e:
        raise SystemExit(f"flags_ab: variant {name!r}: {e}") from None
    return name, flags


def _subprocess_run(flags: str, argv: list[str]) -> int:
    env = dict(os.environ, SPARKINFER_FLAGS=flags,
               PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "sparkinfer.cli", *argv], env=env).returncode


def run_ab(variants: list[tuple[str, str]], rounds: int, argv: list[str],
           runner=_subprocess_run, out: str | None = None) -> tuple[list[dict], list[str]]:
    """(rows, failed runs): every variant once a round, in order; each run's rows tagged
    (module docstring), and appended to `out` (when given; replaced, not extended) after every
    run. runner(flags, argv) runs one `sparkinfer argv`, returns its exit status."""
    from sparkinfer.bench.common import append_rows

    if out is not None and os.path.exists(out):
        os.remove(out)
    rows, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for name, flags in variants:
                run_out = os.path.join(tmp, f"{name}_{r}.json")
                print(f"flags_ab: round {r + 1} / {rounds}, {name} {flags or '(defaults)'}", flush=True)
                status = runner(flags, [*argv, "--out", run_out])
                got = json.loads(open(run_out).read()) if os.path.exists(run_out) else []
                if status != 0 or not got:
                    failed.append(f"{name} in round {r + 1} exited {status} with {len(got)} rows")
                    print(f"flags_ab: {failed[-1]}", flush=True)
                tagged = [dict(row, variant=name, ab_round=r + 1, ab_status=status) for row in got]
                rows += tagged
                if out is not None:
                    append_rows(out, tagged, {})
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
    sys.path.insert(0, os.getcwd())  # the checkout timed: its sparkinfer checks the variants here
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
    variants = [parse_variant(v) for v in args.variant]  # every setting checked before the first run
    if len({name for name, _ in variants}) != len(variants):
        raise SystemExit("flags_ab: variant names must differ")
    rows, failed = run_ab(variants, args.rounds, command, out=args.out)
    for key, name, med, vals in medians(rows, args.metric):
        shown = " ".join(f"{k}={v}" for k, v in key)
        print(f"{shown:<48} {name:<12} median {args.metric} {med:10.5g}  ({', '.join(f'{v:.5g}' for v in vals)})")
    print(f"rows -> {args.out}")
    return 0 if rows and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
