"""What a launch can run, decided on the launching process before any rank starts.

    spec = load_spec(path)
    validate_launch(spec, tp=8, dcp=1, moe_format="bf16", prompt_tokens=319, max_new_tokens=64)

Pure functions of a `ModelSpec` and the launch's numbers: no file, device or
process. Everything that would fail inside the ranks and is known from
config.json alone is refused here, once, with one line that names the field,
its value and what would work (for the world size: every tp from 1 to 16 that
this checkpoint can run). `sparkinfer generate` calls `validate_launch`; a
server calls it at startup and `check_prompt` for each request (its 400).

What runs at any tp (so is never refused here): a per-rank expert, shared-expert
or dense-MLP intermediate size that the kernels' tiles do not divide (the MoE
plan pads it with zero weights, `moe/plan.py`; the projections mask their
tails), and a vocabulary that does not divide over the ranks (padded rows).
"""

from __future__ import annotations

from sparkinfer.attention.config import MAX_GROUP
from sparkinfer.errors import CapacityError, PlanError, SetupError, ShapeError, UnsupportedModelError
from sparkinfer.models.config import ModelSpec
from sparkinfer.models.experts import MOE_FORMATS
from sparkinfer.moe.plan import PAD_MULTIPLE
from sparkinfer.quant.fp8 import FP8_BLOCK
from sparkinfer.quant.nvfp4 import BLOCK as NVFP4_GROUP
from sparkinfer.runtime.ranks import MAX_WORLD_SIZE

__all__ = ["validate_launch", "check_prompt", "working_tp"]

# The head dims the attention kernel runs (attention/launch.py `_shapes`).
HEAD_DIM_RANGE = (16, 256)


