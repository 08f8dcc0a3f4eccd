"""The pieces of the decode benchmark: a realistic model with random weights, the
floor of a decode step, and timers for graph replays and whole generations.

Weights come from transformers' own model class (`hf_model`: a reference to compare
logits with, and a second copy of every weight) or straight from a `RandomSource`
(`random_model`: the same distributions drawn tensor by tensor on the device, so a
preset fits at its full depth). Either goes through the checkpoint loader (`build`).

Legend: B rows in a decode step, L layers, E experts, K top-k, H hidden, I expert
intermediate, V vocabulary.
"""

from __future__ import annotations

import time

__all__ = ["hf_model", "random_model", "model_source", "build", "prefill_rows", "floor_bytes", "copy_bandwidth",
           "step_us", "hf_step_us", "step_kernels", "build_modes"]


def hf_model(preset: str, layers: int, device, *, agree_after: int | None = None):
    """(transformers model of `preset` in bf16 on `device`, its config dict). Weights are
    random, N(0, 1/fan_in) for matrices, routers re-drawn N(0, 4/H) so routing spreads
    (transformers initialises them to zero: every token would pick the same experts).
    agree_after=N zeroes the output projections (o_proj, MLP and expert down_proj) of
    layers N.., so those layers add nothing: a self-draft of the first N layers then
    agrees with the target by construction (its logits are the same)."""
    import torch
    import transformers

    from sparkinfer.models.presets import _CLASSES, preset_config

    cfg = preset_config(preset, layers=layers)
    cfg_cls, model_cls = (getattr(transformers, n) for n in _CLASSES[cfg["architectures"][0]])
    config = cfg_cls(**{k: v for k, v in cfg.items() if k != "torch_dtype"})
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls(config).to(torch.bfloat16).eval()
    h = config.hidden_size
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith("gate.weight"):
                t.copy_(torch.randn_like(t, dtype=torch.float32) * 2 / h ** 0.5)
            elif t.dim() >= 2 and not name.endswith("embed_tokens.weight"):
                t.copy_(torch.randn_like(t, dtype=torch.float32) / t.shape[-1] ** 0.5)
            if agree_after is not None and ".layers." in name:
                layer = int(name.split(".layers.")[1].split(".")[0])
                if layer >= agree_after and ("o_proj" in name or "down_proj" in name or ".w2" in name):
                    t.zero_()
    return model, cfg


def random_model(preset: str, layers: int | None, device, *, agree_after: int | None = None):
    """(a `RandomSource` of `preset` with `layers` decoder layers (None: the preset's own
    count) drawing on `device`, its config dict): `hf_model`'s distributions without a
    transformers model; agree_after as there. Allocates nothing until read."""
    from sparkinfer.models.presets import preset_config
    from sparkinfer.models.random_source import RandomSource

    cfg = preset_config(preset, layers=layers)
    return RandomSource(cfg, seed=0, device=device, zero_from=agree_after), cfg


def model_source(preset: str, layers: int | None, weights: str, device):
    """(weights, cfg) for `build` by `bench decode --weights`: "transformers" (`hf_model`),
    "random-direct" (`random_model`), or "checkpoint", where `preset` is a checkpoint
    directory, read through the loader (cfg: the directory)."""
    if weights == "checkpoint":
        from sparkinfer.models.checkpoint import Checkpoint

        return Checkpoint(preset), preset
    return (hf_model if weights == "transformers" else random_model)(preset, layers, device)


