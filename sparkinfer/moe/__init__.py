"""Fused Mixture-of-Experts: spec, caps, plan, bind, run.

Legend: T tokens, E experts, K top-k, H hidden, I intermediate per rank.
Nothing runs at import.
"""

from sparkinfer.moe.binding import MoEBinding, ScratchSpec, allocate_scratch, bind, check_topk_ids, scratch_specs
from sparkinfer.moe.layer import MoELayer
from sparkinfer.moe.plan import MoEPlan, TileConfig, plan, plan_supports_aux_stream_overlap
from sparkinfer.moe.reference import moe_reference
from sparkinfer.moe.runner import RouteSum, run
from sparkinfer.moe.spec import MoECaps, MoESpec
from sparkinfer.moe.weights import MoEWeights, prepare_weights

__all__ = ["MoESpec", "MoECaps", "TileConfig", "MoEPlan", "plan",
           "plan_supports_aux_stream_overlap", "MoEWeights", "prepare_weights", "ScratchSpec",
           "scratch_specs", "allocate_scratch", "MoEBinding", "bind", "run", "check_topk_ids",
           "moe_reference", "MoELayer", "RouteSum"]
