"""Random sequences of prepare, eager use on several streams, nested captures,
checkpoint, rollback and close; the pool's invariants are checked after every step."""

import contextlib

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sparkinfer.comm import EAGER, ChannelPool
from sparkinfer.errors import CaptureError, LifecycleError, StreamAffinityError
from sparkinfer.runtime import CpuStreams, LocalGroup
from tests.comm.faults import FakeBackend

IDS = st.sampled_from(["a", "b", "c"])
STREAMS = st.sampled_from(["s0", "s1", "s2", "fork0", "fork1"])


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.streams = CpuStreams(default="s0")
        self.backend = FakeBackend()
        self.pool = ChannelPool(LocalGroup(), "cpu", 4096, backend=self.backend, streams=self.streams)
        self.scopes: list[tuple[str, str, contextlib.ExitStack]] = []  # (stream, id, stack)
        self.checkpoints = []
        self.closed = False
        self.captured: set = set()  # scope indexes in which a collective was captured

    @precondition(lambda self: not self.closed)
    @rule(ids=st.lists(IDS, max_size=3))
    def prepare(self, ids):
        before = set(self.pool.channel_ids)
        created = self.pool.prepare(ids)
        assert created == sorted((set(ids) | {EAGER}) - before)

    @precondition(lambda self: not self.closed)
    @rule(stream=STREAMS)
    def eager_use(self, stream):
        with self.streams.use(stream):
            in_scope = [sc.channel.channel_id for sc in self.pool._scopes
                        if stream == sc.stream or stream in sc.aliases]
            try:
                ch = self.pool.channel()
            except StreamAffinityError:
                assert not in_scope and stream not in self.pool._bindings
                return
            except LifecycleError:
                assert EAGER not in self.pool.channel_ids
                return
            if in_scope:
                assert ch.channel_id == in_scope[-1]
            else:
                assert self.pool._bindings[stream] == ch.channel_id and ch.owner_stream == stream

    @precondition(lambda self: not self.closed)
    @rule(stream=STREAMS, cid=IDS, reuse=st.booleans())
    def enter_capture(self, stream, cid, reuse):
        stack = contextlib.ExitStack()
        try:
            ch = stack.enter_context(self.pool.capture(stream, cid, reuse=reuse))
        except LifecycleError:
            assert cid not in self.pool.channel_ids
            return
        except CaptureError:
            owned = self.pool.get(cid).graph_owned and not reuse
            assert owned or any(c == cid for _, c, _ in self.scopes)
            return
        except StreamAffinityError:
            assert self.pool.get(cid).owner_stream not in (None, stream)
            return
        assert ch.channel_id == cid
        self.scopes.append((stream, cid, stack))

    @precondition(lambda self: not self.closed and self.scopes)
    @rule(stream=STREAMS)
    def capture_use(self, stream):
        with self.streams.capture(stream):
            ch = self.pool.channel()
        for i, sc in enumerate(self.pool._scopes):
            if sc.channel is ch:
                self.captured.add(i)
        owners = [cid for s, cid, _ in self.scopes if s == stream]
        aliased = [sc.channel.channel_id for sc in self.pool._scopes if stream in sc.aliases]
        assert ch.channel_id in owners + aliased

    @precondition(lambda self: not self.closed and self.scopes)
    @rule()
    def exit_capture(self):
        stream, cid, stack = self.scopes.pop()
        was_owned = self.pool.get(cid).graph_owned
        stack.close()
        captured = len(self.scopes) in self.captured
        self.captured.discard(len(self.scopes))
        assert self.pool.get(cid).graph_owned == (was_owned or captured)

    @precondition(lambda self: not self.closed)
    @rule()
    def checkpoint(self):
        self.checkpoints.append(self.pool.checkpoint())

    @precondition(lambda self: not self.closed and self.checkpoints)
    @rule(i=st.integers(0, 10))
    def rollback(self, i):
        cp = self.checkpoints[i % len(self.checkpoints)]
        victims = {c for c in self.pool.channel_ids if self.pool.get(c).serial >= cp.serial}
        try:
            closed = self.pool.rollback(cp)
        except CaptureError:
            assert any(cid in victims for _, cid, _ in self.scopes)
            return
        assert set(closed) == victims
        assert not victims & set(self.pool.channel_ids)

    @precondition(lambda self: not self.closed and not self.scopes)
    @rule()
    def close(self):
        self.pool.close()
        self.closed = True
        assert self.backend.live == {} and self.backend.mapped == {}

    @precondition(lambda self: self.closed)
    @rule(stream=STREAMS)
    def use_after_close(self, stream):
        with self.streams.use(stream):
            try:
                self.pool.channel()
                raise AssertionError("a closed pool resolved a channel")
            except LifecycleError:
                pass

    @invariant()
    def memory_matches_channels(self):
        if self.closed:
            return
        live = {id(self.pool.get(c).slab) for c in self.pool.channel_ids}
        assert live == set(self.backend.live)
        for c in self.pool.channel_ids:
            assert not self.pool.get(c).slab.freed and not self.pool.get(c).closed

    @invariant()
    def bindings_and_scopes_are_consistent(self):
        if self.closed:
            return
        ids = set(self.pool.channel_ids)
        for key, cid in self.pool._bindings.items():
            assert cid in ids and self.pool.get(cid).owner_stream == key
        assert [s.channel.channel_id for s in self.pool._scopes] == [cid for _, cid, _ in self.scopes]
        assert self.pool.scope_depth() == len(self.scopes)

    def teardown(self):
        while self.scopes:
            self.scopes.pop()[2].close()
        if not self.closed:
            self.pool.close()


TestPoolStateMachine = PoolMachine.TestCase
TestPoolStateMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
