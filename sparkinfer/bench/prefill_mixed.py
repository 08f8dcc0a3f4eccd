"""Mixed steps against their parts: D decode rows alone, R prompt chunks alone, and
both in one mixed forward (`Engine.launch_mixed`), each a CUDA graph replay.

    sparkinfer bench prefill --beside 32,64 [--rows 1,2,4] [--context 512]

A served batch at concurrency C brings about C / output_len prompts a step; a mixed
step runs their chunks beside the decode rows, so the step costs the decode step plus
the chunks' marginal time (`marginal_ms` = mixed - decode), which the separate prefill
forward it replaces (`prefill_ms`) bounds from above. Rows "mixed" carry the three
times, the marginal time per prompt token, two bitwise checks (the decode rows' logits
equal the decode step's, each chunk's last-token logits equal the prefill forward's)
and, on a GPU, the kernels of one replay of the decode step and of the mixed step
(CUDA profiler), so what a chunk adds reads kernel by kernel.
"""

from __future__ import annotations

__all__ = ["mixed_rows"]


def _replay_ms(run, replays: int) -> float:
    """Median ms of one call of `run` (a graph replay on a GPU, the eager forward on the
    CPU) over `replays` calls (`timing.time_calls`)."""
    import torch

    from sparkinfer.bench.timing import median, time_calls

    return median(time_calls(run, replays, cuda=torch.cuda.is_available())) * 1e3


def _top(kernels: list[dict], n: int = 16) -> list[dict]:
    return [dict(k, us_per_step=round(k["us_per_step"], 2)) for k in kernels[:n]]


def mixed_rows(model, cfg, args, dev, say) -> list[dict]:
    """Rows "mixed" for each D in args.beside and each R in args.rows (R <= the mixed
    step's chunk rows): decode rows at context args.context, each reading a prompt of
    its own, beside R chunks of args.chunk random tokens at prompt start."""
    import numpy as np
    import torch

    from sparkinfer.bench.decode_model import build, graph_kernels, prefill_rows
    from sparkinfer.engine import SamplingParams
    from sparkinfer.engine.engine import MIXED_ROWS
    from sparkinfer.engine.plan import SamplingColumns

    q, ctx = args.chunk, args.context
    rows_list = [int(r) for r in args.rows.split(",") if int(r) <= MIXED_ROWS]
    out = []
    for d in [int(b) for b in args.beside.split(",")]:
        most = max(rows_list)
        spec, dec, eng = build(model, cfg, fmt="bf16", ops="sparkinfer", batch=d + most,
                               max_len=max(ctx + 8, q), max_tokens=_decoder_tokens(d, most, q))
        gen = torch.Generator().manual_seed(d)
        with torch.no_grad():
            prefill_rows(eng, torch.randint(0, cfg["vocab_size"], (ctx,), generator=gen).tolist(), d - 1)
            toks = torch.randint(0, cfg["vocab_size"], (d,), generator=gen).numpy()
            slots, positions = np.arange(d), np.full(d, ctx)
            greedy = SamplingColumns.of([SamplingParams(temperature=0.0)] * d)
            ref, _ = eng.launch_decode(slots, positions, greedy, tokens=toks)
            ref = ref.clone()
            _, run_decode = eng._graph_step(eng.bucket(d), 1, False)
            decode_ms = _replay_ms(run_decode, args.replays)
            kernels_decode = graph_kernels(run_decode) if eng.graphs else []
            for r in rows_list:
                chunks = [(torch.randint(0, cfg["vocab_size"], (q,), generator=gen).tolist(), 0, d + i)
                          for i in range(r)]
                alone = eng.prefill_rows(chunks, q).clone()
                _, run_prefill = eng._prefill_step(next(b for b in eng.prefill_buckets(q) if b >= r), q)
                prefill_ms = _replay_ms(run_prefill, args.replays)
                csamp = SamplingColumns.of([SamplingParams(temperature=0.0)] * r)
                logits, _ = eng.launch_mixed(slots, positions, greedy, chunks, csamp, q, tokens=toks)
                bucket = eng.bucket(d)
                decode_same = torch.equal(logits[:d], ref)
                chunks_same = torch.equal(logits[bucket:bucket + r], alone)
                fits = [b for b in eng.mixed_rows(d, q) if b >= r]
                _, run_mixed = eng._mixed_step(bucket, fits[0], q, False)
                mixed_ms = _replay_ms(run_mixed, args.replays)
                row = dict(bench="prefill", kind="mixed", preset=args.preset, layers=spec.num_layers, decode_rows=d,
                           chunks=r, chunk=q, context=ctx, graphs=eng.graphs, decode_ms=decode_ms,
                           prefill_ms=prefill_ms, mixed_ms=mixed_ms, marginal_ms=mixed_ms - decode_ms,
                           saved_ms=decode_ms + prefill_ms - mixed_ms,
                           marginal_us_per_prompt_token=(mixed_ms - decode_ms) * 1e3 / (r * q),
                           decode_equal=decode_same, chunks_equal=chunks_same, ok=decode_same and chunks_same)
                say(row)
                if eng.graphs:
                    row["kernels_decode"] = _top(kernels_decode)
                    row["kernels_mixed"] = _top(graph_kernels(run_mixed))
                out.append(row)
        del eng, dec
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _decoder_tokens(d: int, rows: int, q: int) -> int:
    """Tokens the decoder holds: a serving rank's (`session.decoder_tokens`, the decode
    bucket beside step_tokens' chunks), so each MoE layer plans the buckets a served mixed
    step runs in (beside 64 decode rows, four chunks of 256 are T = 1,088 of the
    2,048-token bucket, BM 128 tiles; a last bucket of 1,088 tokens would take BM 64), and
    at least D decode rows (padded to their power-of-two bucket) beside `rows` chunks of q."""
    from sparkinfer.engine.config import EngineConfig
    from sparkinfer.engine.session import decoder_tokens

    bucket = 1 << max(0, (d - 1).bit_length())
    return max(bucket + rows * q, decoder_tokens(q, EngineConfig.step_tokens, bucket, mixed=True))
