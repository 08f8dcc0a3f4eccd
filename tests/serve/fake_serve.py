"""`python -m tests.serve.fake_serve [--step-s S] [--grace S]`: `sparkinfer serve`'s
serving path (`cli.serve.serve_engine`, uvicorn in the main thread) over the fake
engine on 127.0.0.1 and a free port, for the tests that send signals (only a main
thread receives them, so the server runs in a process of its own). Prints the
server's URL line, and "fake engine closed" when the engine is closed."""

from __future__ import annotations

import argparse
import sys

from sparkinfer.cli.serve import serve_engine
from sparkinfer.serve.server import ServeOptions
from sparkinfer.serve.state import ServerLimits
from tests.serve.fake_engine import FakeEngine


class _Announcing(FakeEngine):
    def close(self) -> None:
        super().close()
        print("fake engine closed", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-s", type=float, default=0.005)
    ap.add_argument("--grace", type=float, default=30.0)
    args = ap.parse_args(argv)
    engine = _Announcing(step_s=args.step_s, max_context=8192)
    options = ServeOptions(host="127.0.0.1", port=0, limits=ServerLimits(grace_s=args.grace, poll_s=0.02),
                           log_level="warning", access_log=False)
    return serve_engine(engine, options)


if __name__ == "__main__":
    sys.exit(main())
