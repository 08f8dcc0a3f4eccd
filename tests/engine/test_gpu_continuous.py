"""Continuous batching on a GPU (skipped without CUDA or under the interpreter): the
schedule of test_continuous.py with compiled kernels and CUDA-graph decode steps,
two ranks sharing one GPU (`cuda_shared`; correctness only, MPS optional): every
request gives its solo tokens and logits beside the others, bitwise, at TP 2 and at
TP 2 + DCP 2, with the abort, the queue order and the chunking checked as on the CPU;
and a prompt chunk's solo bits in captured prefill forwards of several chunks (one rank).
"""

import os

import pytest
import torch

from sparkinfer.runtime import run_ranks
from tests.engine import test_prefill_rows
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
