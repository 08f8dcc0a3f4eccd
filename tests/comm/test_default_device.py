"""Library code keeps its host-side tensors on the CPU under any default device.

The GPU fault tests build their inputs inside `torch.device("cuda")`
(tests/faults/_util.run_case_table), and so may any caller: a tensor the library
allocates without device= lands on that device. At c1ec346 the fused norm
reference accumulated on it and added CPU tensors to it, and 25 norm cases of
test_gpu_nonfinite_data_on_two_ranks failed on an H200 with a cuda/cpu device
mismatch that no CPU test saw. The meta device stands in for cuda here: an op
that mixes it with CPU tensors fails the same way, so these tests fail on a CPU
machine where such code would fail on a GPU."""

import pytest
import torch

from sparkinfer.errors import AliasingError

ELSEWHERE = torch.device("meta")  # not the CPU, and it refuses to mix with CPU tensors


def _randn(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


def _on_cpu_and_equal(name: str, got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.device.type == "cpu", (name, g.device)
        torch.testing.assert_close(g, w, equal_nan=True)


def test_references_compute_on_the_cpu_under_another_default_device():
    from sparkinfer.comm.all_reduce.reference import all_reduce_reference
    from sparkinfer.comm.dcp.reference import dcp_merge_reference
    from sparkinfer.comm.fused_norm.reference import all_reduce_add_rms_norm_reference

    xs, residual, weight = [_randn(3, 16), _randn(3, 17)[:, :16]], _randn(4, 16)[:3], _randn(16)
    o_parts, lses = [_randn(2, 4, 8), _randn(3, 4, 8)[:2]], [_randn(2, 4), _randn(3, 4)[:2]]
    calls = {
        "all_reduce": lambda: (all_reduce_reference(xs),),
        "fused_norm": lambda: all_reduce_add_rms_norm_reference(xs, residual, weight, 1e-6),
        "dcp_merge": lambda: dcp_merge_reference(o_parts, lses),
    }
    for name, call in calls.items():
        want = call()
        with ELSEWHERE:
            got = call()
        _on_cpu_and_equal(name, got, want)


def test_alias_check_does_its_address_arithmetic_on_the_cpu():
    """check_overlap's element-by-element comparison (strided views whose spans
    intersect) is host work: it must not allocate on the default device."""
    from sparkinfer.comm.dispatch import check_overlap

    store = torch.zeros(4, 2, 3, 32)
    o = store[:, 0].transpose(0, 1)  # [T, H, D], heads interleaved with gaps
    with ELSEWHERE:
        check_overlap("out", store[1, 1], "out_partial", o, in_place=False)  # a gap: shares no byte
        with pytest.raises(AliasingError, match="overlaps out_partial"):
            check_overlap("out", store[1, 0, 1:], "out_partial", o, in_place=False)


def test_a_channel_made_under_another_default_device_keeps_its_error_words_on_the_host():
    """The kernels write a channel's error record through a host pointer (pinned on
    CUDA) and check_errors reads it back: on the default device it would be neither."""
    from sparkinfer.comm import ChannelPool
    from sparkinfer.comm.dispatch import check_errors
    from sparkinfer.runtime import CpuStreams, LocalGroup
    from tests.comm.faults import FakeBackend

    pool = ChannelPool(LocalGroup(), "cpu", 4096, backend=FakeBackend({}), streams=CpuStreams())
    try:
        with ELSEWHERE:
            pool.prepare(["side"])
        for cid in pool.channel_ids:
            ch = pool.get(cid)
            assert ch.errors.device.type == "cpu", (cid, ch.errors.device)
            assert ch.table[-1].item() == ch.errors.data_ptr()  # the address the kernels write to
            check_errors(ch)
    finally:
        pool.close()
