"""A decoder's MoE layers share one scratch (`prepare_moe`, `allocate_scratch(share=)`):
layers run one after another and a layer's last reader of its scratch, the top-k
sum inside the norm after it (`RouteSum`), runs before the next layer writes it.
The same decoder with a scratch of its own for every layer gives the same bits
(Mixtral's tiny preset: every layer MoE, so layer 1 overwrites what layer 0 wrote).
"""

import torch

from sparkinfer.models.build import build_decoder
from sparkinfer.models.decoder import Step
from sparkinfer.models.weights import Sharding
from sparkinfer.moe import allocate_scratch

PROMPT = [3, 141, 59, 26, 53, 7, 99, 31, 4, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]  # grouped; decode: micro


def _i32(v):
    return torch.tensor(v, dtype=torch.int32)


def _logits(dec):
    """A prompt's prefill in slot 0, then one decode step: both steps' last logits."""
    n = len(PROMPT)
    with torch.no_grad():
        first = dec(Step(tokens=torch.tensor(PROMPT), positions=_i32(list(range(n))), slots=_i32([0] * n),
                         row_slots=_i32([0]), q_pos=_i32([0]), q_len=n, logit_rows=torch.tensor([n - 1])))
        nxt = dec(Step(tokens=torch.tensor([11]), positions=_i32([n]), slots=_i32([0]), row_slots=_i32([0]),
                       q_pos=_i32([n]), q_len=1, logit_rows=torch.tensor([0])))
    return first.clone(), nxt.clone()


def test_moe_layers_share_one_scratch_and_give_the_bits_of_their_own(ckpt_dir):
    path = ckpt_dir("mixtral-tiny")
    shared = build_decoder(path, Sharding(), device="cpu", max_batch=2, max_len=32, max_tokens=32)
    own = build_decoder(path, Sharding(), device="cpu", max_batch=2, max_len=32, max_tokens=32)
    layers = [m for m in shared.moe if m is not None]
    assert len(layers) >= 2
    for m in layers[1:]:
        assert m.scratch.keys() == layers[0].scratch.keys()
        assert all(m.scratch[k] is layers[0].scratch[k] for k in m.scratch)
    for m in own.moe:
        m.scratch = allocate_scratch(m.plan, "cpu")
    assert own.moe[1].scratch["route_out"].data_ptr() != own.moe[0].scratch["route_out"].data_ptr()
    for a, b in zip(_logits(shared), _logits(own)):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
