"""The shared-expert stream contract as an exact event sequence, on fake streams that
record every submission, event and wait (plans where overlap is safe and where it is not)."""

import contextlib

import pytest

from sparkinfer.layers.aux_stream import moe_with_shared_experts


class Recorder:
    """Streams are names; the log holds (stream, what) in submission order."""

    def __init__(self):
        self.log, self._cur, self._n = [], "main", 0

    def current(self):
        return self._cur

    def record(self, stream):
        self._n += 1
        self.log.append((stream, f"record e{self._n}"))
        return f"e{self._n}"

    def wait(self, stream, event):
        self.log.append((stream, f"wait {event}"))

    @contextlib.contextmanager
    def use(self, stream):
        prev, self._cur = self._cur, stream
        try:
            yield
        finally:
            self._cur = prev

    def op(self, name, value):
        def run(*args):
            self.log.append((self._cur, name))
            return value
        return run


def _run(rec, safe, enabled=True):
    return moe_with_shared_experts(1, router=rec.op("router", "logits"), routed=rec.op("routed moe", 10),
                                   shared=rec.op("shared experts", 5), overlap_safe=safe, streams=rec,
                                   aux="aux" if enabled else None, enabled=enabled)


SAFE = [("main", "record e1"), ("aux", "wait e1"), ("aux", "shared experts"), ("main", "router"),
        ("main", "routed moe"), ("aux", "record e2"), ("main", "wait e2")]
UNSAFE = [("main", "record e1"), ("aux", "wait e1"), ("aux", "shared experts"), ("main", "router"),
          ("aux", "record e2"), ("main", "wait e2"), ("main", "routed moe")]
OFF = [("main", "router"), ("main", "routed moe"), ("main", "shared experts")]


@pytest.mark.parametrize("safe,expected", [(True, SAFE), (False, UNSAFE)], ids=["overlap_safe", "not_safe"])
def test_event_sequence(safe, expected):
    rec = Recorder()
    assert _run(rec, safe) == 15
    assert rec.log == expected


def test_switch_off_runs_everything_on_main():
    rec = Recorder()
    assert _run(rec, True, enabled=False) == 15
    assert rec.log == OFF
