"""Prefix reuse on a CPU rank: a chat's next turn that starts after the whole chunks its
slot kept gives the tokens and logits it gives computed from scratch, bitwise.

One core over the tiny Qwen3 MoE (8-token chunks, two slots): turn 1 (20 prompt tokens)
twice, one answered in 3 tokens, one in 16; then turn 2 (turn 1's prompt, a reply and a
new message: 33 tokens), which takes the first one's slot while the other still decodes
and starts at position 16 (two whole chunks), each step launched ahead as served (the
stray write of turn 1's last step included). The reference runs turn 2 alone on a fresh
core (nothing kept, every chunk computed). test_gpu_continuous.py runs the same on a GPU,
with turn 2's chunks announced into mixed steps too.
"""

import pytest
import torch

from sparkinfer.engine import EngineConfig, SamplingParams
from sparkinfer.engine.runner import ModelRunner
from sparkinfer.engine.session import ModelSession
from sparkinfer.runtime import run_ranks
from tests.engine.test_continuous import CHUNK, SLOTS, _run

TURN1 = [7, 33, 90, 12, 55, 1, 2, 3, 99, 100, 42, 8, 9, 10, 11, 12, 13, 14, 15, 16]
TURN2 = TURN1 + [61, 62, 63] + [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
GREEDY = SamplingParams(max_new_tokens=3)
SCHEDULE = [(0, TURN1, GREEDY, None), (0, TURN1, SamplingParams(temperature=0.9, top_k=20, seed=5, max_new_tokens=16),
                                       None), (10, TURN2, GREEDY, None)]


def _worker(world, path, announce=(0,)):
    cfg = EngineConfig(model=str(path), tp=world.world_size, max_batch=SLOTS, prefill_chunk=CHUNK,
                       step_tokens=CHUNK)
    s = ModelSession.for_config(world, cfg, 64)
    try:
        alone = _run(ModelRunner(s.engine, keep_logits=True, lookahead=False), [(0, TURN2, GREEDY, None)])
        runner = ModelRunner(s.engine, keep_logits=True, lookahead=True)
        return alone, [_run(runner, SCHEDULE, announce=a) for a in announce]
    finally:
        s.close()


def check(alone, chats) -> None:
    for tokens, logits, _, plans in chats:
        first = {c.request: (c.slot, c.start) for p in reversed(plans) for c in p.prefill}  # each one's first chunk
        assert first == {0: (0, 0), 1: (1, 0), 2: (0, 16)}, f"turn 2 did not start after the kept chunks: {first}"
        assert any(p.decode and any(c.request == 2 for c in p.prefill) for p in plans), "nothing decoded beside it"
        assert tokens[2] == alone[0][0], "turn 2's tokens after reuse differ from computed alone"
        assert torch.equal(logits[2].cpu(), alone[1][0].cpu()), "turn 2's logits after reuse differ from computed alone"


@pytest.mark.slow
def test_a_next_turn_after_kept_chunks_gives_its_tokens_and_logits_from_scratch(paths):
    check(*run_ranks(_worker, 1, backend="cpu", args=(paths["qwen3_moe-tiny"],), timeout_s=900)[0])
