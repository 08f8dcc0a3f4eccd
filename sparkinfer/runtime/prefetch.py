"""L2 prefetch of weights that a later kernel of the same step reads.

At batch 1 a decode layer alternates kernels that stream weights (the projections, the
experts) with kernels bound by latency (rotary + cache write, attention, its combine,
the norms), during which HBM idles. A latency-bound kernel can ask the memory system to
pull a later projection's weights into L2 meanwhile, with the Hopper bulk prefetch
(`cp.async.bulk.prefetch.L2.global [addr], bytes`: one instruction per piece, no
registers, no shared memory, no completion to wait for): nothing in a step writes
weights, so the prefetch needs no ordering, and the projection's loads then hit L2.
A hint only: the bits of every kernel are the same with or without it.

Kernel side: `prefetch_l2(p, nbytes, part, parts, BLOCK)`, a caller's share of a
range. Host side: `prefetch_args(tensors)`, the (pointer, bytes) pairs a kernel takes
for up to two tensors. Never under the interpreter (inline assembly): launchers pass
PREFETCH=False there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["prefetch_l2", "prefetch_l2_at", "prefetch_args", "PREFETCH_RANGES"]

PREFETCH_RANGES = 2  # ranges a kernel takes (prefetch_args pads to this many)
_ALIGN = 16  # the bulk prefetch's address and size granule (bytes)


@triton.jit
def prefetch_l2(p, nbytes, part, parts, BLOCK: tl.constexpr):
    """Bulk-prefetch into L2 share `part` of `parts` of the `nbytes` bytes at p (any
    pointer type, 16-byte aligned), in BLOCK pieces, one per thread (a piece past the
    end is skipped; the last partial 16 bytes are not fetched)."""
    share = tl.cdiv(tl.cdiv(nbytes, parts), 16 * BLOCK) * (16 * BLOCK)
    piece = share // BLOCK
    o = part.to(tl.int64) * share + tl.arange(0, BLOCK).to(tl.int64) * piece
    n = tl.minimum(tl.maximum(nbytes - o, 0), piece)
    prefetch_l2_at(p.to(tl.pointer_type(tl.int8)) + o, n)


@triton.jit
def prefetch_l2_at(ptrs, nbytes):
    """Bulk-prefetch into L2 the nbytes (rounded down to 16; <= 0: nothing) at each of
    ptrs (16-byte aligned), elementwise."""
    n = (nbytes // 16 * 16).to(tl.int32)
    tl.inline_asm_elementwise(
        "{\n\t.reg .pred %p_go;\n\tsetp.gt.s32 %p_go, $2, 0;\n\t"
        "@%p_go cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;\n\t}",
        "=r,l,r", [ptrs.to(tl.pointer_type(tl.int8)), n], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_args(tensors, like: torch.Tensor) -> tuple[list, bool]:
    """([p0, n0, p1, n1], any): each tensor of `tensors` (at most PREFETCH_RANGES, None
    skipped) as its storage pointer and byte count; a missing or misaligned one as
    (like, 0), which prefetches nothing. `any` is False when every count is 0."""
    args = []
    for t in [t for t in tensors if t is not None][:PREFETCH_RANGES]:
        ok = t.is_contiguous() and t.data_ptr() % _ALIGN == 0
        args += [t, t.numel() * t.element_size() if ok else 0]
    while len(args) < 2 * PREFETCH_RANGES:
        args += [like, 0]
    return args, any(args[1::2])

