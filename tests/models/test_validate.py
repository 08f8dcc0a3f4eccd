"""`validate_launch` / `check_prompt`: what runs, and every refusal as one line naming
the field, its value and what works. Pure: no checkpoint files, no ranks."""

import pytest

from sparkinfer.errors import CapacityError, PlanError, SetupError, ShapeError, UnsupportedModelError
from sparkinfer.models.config import load_spec
from sparkinfer.models.loader import head_shard
from sparkinfer.models.presets import preset_config
from sparkinfer.models.validate import check_prompt, validate_launch, working_tp
from sparkinfer.models.weights import Sharding

NVFP4 = {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}
FP8 = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                               "weight_block_size": [128, 128]}}


def spec(name="qwen3_moe-tiny", **overrides):
    return load_spec(preset_config(name, **overrides))


def test_the_issues_shapes_run():
    """GLM-4.5-Air at TP 8 (176 experts' I per rank) and Qwen3-30B-A3B at TP 16 (48):
    refused by the MoE planner before; padded now."""
    validate_launch(spec("glm-4.5-air"), tp=8, moe_format="nvfp4", prompt_tokens=319, max_new_tokens=64)
    validate_launch(spec("qwen3-30b-a3b"), tp=16, dcp=16)
    assert working_tp(spec("glm-4.5-air")) == [1, 2, 4, 8, 16]
    assert working_tp(spec("qwen3_moe-tiny")) == [1, 2, 3, 6, 12]
    assert working_tp(spec("qwen3_moe-tiny"), dcp=True) == [1, 2, 3, 4, 6, 12]  # KV heads replicated


def test_tp_verdicts_agree_with_the_loaders_sharding():
    """Every head layout and tp 1..16, with and without DCP: a tp validates exactly when
    every rank's `head_shard` and `Sharding.split` of the intermediate sizes succeed."""
    for hq, kvh in ((1, 1), (4, 2), (6, 1), (8, 4), (8, 2), (12, 6), (12, 4), (32, 4), (96, 8), (40, 8)):
        s = spec(num_attention_heads=hq, num_key_value_heads=kvh, moe_intermediate_size=96, intermediate_size=80)
        for dcp in (False, True):
            want = []
            for tp in range(1, 17):
                try:
                    for r in range(tp):
                        sh = Sharding(r, tp, tp if dcp else 1)
                        head_shard(s, sh)
                        sh.split(96, "moe")
                        sh.split(80, "dense")
                except ShapeError:
                    continue
                want.append(tp)
            assert working_tp(s, dcp=dcp) == want, (hq, kvh, dcp)


