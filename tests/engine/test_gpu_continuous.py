"""Continuous batching on a GPU (skipped without CUDA or under the interpreter): the
schedule of test_continuous.py with compiled kernels and CUDA-graph decode steps,
two ranks sharing one GPU (`cuda_shared`; correctness only, MPS optional): every
request gives its solo tokens and logits beside the others, bitwise, at TP 2 and at
TP 2 + DCP 2, with the abort, the queue order and the chunking checked as on the CPU.
"""

import os

import pytest
import torch

from sparkinfer.runtime import run_ranks
from tests.engine.test_continuous import _worker, check_results

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU and compiled kernels (TRITON_INTERPRET unset)")


@pytest.mark.parametrize("family,dcp", [("glm4_moe-tiny", 1), ("mixtral-tiny", 2)], ids=["glm_tp2", "mixtral_tp2_dcp2"])
def test_gpu_requests_give_their_solo_tokens_and_logits_on_two_ranks(paths, family, dcp):
    results = run_ranks(_worker, 2, backend="cuda_shared", args=(paths[family], dcp), timeout_s=600)
    check_results(results)
