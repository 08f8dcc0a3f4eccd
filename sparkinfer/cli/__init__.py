"""Command line: `sparkinfer demo | generate | serve | bench | info`.

Each subcommand lives in its own module with `add_parser(sub)`, which registers
its arguments and sets `run(args) -> int`. Nothing heavy is imported until a
subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

__all__ = ["main"]

_SUBCOMMANDS = ("demo", "generate", "serve", "bench", "info", "demo_comm")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="sparkinfer", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in _SUBCOMMANDS:
        importlib.import_module(f"sparkinfer.cli.{name}").add_parser(sub)
    args = ap.parse_args(argv)
    from sparkinfer import envs
    from sparkinfer.errors import RankFailed, SparkInferError

    try:
        if envs.flags_text() and "--dry-run" in (sys.argv[1:] if argv is None else argv):
            # a dry run interprets its kernels, and Triton reads TRITON_INTERPRET when a flag's
            # module (a kernel's) is imported, before the benchmark would set it
            os.environ["TRITON_INTERPRET"] = "1"
        envs.apply_flags()  # SPARKINFER_FLAGS: module flags for an A/B run
        return args.run(args)
    except RankFailed as e:  # one line per distinct error, with the ranks that raised it
        if envs.debug_log():
            print(e.detail, file=sys.stderr)
        for n, (line, ranks) in enumerate(e.causes):
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
            note = " (likely because of the above)" if n else "" if envs.debug_log() else \
                " (SPARKINFER_LOG=debug shows the tracebacks)"
            print(f"sparkinfer {args.cmd}: {who}: {line}{note}", file=sys.stderr)
        return 2
    except SparkInferError as e:  # a rejection says what to do: one message, no traceback
        print(f"sparkinfer {args.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