REFUSALS = [  # id, spec, validate_launch keywords, error, message
    ("tp-0", spec(), dict(tp=0), SetupError, r"^tp=0: SparkInfer runs 1 to 16 tensor-parallel ranks$"),
    ("tp-17", spec(), dict(tp=17), SetupError, r"^tp=17: SparkInfer runs 1 to 16"),
    ("dcp", spec(), dict(tp=4, dcp=2), ShapeError, r"^dcp=2 with tp=4: dcp is 1, or tp \(4\)"),
    ("format", spec(), dict(tp=1, moe_format="int4"), PlanError, r"^moe_format='int4'; choose one of"),
    ("heads", spec(), dict(tp=8), ShapeError,
     r"^tp=8: num_attention_heads=12 does not divide over 8 ranks; tp values that work: 1, 2, 3, 6, 12; "
     r"with dcp = tp: 1, 2, 3, 4, 6, 12$"),
    ("kv-heads", spec(), dict(tp=4), ShapeError,
     r"^tp=4: num_key_value_heads=6 does not divide over 4 ranks; tp values that work: 1, 2, 3, 6, 12"),
    ("kv-read-two", spec(num_attention_heads=12, num_key_value_heads=4), dict(tp=6), ShapeError,
     r"^tp=6: num_key_value_heads=4 is fewer than 6 ranks and a rank's 2 query heads would read two KV heads "
     r"\(groups of 3\); tp values that work: 1, 2, 4, 12; with dcp = tp: 1, 2, 3, 4, 6, 12$"),
    ("moe-I", spec(moe_intermediate_size=100), dict(tp=3), ShapeError,
     r"^tp=3: moe_intermediate_size=100 does not divide over 3 ranks; tp values that work: 1, 2; "
     r"with dcp = tp: 1, 2, 4$"),
    ("dense-I", spec(intermediate_size=100), dict(tp=3), ShapeError,
     r"^tp=3: intermediate_size=100 does not divide over 3 ranks"),
    ("shared-I", spec("glm4_moe-tiny", moe_intermediate_size=100), dict(tp=3), ShapeError,
     r"^tp=3: moe_intermediate_size=100 does not divide"),
    ("fp8-per-rank", spec("qwen3-30b-a3b", **FP8), dict(tp=16, moe_format="fp8_block"), ShapeError,
     r"^tp=16: moe_intermediate_size=768 is 48 per rank and fp8_block experts need a multiple of 128 per rank "
     r"\(moe_format 'bf16' or 'nvfp4' run any\); tp values that work: 1, 2$"),
    ("nvfp4-stored-per-rank", spec(moe_intermediate_size=48, **NVFP4), dict(tp=2, moe_format="nvfp4"), ShapeError,
     r"^tp=2: moe_intermediate_size=48 is 24 per rank and an NVFP4 checkpoint's experts read as stored need a "
     r"multiple of 16 per rank \(moe_format 'bf16' runs any\); tp values that work: 1, 3$"),
    ("head-dim", spec(head_dim=8), dict(tp=1), UnsupportedModelError,
     r"^head_dim=8: the attention kernel runs head dims 16 to 256$"),
    ("group", spec(num_attention_heads=256, num_key_value_heads=1), dict(tp=1), UnsupportedModelError,
     r"^num_attention_heads=256 over num_key_value_heads=1 is 256 query heads per KV head; .* at most 128$"),
    ("hidden", spec(hidden_size=48), dict(tp=1), UnsupportedModelError,
     r"^hidden_size=48: bf16 MoE kernels need a multiple of 32$"),
    ("fp8-hidden", spec(), dict(tp=1, moe_format="fp8_block"), UnsupportedModelError,
     r"^hidden_size=64: fp8_block MoE kernels need a multiple of 128; use moe_format 'bf16' or 'nvfp4'$"),
    ("nvfp4-as-fp8", spec(hidden_size=128, **NVFP4), dict(tp=1, moe_format="fp8_block"), UnsupportedModelError,
     r"^moe_format='fp8_block' with an NVFP4 checkpoint"),
    ("self-draft", spec(), dict(tp=1, self_draft=3), ShapeError,
     r"^self_draft=3: a self-draft takes 1 to 2 of the model's 3 layers \(0: none\)$"),
    ("max-context", spec(), dict(tp=1, max_context=1024), CapacityError,
     r"^max_context=1024: cache positions per request must lie in 1..512"),
]


@pytest.mark.parametrize("s,kw,err,match", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refusals_are_one_line(s, kw, err, match):
    with pytest.raises(err, match=match) as ei:
        validate_launch(s, **kw)
    assert "\n" not in str(ei.value)


PROMPTS = [  # id, prompt tokens, max_new_tokens, max_context, message (None: fits); positions 512
    ("fits", 400, 112, None, None),
    ("fits-prompt-only", 512, None, None, None),
    ("empty", 0, 8, None, r"^the prompt is empty \(0 tokens\); give it at least one token$"),
    ("no-new", 5, 0, None, r"^max_new_tokens=0: ask for at least 1 new token$"),
    ("too-long", 513, None, None, r"^the prompt has 513 tokens, more than the model's max_position_embeddings "
                                  r"\(512\); shorten it$"),
    ("no-room", 512, 1, None, r"^512 prompt tokens \+ max_new_tokens=1 = 513 exceed the model's "
                              r"max_position_embeddings \(512\); shorten the prompt$"),
    ("room", 500, 64, None, r"= 564 exceed .*; ask for at most 12 new tokens or shorten the prompt$"),
    ("cache", 100, 64, 128, r"^100 prompt tokens \+ max_new_tokens=64 = 164 exceed max_context, the cache "
                            r"positions per request \(128\); ask for at most 28 new tokens"),
]


@pytest.mark.parametrize("p,n,ctx,match", [r[1:] for r in PROMPTS], ids=[r[0] for r in PROMPTS])
def test_prompt_lengths(p, n, ctx, match):
    if match is None:
        check_prompt(spec(), p, n, max_context=ctx)
        return
    with pytest.raises(CapacityError, match=match):
        check_prompt(spec(), p, n, max_context=ctx)
    with pytest.raises(CapacityError, match=match):  # the launch check asks the same
        validate_launch(spec(), tp=2, prompt_tokens=p, max_new_tokens=n, max_context=ctx)