def build(model, cfg, *, fmt: str, ops: str, batch: int, max_len: int, max_tokens: int, sharding=None,
          comm=None, batch_invariant: bool = True, device=None):
    """(spec, decoder, engine) of our model on `model`'s weights: a transformers model
    (its state dict is read), a `RandomSource` (`random_model`) or a `Checkpoint` (read
    onto `device`; cfg its directory, for `load_spec`); one rank's shard
    (`sharding`, default the whole model) over `comm` (None for one rank);
    batch_invariant: the decoder's switch (see `Decoder`). Allocates on the model's device.

    Our kernels' MoE layers keep a prepared copy of each layer's experts (w1 is always
    re-laid out: `moe/weights.prepare_weights`), so they are made here one layer at a
    time and the loaded experts of that layer dropped (`models.decoder.prepare_moe`): peak memory
    is the model plus one layer's copy, not the model plus every w1 (Mixtral-8x7B at
    32 layers: 93 GB of weights and 60 GB of w1, more than an H200 holds)."""
    from sparkinfer.engine import Engine
    from sparkinfer.models.checkpoint import Checkpoint
    from sparkinfer.models.config import load_spec
    from sparkinfer.models.decoder import Decoder, KVCache, prepare_moe
    from sparkinfer.models.loader import load_weights
    from sparkinfer.models.random_source import RandomSource
    from sparkinfer.models.tensor_source import TensorSource
    from sparkinfer.models.weights import Sharding

    dev = device if device is not None else model.device
    src = model if isinstance(model, (RandomSource, Checkpoint)) else TensorSource(model.state_dict())
    spec = load_spec(cfg)
    sh = sharding or Sharding()
    weights = load_weights(src, spec, sh, device=dev, moe_format=fmt)
    cache = KVCache(spec.num_layers, batch + 1, max_len, weights.layers[0].attn.kv_heads, spec.head_dim, sh, dev)
    moe = prepare_moe(spec, weights, moe_format=fmt, max_tokens=max_tokens, batch_invariant=batch_invariant) \
        if ops == "sparkinfer" else None
    dec = Decoder(spec, weights, sh, comm=comm, cache=cache, max_tokens=max_tokens, moe_format=fmt, ops=ops,
                  batch_invariant=batch_invariant, share_moe=moe)
    return spec, dec, Engine(dec, max_batch=batch, comm=comm)


def prefill_rows(engine, prompt: list[int], batch: int):
    """Prefill `prompt` into slot 0 and a random prompt of the same length into each of
    slots 1..batch, so each row of a timed step reads a context of its own, as served
    requests do; returns slot 0's last logits. Rows that shared one context (its keys
    and values copied to every slot, before 2026-12-04) routed alike and hit fewer
    experts than a served batch: on an H200, Qwen3-30B-A3B's 8-layer step at batch 64
    took 2.46 ms that way and 3.71 ms over 64 served prompts' caches (the serving
    engine's own graph replayed back to back), its fc1 at 177 us a layer, the rate of
    every expert's weights."""
    import torch

    logits = engine.prefill(prompt, 0)[0]
    gen = torch.Generator().manual_seed(len(prompt))
    vocab = engine.dec.spec.vocab_size
    for s in range(1, batch + 1):
        engine.prefill(torch.randint(0, vocab, (len(prompt),), generator=gen).tolist(), s)
    return logits