def validate_launch(spec: ModelSpec, *, tp: int, dcp: int = 1, moe_format: str = "bf16",
                    prompt_tokens: int | None = None, max_new_tokens: int | None = None,
                    max_context: int | None = None, self_draft: int = 0) -> None:
    """Raise, in one line, the first reason `spec` cannot run this launch; return None if it can.

    spec: the checkpoint's `load_spec`. tp: tensor-parallel ranks; dcp: 1, or tp
    for decode-context parallelism; moe_format: "bf16" | "nvfp4" | "fp8_block".
    prompt_tokens / max_new_tokens: one request's lengths, checked by
    `check_prompt` when prompt_tokens is given. max_context: cache positions per
    request (prompt + new tokens), when the caller fixes it (a server); must not
    exceed max_position_embeddings. self_draft: layers of the target used as a
    speculative draft (0: none).

    Raises SetupError (tp outside 1..16), ShapeError (dcp, a size the ranks
    cannot split, self_draft), PlanError (moe_format), UnsupportedModelError (a
    field no tp can run) and CapacityError (`check_prompt`, max_context). Pure:
    no device, no file, no process.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= MAX_WORLD_SIZE:
        raise SetupError(f"tp={tp!r}: SparkInfer runs 1 to {MAX_WORLD_SIZE} tensor-parallel ranks")
    if dcp not in (1, tp):
        raise ShapeError(f"dcp={dcp!r} with tp={tp}: dcp is 1, or tp ({tp}) to split the KV cache over the ranks")
    if moe_format not in MOE_FORMATS:
        raise PlanError(f"moe_format={moe_format!r}; choose one of {MOE_FORMATS}")
    _check_model(spec, moe_format)
    problem = _tp_problem(spec, tp, dcp, moe_format)
    if problem is not None:
        launch = f"tp={tp}" + (f" dcp={dcp}" if dcp > 1 else "")
        raise ShapeError(f"{launch}: {problem}; {_what_works(spec, dcp, moe_format)}")
    if not 0 <= self_draft < spec.num_layers:
        raise ShapeError(f"self_draft={self_draft}: a self-draft takes 1 to {spec.num_layers - 1} of the "
                         f"model's {spec.num_layers} layers (0: none)")
    if max_context is not None and not 1 <= max_context <= spec.max_position_embeddings:
        raise CapacityError(f"max_context={max_context}: cache positions per request must lie in 1.."
                            f"{spec.max_position_embeddings} (the model's max_position_embeddings)")
    if prompt_tokens is not None:
        check_prompt(spec, prompt_tokens, max_new_tokens, max_context=max_context)


def check_prompt(spec: ModelSpec, prompt_tokens: int, max_new_tokens: int | None = None, *,
                 max_context: int | None = None) -> None:
    """CapacityError, in one line, unless a prompt of `prompt_tokens` tokens and up to
    `max_new_tokens` new ones (None: only the prompt is checked) fit the model's
    max_position_embeddings and, when given, the max_context cache positions per
    request: the prompt must hold at least one token and prompt + new tokens <= the
    smaller limit. Pure."""
    limit, what = spec.max_position_embeddings, "the model's max_position_embeddings"
    if max_context is not None and max_context < limit:
        limit, what = max_context, "max_context, the cache positions per request"
    if prompt_tokens < 1:
        raise CapacityError("the prompt is empty (0 tokens); give it at least one token")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise CapacityError(f"max_new_tokens={max_new_tokens}: ask for at least 1 new token")
    if prompt_tokens > limit:
        raise CapacityError(f"the prompt has {prompt_tokens} tokens, more than {what} ({limit}); shorten it")
    if max_new_tokens is not None and prompt_tokens + max_new_tokens > limit:
        room = limit - prompt_tokens
        hint = f"ask for at most {room} new tokens or shorten the prompt" if room else "shorten the prompt"
        raise CapacityError(f"{prompt_tokens} prompt tokens + max_new_tokens={max_new_tokens} = "
                            f"{prompt_tokens + max_new_tokens} exceed {what} ({limit}); {hint}")


def working_tp(spec: ModelSpec, *, dcp: bool = False, moe_format: str = "bf16") -> list[int]:
    """The tp values from 1 to 16 that `spec` runs with (dcp = tp when `dcp`). Pure."""
    return [w for w in range(1, MAX_WORLD_SIZE + 1) if _tp_problem(spec, w, w if dcp else 1, moe_format) is None]


def _check_model(spec: ModelSpec, fmt: str) -> None:
    """Fields no tp can run with: UnsupportedModelError naming the field."""
    lo, hi = HEAD_DIM_RANGE
    if not lo <= spec.head_dim <= hi:
        raise UnsupportedModelError(f"head_dim={spec.head_dim}: the attention kernel runs head dims {lo} to {hi}")
    group = spec.num_heads // spec.num_kv_heads
    if group > MAX_GROUP:
        raise UnsupportedModelError(f"num_attention_heads={spec.num_heads} over num_key_value_heads="
                                    f"{spec.num_kv_heads} is {group} query heads per KV head; the attention "
                                    f"kernel runs at most {MAX_GROUP}")
    if not any(spec.moe_layers):
        return
    need = FP8_BLOCK if fmt == "fp8_block" else PAD_MULTIPLE
    if spec.hidden % need:
        alt = "; use moe_format 'bf16' or 'nvfp4'" if fmt == "fp8_block" and spec.hidden % PAD_MULTIPLE == 0 \
            else ""
        raise UnsupportedModelError(f"hidden_size={spec.hidden}: {fmt} MoE kernels need a multiple of {need}{alt}")
    if spec.quant == "nvfp4" and fmt == "fp8_block":
        raise UnsupportedModelError("moe_format='fp8_block' with an NVFP4 checkpoint (quantization_config "
                                    "quant_algo NVFP4): use moe_format 'nvfp4' (as stored) or 'bf16'")


def _tp_problem(spec: ModelSpec, tp: int, dcp: int, fmt: str) -> str | None:
    """Why `spec` cannot split over tp ranks (one clause naming the field), or None.
    Heads follow `loader.head_shard`; sizes follow `Sharding.split` and `experts.load_routed`."""
    hq, kvh = spec.num_heads, spec.num_kv_heads
    if hq % tp:
        return f"num_attention_heads={hq} does not divide over {tp} ranks"
    if dcp == 1 and kvh >= tp and kvh % tp:
        return f"num_key_value_heads={kvh} does not divide over {tp} ranks"
    if dcp == 1 and kvh < tp:
        per, group = hq // tp, hq // kvh
        if any(r * per // group != ((r + 1) * per - 1) // group for r in range(tp)):
            return (f"num_key_value_heads={kvh} is fewer than {tp} ranks and a rank's {per} query heads "
                    f"would read two KV heads (groups of {group})")
    sizes = [("intermediate_size", spec.dense_intermediate), ("shared experts' intermediate size",
                                                               spec.shared_intermediate)]
    if any(spec.moe_layers):
        sizes.insert(0, ("moe_intermediate_size", spec.moe_intermediate))
    for name, n in sizes:
        if n % tp:
            return f"{name}={n} does not divide over {tp} ranks"
    if not any(spec.moe_layers):
        return None
    per = spec.moe_intermediate // tp
    if fmt == "fp8_block" and per % FP8_BLOCK:
        return (f"moe_intermediate_size={spec.moe_intermediate} is {per} per rank and fp8_block experts "
                f"need a multiple of {FP8_BLOCK} per rank (moe_format 'bf16' or 'nvfp4' run any)")
    if fmt == "nvfp4" and spec.quant == "nvfp4" and per % NVFP4_GROUP:
        return (f"moe_intermediate_size={spec.moe_intermediate} is {per} per rank and an NVFP4 checkpoint's "
                f"experts read as stored need a multiple of {NVFP4_GROUP} per rank (moe_format 'bf16' runs any)")
    return None


def _what_works(spec: ModelSpec, dcp: int, fmt: str) -> str:
    plain, split = working_tp(spec, moe_format=fmt), working_tp(spec, dcp=True, moe_format=fmt)
    if not plain and not split:
        return f"no tp from 1 to {MAX_WORLD_SIZE} runs this checkpoint with moe_format={fmt!r}"
    text = f"tp values that work: {', '.join(map(str, plain)) or 'none'}"
    extra = [w for w in split if w not in plain and w > 1]
    if dcp > 1 or extra:
        text += f"; with dcp = tp: {', '.join(map(str, split)) or 'none'}"
    return text
