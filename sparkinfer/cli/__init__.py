"""Command line: `sparkinfer demo | generate | serve | bench | info`.

Each subcommand lives in its own module with `add_parser(sub)`, which registers
its arguments and sets `run(args) -> int`. Nothing heavy is imported until a
subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main"]

_SUBCOMMANDS = ("demo", "generate", "serve", "bench", "info", "demo_comm")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="sparkinfer", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in _SUBCOMMANDS:
        importlib.import_module(f"sparkinfer.cli.{name}").add_parser(sub)
    args = ap.parse_args(argv)
    from sparkinfer.errors import SparkInferError

    try:
        return args.run(args)
    except SparkInferError as e:  # a rejection says what to do: one message, no traceback
        print(f"sparkinfer {args.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
