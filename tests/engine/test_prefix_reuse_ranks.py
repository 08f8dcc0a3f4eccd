"""Prefix reuse on a CPU rank: a chat's next turn that starts after the whole chunks its
slot kept, and a conversation that copies a running one's shared system prompt, give
the tokens and logits they give computed from scratch, bitwise.

One core over the tiny Qwen3 MoE at TP 1, and over the tiny Mixtral at TP 2 with the
cache split over the ranks by position (DCP 2: a copy moves each rank's share), 8-token
chunks, three slots: turn 1 (20 prompt
tokens) twice, one answered in 3 tokens, one in 16; then, while the second still
decodes, turn 2 (turn 1's prompt, a reply and a new message: 33 tokens), which takes
the first one's slot and starts at position 16 (two whole chunks, in place), and a new
conversation with the same first 16 tokens, which takes the third slot and starts at
16 after a copy of them (`StepPlan.copies`). Each step is launched ahead as served (the
stray write of turn 1's last step included). The references run each alone on a fresh
core (nothing kept, every chunk computed). At DCP 1 the schedule runs once more with
its chunks announced into mixed steps; test_gpu_continuous.py runs that on a GPU.
"""

import pytest
import torch

from sparkinfer.engine import EngineConfig, SamplingParams
from sparkinfer.engine.session import ModelSession
from sparkinfer.runtime import run_ranks
from tests.engine.test_continuous import CHUNK, _run

SLOTS = 3
TURN1 = [7, 33, 90, 12, 55, 1, 2, 3, 99, 100, 42, 8, 9, 10, 11, 12, 13, 14, 15, 16]
TURN2 = TURN1 + [61, 62, 63] + [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
OTHER = TURN1[:16] + [70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80]  # the same system prompt, another question
GREEDY = SamplingParams(max_new_tokens=3)
# the second turn-1 request decodes past both arrivals whatever it draws (ignore_eos), so it is running then
LONG = SamplingParams(temperature=0.9, top_k=20, seed=5, max_new_tokens=16, ignore_eos=True)
SCHEDULE = [(0, TURN1, GREEDY, None), (0, TURN1, LONG, None), (10, TURN2, GREEDY, None), (10, OTHER, GREEDY, None)]


def _worker(world, path, mixed=False, dcp=1):
    cfg = EngineConfig(model=str(path), tp=world.world_size, dcp=dcp, max_batch=SLOTS, prefill_chunk=CHUNK,
                       step_tokens=CHUNK)
    s = ModelSession.for_config(world, cfg, 64)
    try:
        # the session's runners: their forwards take CHUNK-token chunks (the scheduler's), not max_tokens
        ref, runner = s.runner(keep_logits=True), s.runner(keep_logits=True, mixed=mixed)
        ref.lookahead, runner.lookahead = False, True  # launched ahead on the CPU too (default: GPU only)
        alone = [_run(ref, [(0, p, GREEDY, None)], slots=SLOTS) for p in (TURN2, OTHER)]
        announce = (0, runner.announce_tokens) if mixed else (0,)  # mixed: chunks announced into mixed steps
        return alone, [_run(runner, SCHEDULE, announce=a, slots=SLOTS) for a in announce]
    finally:
        s.close()


def check(alone, chats) -> None:
    """chats: the schedule without announced chunks, then (mixed runners) with them."""
    assert len(chats) == 1 or any(p.next_prefill for p in chats[1][3]), "no chunk was announced into a mixed step"
    for tokens, logits, _, plans in chats:
        first = {c.request: (c.slot, c.start) for p in reversed(plans) for c in p.prefill}  # each one's first chunk
        assert first == {0: (0, 0), 1: (1, 0), 2: (0, 16), 3: (2, 16)}, f"not after the reused chunks: {first}"
        # from the running turn-1 request (slot 1; the first running one with the most to share)
        assert [p.copies for p in plans if p.copies] == [((1, 2, 16),)], "the system prompt was not copied once"
        assert any(p.decode and any(c.request == 2 for c in p.prefill) for p in plans), "nothing decoded beside it"
        for i, (a_tokens, a_logits, _, _) in zip((2, 3), alone):
            assert tokens[i] == a_tokens[0], f"request {i}: tokens after reuse differ from computed alone"
            assert torch.equal(logits[i].cpu(), a_logits[0].cpu()), f"request {i}: logits differ from computed alone"


@pytest.mark.slow
@pytest.mark.parametrize("family,world,dcp", [("qwen3_moe-tiny", 1, 1), ("mixtral-tiny", 2, 2)],
                         ids=["qwen3_tp1", "mixtral_tp2_dcp2"])
def test_reused_and_copied_prefixes_give_the_tokens_and_logits_computed_from_scratch(paths, family, world, dcp):
    mixed = dcp == 1  # mixed steps need DCP 1: there turn 2's chunks are also announced into them
    results = run_ranks(_worker, world, backend="cpu", args=(paths[family], mixed, dcp), timeout_s=900)
    check(*results[0])
    assert len(results[0][1]) == (2 if mixed else 1)
    for other in results[1:]:  # every rank ran the same plans and drew the same tokens
        assert other[1][0][0] == results[0][1][0][0]
