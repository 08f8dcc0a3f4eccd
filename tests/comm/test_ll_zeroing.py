"""A one-piece LL block zeroes its partial-sum line only after every warp has read it.

The line's NP words are copied in every warp of the block and each warp polls
its copies on its own (ll_wait_sum's readiness reduction stays inside a warp),
while one warp's lanes do the zeroing store. Without a block barrier between
the wait and that store, a warp still polling can miss a word that was already
zeroed, wait out its deadline and leave its part of `out` unwritten: the 2-GPU
graph test failed that way (rank 0's in-place T = 8, H = 4096 case, about
10 s longer than a passing run; 1 of 17 suite runs at 34104a5, 0 of 31 with the
barrier at c5f7031; `git show 97a0fe7:benchmarks/results/gpu2_repeat_2xh200_34104a5.json`).
The interpreter has no warps, so this checks the compiled sm_90 PTX instead.
"""

import pytest

from tests.sm90 import run_sm90_module

pytest.importorskip("triton.backends.nvidia")


def test_one_piece_line_is_zeroed_after_a_block_barrier():
    assert run_sm90_module("tests.comm.sm90_ptx") == {"one_piece_fenced": True}
