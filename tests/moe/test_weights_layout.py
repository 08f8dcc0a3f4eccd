"""The tiled NVFP4 layout: every (row, chunk) slice lands where the kernels'
`tile_slices` addresses it, and padding rows are zero."""

import torch

from sparkinfer.moe.kernels.common import NVFP4_TILE_ROWS
from sparkinfer.moe.weights import nvfp4_shapes, prepare_nvfp4, tile_rows
from sparkinfer.quant import quantize_nvfp4


def test_tile_rows_places_every_slice():
    n, b, cb = 150, 40, 8  # 150 rows pad to 192; 5 chunks of 8 bytes per row
    t = torch.randint(0, 256, (n, b), dtype=torch.uint8)
    tiled = tile_rows(t, cb)
    assert tiled.shape == (3, 5, NVFP4_TILE_ROWS, cb) and tiled.is_contiguous()
    flat = tiled.reshape(-1, cb)
    for row in range(n):
        for c in range(b // cb):  # the kernels' tile_slices(row, c, num_chunks)
            pos = ((row // NVFP4_TILE_ROWS) * (b // cb) + c) * NVFP4_TILE_ROWS + row % 64
            assert torch.equal(flat[pos], t[row, c * cb:(c + 1) * cb])
    assert not tiled[2, :, n - 128:].any()  # rows 150..191 are padding


def test_prepare_nvfp4_shapes_and_padding():
    w = quantize_nvfp4(torch.randn(2, 100, 96))
    p, s = prepare_nvfp4(w, 32)
    assert (tuple(p.shape), tuple(s.shape)) == nvfp4_shapes(2, 100, 96, 32)
    assert tuple(p.shape) == (2, 2, 3, 64, 16) and tuple(s.shape) == (2, 2, 3, 64, 2)
    assert not p[:, 1, :, 36:].any() and not s[:, 1, :, 36:].any()
    assert s[:, :, :, :36].any()  # real rows carry scale codes
