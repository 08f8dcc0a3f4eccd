"""A step's outputs reach their handles' async readers with one wake-up per event loop."""

from __future__ import annotations

import asyncio
import threading

from sparkinfer.engine.client import RequestHandle, push_outputs
from sparkinfer.engine.request import RequestOutput, SamplingParams


def test_a_steps_outputs_wake_each_loop_once_and_every_reader_gets_its_own():
    handles = [RequestHandle(f"r{i}", [1, 2], SamplingParams(max_new_tokens=3)) for i in range(5)]
    got: dict[str, list] = {h.request_id: [] for h in handles}
    wakeups = []
    ready = threading.Event()
    loop = asyncio.new_event_loop()
    real = loop.call_soon_threadsafe

    def counting(fn, *args):
        wakeups.append(len(args[0]) if args else 0)
        return real(fn, *args)

    loop.call_soon_threadsafe = counting

    async def read(h):
        async for out in h:
            got[h.request_id].append((out.token_ids, out.finished))

    async def main():
        tasks = [asyncio.create_task(read(h)) for h in handles]
        while not all(h._waiters for h in handles):  # every reader is waiting
            await asyncio.sleep(0.001)
        ready.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)

    t = threading.Thread(target=lambda: loop.run_until_complete(main()))
    t.start()
    assert ready.wait(60)
    for step in range(3):  # as the engine's reader thread delivers: one push of a step's outputs
        push_outputs([(h, RequestOutput(h.request_id, (10 * i + step,), finished=step == 2)) for i, h in
                      enumerate(handles)])
    t.join(60)
    loop.close()
    assert not t.is_alive()
    # each reader saw each token once, in order (outputs that queued while it ran come merged)
    for i, h in enumerate(handles):
        tokens = [tok for ids, _ in got[h.request_id] for tok in ids]
        assert tokens == [10 * i, 10 * i + 1, 10 * i + 2] and got[h.request_id][-1][1]
    # one wake-up a step, each setting every reader's event
    assert wakeups == [5, 5, 5]
