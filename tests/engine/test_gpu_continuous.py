"""Continuous batching on a GPU (skipped without CUDA or under the interpreter): the
schedule of test_continuous.py with compiled kernels and CUDA-graph decode steps,
two ranks sharing one GPU (`cuda_shared`; correctness only, MPS optional): every
request gives its solo tokens and logits beside the others, bitwise, at TP 2 and at
TP 2 + DCP 2, with the abort, the queue order and the chunking checked as on the CPU;
a prompt chunk's solo bits in captured prefill forwards of several chunks (one rank);
and mixed steps (test_mixed.py) captured: one against its decode and prefill rows (one
rank), and a schedule whose announced chunks run beside decode rows at TP 2; a chat's
next turn after the chunks its slot kept (prefix reuse, test_prefix_reuse_ranks.py).
"""

import os

import pytest
import torch

from sparkinfer.runtime import run_ranks
from tests.engine import test_mixed, test_prefill_rows
from tests.engine.test_continuous import _worker, check_results

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU and compiled kernels (TRITON_INTERPRET unset)")


@pytest.mark.parametrize("family,dcp", [("glm4_moe-tiny", 1), ("mixtral-tiny", 2)], ids=["glm_tp2", "mixtral_tp2_dcp2"])
def test_gpu_requests_give_their_solo_tokens_and_logits_on_two_ranks(paths, family, dcp):
    results = run_ranks(_worker, 2, backend="cuda_shared", args=(paths[family], dcp), timeout_s=600)
    check_results(results)


def test_gpu_a_chunk_gives_its_solo_bits_in_any_captured_prefill_forward(paths):
    """test_prefill_rows.py's chunks through captured prefill forwards on one rank."""
    test_prefill_rows.check(run_ranks(test_prefill_rows._worker, 1, backend="cuda",
                                      args=(paths["qwen3_moe-tiny"], True), timeout_s=600)[0])


def test_gpu_a_captured_mixed_step_gives_each_row_its_own_kind_of_bits(paths):
    test_mixed.check_one_forward(run_ranks(test_mixed._one_forward, 1, backend="cuda",
                                           args=(paths["glm4_moe-tiny"],), timeout_s=600)[0])


def test_gpu_announced_chunks_change_no_token_on_two_ranks(paths):
    test_mixed.check_served(run_ranks(test_mixed._served, 2, backend="cuda_shared", args=(paths["mixtral-tiny"],),
                                      timeout_s=600))


def test_gpu_a_next_turn_after_kept_chunks_gives_its_solo_bits(paths):
    """test_prefix_reuse_ranks.py captured on one rank, turn 2's chunks also announced into mixed steps."""
    from tests.engine import test_prefix_reuse_ranks as reuse

    alone, chats = run_ranks(reuse._worker, 1, backend="cuda", args=(paths["qwen3_moe-tiny"], True), timeout_s=600)[0]
    assert len(chats) == 2
    reuse.check(alone, chats)
