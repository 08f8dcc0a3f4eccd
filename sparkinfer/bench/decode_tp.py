"""`sparkinfer bench decode --tp N [--dcp N]`: the decode step of whole models on N
ranks (one GPU each; CPU ranks through the interpreter with --dry-run), ours beside
the same decoder on torch ops with NCCL all-reduces, in one launch.

Every rank checks its device's free memory for its shard (`decode_memory`), builds
the same random model (transformers' class, the same seed; or with `--weights
random-direct` a `RandomSource`, whose tensors every rank draws alike and slices;
or with `--model` the checkpoint, each rank reading its slices),
keeps its shard (`Sharding(rank, N, dcp)`), prefills the same prompt and times the
same bucket graphs in lockstep; a row holds the slowest rank's time (each rank's in
us_per_rank), its floor is one rank's bytes (its weights, the experts a batch hits on
its shard of I, its KV heads) at the copy bandwidth that rank measured, and its `ok`
needs every rank's replay to equal its eager step and every rank's logits to be the
same bits (the decoder's contract). The prefill logits' error against transformers'
bf16 forward is recorded, not gated (see `decode.py`); random-direct rows have none.
"""

from __future__ import annotations

__all__ = ["tp_rows"]


def tp_rows(preset: str, args, say, name: str | None = None) -> list[dict]:
    """Rows of one preset at --tp ranks (see the module docstring); name: `preset` is a
    checkpoint directory (`bench decode --model`), its rows named so."""
    from sparkinfer.bench.decode_memory import max_cache_len, preset_layers
    from sparkinfer.bench.decode_model import build_modes
    from sparkinfer.runtime import run_ranks

    opt = dict(layers=preset_layers(args), batches=[int(b) for b in args.batches.split(",")], context=args.context,
               replays=args.replays, builds=list(build_modes(args)), dcp=args.dcp, dry=args.dry_run,
               weights=args.weights, max_len=max_cache_len(args), name=name)
    ranks = run_ranks(_rank_rows, args.tp, backend="cpu" if args.dry_run else "cuda", args=(preset, opt),
                      timeout_s=600 if args.dry_run else 1800)
    rows = []
    for rs in zip(*ranks):
        row = dict(rs[0], us_per_rank=[r["us_per_step"] for r in rs], us_per_step=max(r["us_per_step"] for r in rs))
        row["tokens_per_s"] = row["batch"] / row["us_per_step"] * 1e6
        row["frac_floor"] = row["floor_us"] / row["us_per_step"] if row.get("floor_us") else None
        row["ranks_same_logits"] = all(r["logits_digest"] == rs[0]["logits_digest"] for r in rs)
        row["replay_equals_eager"] = all(r["replay_equals_eager"] for r in rs)
        row["ok"] = row["ranks_same_logits"] and (row["replay_equals_eager"] or row["impl"] == "torch")
        del row["logits_digest"]
        rows.append(row)
        say(row)
    return rows


def _rank_rows(world, preset: str, opt: dict) -> list[dict]:
    import torch

    from sparkinfer.bench.decode_memory import check_fits, memory_need, spec_config
    from sparkinfer.bench.decode_model import (
        build,
        copy_bandwidth,
        floor_bytes,
        model_source,
        prefill_rows,
        step_us,
    )
    from sparkinfer.comm import Communicator
    from sparkinfer.models.build import comm_capacity
    from sparkinfer.models.config import load_spec
    from sparkinfer.models.weights import Sharding

    dev = world.device
    sharding = Sharding(world.rank, world.world_size, opt["dcp"])
    spec = load_spec(spec_config(preset, opt["layers"], opt["weights"]))
    batch, ctx = max(opt["batches"]), opt["context"]
    if dev.type == "cuda":  # before this rank allocates anything
        for fmt in dict.fromkeys(f for f, _, _ in opt["builds"]):
            need = memory_need(spec, fmt, source=opt["weights"], batch=batch, max_len=opt["max_len"],
                               sharding=sharding)
            check_fits(need, torch.cuda.mem_get_info(dev)[0], f"rank {world.rank} of {preset} at "
                       f"{spec.num_layers} layers with {fmt} experts and --weights {opt['weights']}")
    model, cfg = model_source(preset, opt["layers"], opt["weights"], dev)  # a checkpoint: this rank's slices
    max_tokens = max(batch, min(ctx, 512))
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, spec.vocab_size, (ctx,), generator=gen).tolist()
    ref = None
    if opt["weights"] == "transformers":
        with torch.no_grad():
            ref = model(torch.tensor([prompt], device=dev)).logits[0, -1].float()
    bw = copy_bandwidth() if dev.type == "cuda" else None
    comm = Communicator(device=dev, capacity_bytes=comm_capacity(spec, world.world_size, batch, max_tokens),
                        channel_ids=("target",))
    rows = []
    try:
        for fmt, ops, inv in opt["builds"]:
            _, dec, engine = build(model, cfg, fmt=fmt, ops=ops, batch=batch, max_len=ctx + 64,
                                   max_tokens=max_tokens, comm=comm, batch_invariant=inv, sharding=sharding,
                                   device=dev)
            with torch.no_grad():
                logits = prefill_rows(engine, prompt, batch)
                err = ((logits.float() - ref).norm() / ref.norm()).item() if ref is not None else None
                agrees = int(logits.argmax()) == int(ref.argmax()) if ref is not None else None
                for b in opt["batches"]:
                    us, same = step_us(engine, b, ctx, opt["replays"])
                    floor = floor_bytes(spec, dec.w, b, ctx, fmt) / bw * 1e6 if bw else None
                    rows.append(dict(bench="decode", preset=opt["name"] or preset, layers=spec.num_layers,
                                     weights=opt["weights"], impl=ops, experts=fmt, tp=world.world_size,
                                     dcp=opt["dcp"], batch=b, context=ctx,
                                     **({"batch_invariant": inv} if ops == "sparkinfer" else {}),
                                     us_per_step=us, floor_us=floor, copy_bandwidth_Bps=bw,
                                     replay_equals_eager=same, prefill_rel_err_vs_hf=err, argmax_agrees_hf=agrees,
                                     logits_digest=_digest(logits)))
            del engine, dec
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        comm.close()
    return rows


def _digest(t) -> str:
    """The bits of a tensor as a short hash (ranks compare logits without shipping them)."""
    import hashlib

    import torch

    return hashlib.sha1(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
