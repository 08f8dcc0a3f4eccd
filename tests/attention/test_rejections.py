"""Every rejection of decode_attention: the typed error, quoting the bad value.
Nothing here launches a kernel."""

import pytest
import torch

from sparkinfer.attention import attention_workspace, decode_attention
from sparkinfer.attention import launch as attn_launch
from sparkinfer.errors import CapacityError, CaptureError, DeviceError, DTypeError, LayoutError, PlanError, ShapeError

B, Q, HQ, KVH, D, S, L = 2, 1, 4, 2, 64, 3, 512


def _args():
    bf = dict(dtype=torch.bfloat16)
    return dict(q=torch.zeros(B, Q, HQ, D, **bf), k_cache=torch.zeros(S, L, KVH, D, **bf),
                v_cache=torch.zeros(S, L, KVH, D, **bf), slots=torch.zeros(B, dtype=torch.int32),
                q_pos=torch.zeros(B, dtype=torch.int32), sm_scale=0.125)


def _set(**changes):
    return lambda a: a.update(changes)


def _map(name, fn):
    return lambda a: a.update({name: fn(a[name])})


REJECTIONS = {
    "q-not-tensor": (_set(q=[1.0]), DTypeError, r"q is list"),
    "q-fp16": (_map("q", lambda t: t.half()), DTypeError, r"q dtype is torch.float16"),
    "q-3d": (_map("q", lambda t: t[0]), ShapeError, r"q has shape \(1, 4, 64\); expected 4 dims"),
    "q-meta": (_map("q", lambda t: t.to("meta")), DeviceError, r"q is on meta; the kernel runs on CUDA"),
    "k-other-device": (_map("k_cache", lambda t: t.to("meta")), DeviceError, r"k_cache is on meta; expected cpu"),
    "k-head-dim": (_map("k_cache", lambda t: t[..., :32]), ShapeError, r"k_cache has shape \(3, 512, 2, 32\).*D = 64"),
    "v-shape": (_map("v_cache", lambda t: t[:, :100]), ShapeError, r"v_cache shape \(3, 100, 2, 64\) differs"),
    "heads-not-multiple": (_map("q", lambda t: t[:, :, :3]), ShapeError, r"Hq = 3 query heads over KVH = 2"),
    "head-dim-8": (lambda a: a.update(q=a["q"][..., :8], k_cache=a["k_cache"][..., :8],
                                      v_cache=a["v_cache"][..., :8]), ShapeError, r"head dim D = 8"),
    "group-129": (lambda a: a.update(q=torch.zeros(B, Q, 129, D, dtype=torch.bfloat16),
                                     k_cache=a["k_cache"][:, :, :1], v_cache=a["v_cache"][:, :, :1]),
                  ShapeError, r"= 129 exceeds 128"),
    "q-d-strided": (_map("q", lambda t: torch.zeros(B, Q, HQ, 2 * D, dtype=t.dtype)[..., ::2]), LayoutError,
                    r"q has strides \(512, 512, 128, 2\)"),
    "v-d-strided": (_map("v_cache", lambda t: torch.zeros(S, L, KVH, 2 * D, dtype=t.dtype)[..., ::2]),
                    LayoutError, r"v_cache has strides"),
    "slots-int64": (_map("slots", lambda t: t.long()), DTypeError, r"slots dtype is torch.int64"),
    "slots-length": (_map("slots", lambda t: t[:1]), ShapeError, r"slots has shape \(1,\); expected \[B\] = \(2,\)"),
    "q-pos-strided": (_map("q_pos", lambda t: torch.zeros(2 * B, dtype=torch.int32)[::2]), LayoutError,
                      r"q_pos has strides \(2,\)"),
    "kv-stride-0": (_set(kv_stride=0), LayoutError, r"kv_stride=0"),
    "kv-offset-past-stride": (_set(kv_stride=2, kv_offset=2), LayoutError, r"kv_offset=2; .*kv_stride = 2"),
    "kv-offset-negative": (_set(kv_offset=-1), LayoutError, r"kv_offset=-1"),
    "out-shape": (_set(out=torch.zeros(B, Q, HQ, 32, dtype=torch.bfloat16)), ShapeError,
                  r"out has shape \(2, 1, 4, 32\)"),
    "out-fp32": (_set(out=torch.zeros(B, Q, HQ, D)), DTypeError, r"out dtype is torch.float32"),
    "out-strided": (_set(out=torch.zeros(B, Q, HQ, 2 * D, dtype=torch.bfloat16)[..., :D]), LayoutError,
                    r"out has strides \(512, 512, 128, 1\)"),
    "lse-bf16": (_set(lse=torch.zeros(B, Q, HQ, dtype=torch.bfloat16)), DTypeError, r"lse dtype is torch.bfloat16"),
    "lse-shape": (_set(lse=torch.zeros(B, Q, HQ + 1)), ShapeError, r"lse has shape \(2, 1, 5\)"),
    "splits-0": (_set(num_splits=0), PlanError, r"num_splits=0"),
    "splits-65": (_set(num_splits=65), PlanError, r"num_splits=65"),
    "workspace-small": (_set(num_splits=4, workspace=torch.zeros(10), batch_invariant=False), CapacityError,
                        r"workspace holds 10 fp32 elements; this call needs 2080"),
    "workspace-bf16": (_set(num_splits=4, workspace=torch.zeros(4000, dtype=torch.bfloat16),
                            batch_invariant=False), DTypeError, r"workspace dtype is torch.bfloat16"),
    "workspace-2d": (_set(num_splits=4, workspace=torch.zeros(2, 4000), batch_invariant=False), LayoutError,
                     r"workspace has shape \(2, 4000\)"),
    # batch-invariant: L = 512 holds 2 splits of 256 keys, whatever num_splits is
    "workspace-small-invariant": (_set(workspace=torch.zeros(10)), CapacityError,
                                  r"holds 10 fp32 elements; this call needs 1040 \(2 splits\)"),
}


@pytest.mark.parametrize("mutate,error,match", REJECTIONS.values(), ids=REJECTIONS.keys())
def test_rejects(mutate, error, match):
    a = _args()
    mutate(a)
    q, k, v, slots, q_pos = (a.pop(n) for n in ("q", "k_cache", "v_cache", "slots", "q_pos"))
    with pytest.raises(error, match=match):
        decode_attention(q, k, v, slots, q_pos, **a)


@pytest.mark.parametrize("given,match", [
    ({}, r"out=None during CUDA graph capture"),
    ({"out": "given"}, r"lse=None during CUDA graph capture"),
    ({"out": "given", "lse": "given", "num_splits": 5, "batch_invariant": False},
     r"workspace of 2600 fp32 elements is not allocated"),
], ids=["out", "lse", "workspace"])
def test_capture_refuses_to_allocate(monkeypatch, given, match):
    """Under capture (simulated: no GPU here) nothing may be allocated."""
    a = _args()
    monkeypatch.setattr(attn_launch, "_capturing", lambda device: True)
    kw = {"out": torch.zeros(B, Q, HQ, D, dtype=torch.bfloat16), "lse": torch.zeros(B, Q, HQ)}
    kw = {n: (kw[n] if val == "given" else val) for n, val in given.items()}
    with pytest.raises(CaptureError, match=match):
        decode_attention(a["q"], a["k_cache"], a["v_cache"], a["slots"], a["q_pos"], sm_scale=0.1, **kw)
    with pytest.raises(CaptureError, match=r"attention_workspace allocates"):
        attention_workspace(a["q"], a["k_cache"], num_splits=2)