def floor_bytes(spec, weights, batch: int, ctx: int, fmt: str) -> int:
    """Bytes a decode step must read at least on one rank: every non-expert weight of
    its shard once, its shard of the distinct experts B tokens hit on average under
    uniform routing (E (1 - (1 - K/E)^B)), B embedding rows, its KV heads of B rows
    at ctx (all ctx positions: with DCP each rank reads only its share, so there the
    floor is an overestimate)."""
    from sparkinfer.models.weights import ExpertWeights

    per_weight = 2 if fmt == "bf16" else 0.5 + 1 / 16
    distinct = spec.num_experts * (1 - (1 - spec.top_k / spec.num_experts) ** batch)
    total = batch * spec.hidden * 2 + weights.lm_head.numel() * 2 + weights.final_norm.numel() * 2
    for lw in weights.layers:
        a, m = lw.attn, lw.mlp
        total += (a.qkv.numel() + a.o.numel()) * 2 + 4 * spec.hidden
        total += batch * ctx * 2 * a.kv_heads * spec.head_dim * 2
        if isinstance(m, ExpertWeights):  # w2 [E, H, I_l]: this rank's shard of I
            e_bytes = 3 * spec.hidden * int(m.w2.shape[-1]) * per_weight
            total += distinct * e_bytes + m.router.numel() * m.router.element_size()
            if m.shared is not None:
                total += (m.shared.gate_up.numel() + m.shared.down.numel()) * 2
        else:
            total += (m.gate_up.numel() + m.down.numel()) * 2
    return int(total)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes read + written per second by a device-to-device copy (median of 10 after 2)."""
    import torch

    a = torch.randn(nbytes // 4, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times = sorted(times[2:])
    return 2 * nbytes / times[len(times) // 2]


def step_us(engine, batch: int, ctx: int, replays: int) -> tuple[float, bool]:
    """(median us of one decode step of B rows of random tokens at context ctx, the step's
    output equal to eager). On a GPU the step is the bucket's CUDA graph, timed with events over
    `replays` replays (median of 3 runs); on the CPU the eager step, wall clock."""
    import torch

    from sparkinfer.engine import SamplingParams

    params = SamplingParams()
    gen = torch.Generator().manual_seed(batch)
    vocab = engine.dec.spec.vocab_size
    rows = [[int(t)] for t in torch.randint(0, vocab, (batch,), generator=gen)]  # distinct rows route apart
    logits, _ = engine.step(rows, [ctx] * batch, list(range(batch)), params)
    first = logits.clone()
    bufs, run = engine._graph_step(engine.bucket(batch), 1, params)
    same = torch.equal(first, engine.dec(bufs.step)[:batch])
    times = []
    for _ in range(3):
        if engine.graphs:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / replays)
        else:
            t0 = time.perf_counter()
            for _ in range(replays):
                engine.dec(bufs.step)
            times.append((time.perf_counter() - t0) * 1e6 / replays)
    return sorted(times)[1], same


def hf_step_us(model, batch: int, ctx: int, vocab: int) -> float:
    """us per decode token of transformers' greedy `generate`: (t(1 + 8) - t(1)) / 8."""
    import torch

    ids = torch.randint(0, vocab, (batch, ctx), device=model.device)
    t = {}
    for n in (1, 9):
        if ids.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False)
        if ids.is_cuda:
            torch.cuda.synchronize()
        t[n] = time.perf_counter() - t0
    return (t[9] - t[1]) / 8 * 1e6


def step_kernels(engine, batch: int, replays: int = 20, timeline: dict | None = None) -> list[dict]:
    """The GPU kernels of one replay of the bucket's decode graph (captured by
    `step_us`), as `graph_kernels` lists them."""
    from sparkinfer.engine import SamplingParams

    _, run = engine._graph_step(engine.bucket(batch), 1, SamplingParams())
    return graph_kernels(run, replays, timeline)


def graph_kernels(run, replays: int = 20, timeline: dict | None = None) -> list[dict]:
    """The GPU kernels of one call of `run` (a graph replay): [{name, per_step,
    us_per_step, us_credit}], slowest first, from the CUDA profiler over `replays` calls.
    us_per_step sums the kernels' durations, which under PDL count their waits;
    us_credit, the stretches of the step in which it was the running kernel that ended
    first (`bench.timeline`), adds up to the step. `timeline`, a dict, receives
    `timeline.replay_timeline`'s launches and idle time. Names are cut at 100 characters."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    from sparkinfer.bench.timeline import replay_timeline

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            run()
        torch.cuda.synchronize()
    agg = collections.defaultdict(lambda: [0, 0.0])
    events = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[ev.name[:100]]
            a[0] += 1
            a[1] += ev.device_time_total
            events.append((ev.name[:100], ev.time_range.start, ev.time_range.end))
    tl = replay_timeline(events, replays) or {}
    if timeline is not None:
        timeline.update(launches=tl.get("launches"), idle_us=tl.get("idle_us"))
    credit = tl.get("credit_by_name", {})
    return [dict(name=n, per_step=c / replays, us_per_step=t / replays, us_credit=credit.get(n))
            for n, (c, t) in sorted(agg.items(), key=lambda kv: -kv[1][1])]


def build_modes(args):
    """(format, ops, batch_invariant) of each decoder to build and time, in order: the
    invariance modes of one configuration back to back; the torch ops (bf16 only, when
    `args.impls` names them) have none."""
    modes = {"on": (True,), "off": (False,), "both": (True, False)}[args.invariance]
    impls = getattr(args, "impls", "sparkinfer,torch").split(",")
    for fmt in args.formats.split(","):
        for ops in [o for o in ("sparkinfer", "torch") if o in impls and (o == "sparkinfer" or fmt == "bf16")]:
            for inv in modes if ops == "sparkinfer" else (True,):
                yield fmt, ops, inv
