"""Prefill forwards of several prompt chunks: a chunk's last-token logits and the keys and
values it writes are the same bits as when it runs alone, whatever shares its forward (other
requests' chunks, the same request's next chunk), however its row is padded (to the longest
chunk or to a whole chunk) and in whatever row bucket. On one CPU rank through the
interpreter; on a GPU (test_gpu_continuous.py) with compiled kernels and CUDA graphs.
"""

import pytest
import torch

from sparkinfer.engine import EngineConfig
from sparkinfer.engine.session import ModelSession
from sparkinfer.errors import CapacityError
from sparkinfer.runtime import run_ranks

CHUNK, ROWS, CONTEXT = 8, 4, 32
A = [7, 33, 90, 12, 55, 1, 2, 3, 99, 100, 42]  # two chunks: 8 + 3 tokens
B = [5, 6, 7, 8, 9]
C = [60, 61, 62, 63, 64, 65, 66, 67]


def _cache(dec, slot: int, n: int):
    return dec.cache.k[:, slot, :n].clone(), dec.cache.v[:, slot, :n].clone()


def _worker(world, path, graphs=False):
    cfg = EngineConfig(model=str(path), max_batch=3, prefill_chunk=CHUNK, step_tokens=CHUNK * ROWS, graphs=graphs)
    s = ModelSession.for_config(world, cfg, CONTEXT)
    eng, dec = s.engine, s.decoder
    try:
        alone = {}
        for name, prompt in (("A", A), ("B", B), ("C", C)):  # every chunk its own forward, slot 0
            last = None
            for start in range(0, len(prompt), CHUNK):
                part = prompt[start:start + CHUNK]
                last = eng.prefill_rows([(part, start, 0)], len(part))[0].clone()
            alone[name] = (last, _cache(dec, 0, len(prompt)))
        # A's two chunks, B and C in one forward of whole-chunk rows (bucket 4), A in slot 0, B 1, C 2
        both = eng.prefill_rows([(A[:CHUNK], 0, 0), (B, 0, 1), (A[CHUNK:], CHUNK, 0), (C, 0, 2)], CHUNK)
        together = {"A": (both[2].clone(), _cache(dec, 0, len(A))), "B": (both[1].clone(), _cache(dec, 1, len(B))),
                    "C": (both[3].clone(), _cache(dec, 2, len(C)))}
        # B beside C at B's... C's length (8), bucket 2; then A's tail alone in a bucket of 1 row
        pair = eng.prefill_rows([(C, 0, 2), (B, 0, 1)], len(C))
        paired = {"B": pair[1].clone(), "C": pair[0].clone()}
        try:
            eng.prefill_rows([(A[:CHUNK], 0, 0)] * (ROWS + 1), CHUNK)
            over = None
        except CapacityError as e:
            over = str(e)
        return alone, together, paired, over
    finally:
        s.close()


@pytest.mark.slow
def test_a_chunk_gives_its_solo_bits_in_any_prefill_forward(paths):
    check(run_ranks(_worker, 1, backend="cpu", args=(paths["qwen3_moe-tiny"],), timeout_s=600)[0])


def check(result) -> None:
    """The assertions of one rank's result, on any device."""
    alone, together, paired, over = result
    for name, (logits, (k, v)) in alone.items():
        t_logits, (tk, tv) = together[name]
        logits, k, v = logits.cpu(), k.cpu(), v.cpu()
        t_logits, tk, tv = t_logits.cpu(), tk.cpu(), tv.cpu()
        assert torch.isfinite(logits).all() and logits.abs().max() > 0
        assert torch.equal(t_logits, logits), f"{name}: last-token logits in a forward of four chunks"
        assert torch.equal(tk, k) and torch.equal(tv, v), f"{name}: cache entries in a forward of four chunks"
        if name in paired:
            assert torch.equal(paired[name].cpu(), logits), f"{name}: logits beside one other chunk"
    assert over is not None and "rows" in over, "five rows where four fit must be refused"
