"""The measured cases of `sparkinfer bench fused`, run on each rank: the check and the
graph timing of every implementation of one fused-norm or dcp_merge config.

Legend: T tokens, H hidden (fused norm) or heads (dcp), D head dim, W ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time

from sparkinfer.bench.collectives import poison
from sparkinfer.bench.timing import Graph, median, time_calls

__all__ = ["Bench", "bench_norm", "sweep_norm", "bench_dcp", "EPS"]

EPS = 1e-6


class Bench:
    """One rank: communicator, the "bench" capture stream, shared budget decisions."""

    def __init__(self, world, opt):
        import torch

        from sparkinfer.comm import Communicator

        self.torch, self.world, self.opt = torch, world, opt
        self.dev = world.device
        self.cuda = self.dev.type == "cuda"
        # every rank on one GPU (a gloo group): our kernels are checked, not timed, and the
        # baselines that need NCCL (which takes one GPU per rank) or a timing are left out
        self.shared = world.backend == "cuda_shared"
        self.t0 = time.time()
        # 60 s device-side deadline: a peer may still be compiling its first launch
        self.comm = Communicator(device=self.dev, capacity_bytes=opt["capacity"], timeout_s=60,
                                 channel_ids=("bench",))
        self.stream = torch.cuda.Stream() if self.cuda else "bench_stream"

    def go(self) -> bool:
        """Rank 0's budget verdict, shared: both ranks run exactly the same configs."""
        mine = time.time() - self.t0 < self.opt["budget_s"]
        return bool(self.comm.group.all_gather(mine)[0])

    def same_on_ranks(self, tensors) -> bool:
        h = hashlib.sha1()
        for t in tensors:
            h.update(t.detach().contiguous().view(self.torch.uint8).cpu().numpy().tobytes())
        return len(set(self.comm.group.all_gather(h.hexdigest()))) == 1

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def graph(self, fn):
        """A graph of opt["iters"] calls of fn; returns (graph, holder): holder[0] is the
        last call's outputs (on CUDA the captured tensors every replay rewrites; the CPU
        stand-in re-runs fn, which refills the holder)."""
        outs = []

        def body():
            for _ in range(self.opt["iters"]):
                outs[:] = [fn()]

        scope = lambda replaying: self.comm.pool.capture(self.stream, "bench", reuse=True)  # noqa: E731
        cpu = None if self.cuda else self.comm.streams
        g = Graph(body, self.stream, scope=scope, cpu_streams=cpu)
        return g, outs

    def time_graph(self, g) -> float:
        """Seconds per call: median over replays of the N-call graph, / N."""
        g.replay()
        self.sync()
        ts = time_calls(g.replay, self.opt["reps"], cuda=self.cuda)
        return median(ts) / self.opt["iters"]


def close_err(actual, ref, eps) -> float:
    """Largest |a - r| / (|r| + 0.05 max|r|), in units of eps; inf where a is not
    finite (unless it equals r, as -inf lse rows do)."""
    a, r = actual.float(), ref.float()
    if bool((~(a.isfinite() | (a == r))).any()):
        return float("inf")
    fin = r.isfinite()
    if not bool(fin.any()):
        return 0.0
    a, r = a[fin], r[fin]
    floor = 0.05 * float(r.abs().max()) + 1e-30
    return float(((a - r).abs() / (r.abs() + floor)).max()) / eps


def run_config(b, base: dict, impls: dict, load, reference, tol: dict) -> list[dict]:
    """Check then time every impl of one config. impls: name -> call() returning outputs;
    load(seed) writes inputs in place; reference(name) -> expected outputs (None = skip)."""
    torch = b.torch
    rows = []
    for name, call in impls.items():
        if not b.go():
            if b.world.rank == 0:
                print(f"budget: skipping {base} {name}", flush=True)
            continue
        row = dict(base, impl=name)
        try:
            load(1)
            poison(*call())
            outs = call()
            b.sync()
            eager = [o.clone() for o in outs]
            exp = reference(name)
            eps = torch.finfo(outs[0].dtype).eps
            err = max(close_err(o, e, eps) for o, e in zip(outs, exp))
            ranks_equal = b.same_on_ranks(outs) if name in tol["bitwise"] else None
            g, held = b.graph(call)
            poison(*held[0])
            g.replay()
            b.sync()
            replay_ok = all(torch.equal(o.view(torch.uint8), e.view(torch.uint8)) for o, e in zip(held[0], eager))
            load(2)
            poison(*held[0])
            g.replay()
            b.sync()
            err2 = max(close_err(o, e, eps) for o, e in zip(held[0], reference(name)))
            ok = max(err, err2) <= tol[name] and replay_ok and ranks_equal is not False
            row.update(err_eps=max(err, err2), ranks_bitwise=ranks_equal, replay_bitwise=replay_ok, ok=ok)
            if not b.shared:
                row.update(us=b.time_graph(g) * 1e6, mode="graph" if b.cuda else "cpu", iters=b.opt["iters"])
            g.release()
            del g, held
        except Exception as exc:  # noqa: BLE001 - recorded as a failed row; CUDA errors end the run
            row.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:400]}")
            if "CUDA error" in str(exc) or "Collective" in type(exc).__name__:
                rows.append(row)
                raise
        rows.append(row)
        if b.world.rank == 0 and not row["ok"]:
            print(f"FAIL {base} {name}: {row.get('error') or row}", flush=True)
    return rows


def norm_inputs(b, H: int, T: int):
    """(x, residual, weight): [T, H], [T, H], [H] bf16; (load(seed): refill in place, reference(impl))."""
    torch, comm, W, dev = b.torch, b.comm, b.comm.world_size, b.dev
    from sparkinfer.comm.fused_norm.reference import add_rms_norm

    x, res, w = (torch.empty(shape, dtype=torch.bfloat16, device=dev) for shape in ((T, H), (T, H), (H,)))
    state = {}

    def load(seed):
        g = torch.Generator(device=dev).manual_seed(1000 * seed + T + H)
        xs = [torch.randn(T, H, generator=g, device=dev).bfloat16() for _ in range(W)]
        x.copy_(xs[comm.rank])
        res.copy_(2 * torch.randn(T, H, generator=g, device=dev))
        w.copy_(1 + 0.5 * torch.randn(H, generator=g, device=dev))
        total = sum(t.float() for t in xs)
        state.update(sum=total, norm=add_rms_norm(total, res, w, EPS))

    def reference(name):  # ar_*: the sum; fused: (out, residual_out)
        return (state["sum"],) if name.startswith("ar_") else state["norm"]
    return (x, res, w), (load, reference)


def bench_norm(b, H: int, T: int) -> list[dict]:
    torch, comm, W, dev = b.torch, b.comm, b.comm.world_size, b.dev
    import torch.nn.functional as F

    (x, res, w), (load, reference) = norm_inputs(b, H, T)
    names = ("o", "r", "o2", "r2", "s1", "s2", "s3", "s4")
    bufs = {k: torch.empty(T, H, dtype=torch.bfloat16, device=dev) for k in names}

    def torch_norm(s):
        r = s + res
        return F.rms_norm(r, (H,), w, EPS), r

    impls = {
        "fused": lambda: comm.all_reduce_add_rms_norm(x, res, w, EPS, out=bufs["o"], residual_out=bufs["r"]),
        "fused_flag": lambda: comm.all_reduce_add_rms_norm(x, res, w, EPS, out=bufs["o2"], residual_out=bufs["r2"],
                                                           algorithm="fused"),
        "ar_auto": lambda: (comm.all_reduce(x, bufs["s1"]),),
        "ar_oneshot": lambda: (comm.all_reduce(x, bufs["s2"], algorithm="oneshot"),),
        "ar+torch": lambda: torch_norm(comm.all_reduce(x, bufs["s3"])),
        "nccl+torch": lambda: torch_norm(comm.all_reduce(x, bufs["s4"], algorithm="nccl")),
    }

    if b.shared:
        impls = {k: impls[k] for k in ("fused", "fused_flag", "ar_auto", "ar_oneshot")}
    tol = {"fused": 4, "fused_flag": 4, "ar_auto": 2, "ar_oneshot": 2, "ar+torch": 16, "nccl+torch": 16,
           "bitwise": ("fused", "fused_flag", "ar_auto", "ar_oneshot")}
    from sparkinfer.comm.topology import select_algorithm

    nbytes = T * H * 2
    base = dict(op="fused_norm", H=H, T=T, dtype="bfloat16", nbytes=nbytes,
                ar_auto_algorithm=select_algorithm(comm.caps, nbytes))
    rows = run_config(b, base, impls, load, reference, tol)
    per_alg = {"ll": 2 * (W - 1), "oneshot": W - 1, "twoshot": 2 * (W - 1) / W, "nccl": 2 * (W - 1) / W}
    auto = base["ar_auto_algorithm"]
    alg = {"fused": "ll" if auto == "ll" else "oneshot", "fused_flag": "oneshot", "ar_oneshot": "oneshot",
           "ar_auto": auto, "ar+torch": auto, "nccl+torch": "nccl"}
    for r in rows:  # bytes this rank writes to its peers (LL words carry 4 payload bytes in 8)
        r["link_bytes"] = int(nbytes * per_alg[alg[r["impl"]]])
    return rows


def sweep_norm(b, H: int, T: int) -> list[dict]:
    """Check and time fused_norm.launch.candidate_configs for [T, H] bf16, and ar_auto."""
    from sparkinfer.comm.fused_norm.launch import candidate_configs

    torch, comm = b.torch, b.comm
    (x, res, w), (load, reference) = norm_inputs(b, H, T)
    o, r, s1 = (torch.empty(T, H, dtype=torch.bfloat16, device=b.dev) for _ in range(3))
    cands = candidate_configs(comm.caps, T, H, 2, ll_max_bytes=comm.pool.layout.ll_lane_bytes // 2)
    call = lambda a, c: comm.all_reduce_add_rms_norm(x, res, w, EPS, out=o, residual_out=r, algorithm=a, config=c)  # noqa: E731
    impls = {name: (lambda a=alg, c=cfg: call(a, c)) for name, (alg, cfg) in cands.items()}
    impls["ar_auto"] = lambda: (comm.all_reduce(x, s1),)
    rows = run_config(b, dict(op="fused_norm_sweep", H=H, T=T, dtype="bfloat16", nbytes=T * H * 2), impls, load,
                      reference, {**{name: 4 for name in cands}, "ar_auto": 2, "bitwise": tuple(impls)})
    for row in (row for row in rows if row["impl"] in cands):
        row.update(algorithm=cands[row["impl"]][0], **dataclasses.asdict(cands[row["impl"]][1]))
    return rows


def _correct_partial(o, lse_all, rank: int):
    """The composition's one fused correction: this rank's o [T, H, D] scaled by
    exp(lse_r - lse) (0 for an empty shard, whose o may be NaN), and the merged
    lse [T, H] fp32, from every rank's lse_all [W, T, H]. Pure torch; compiled
    once per shape by torch.compile on GPUs (one generated kernel)."""
    import torch

    m = lse_all.amax(dim=0)
    m_ref = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    den = torch.exp(lse_all - m_ref).sum(dim=0)
    full = den > 0
    scale = torch.where(full, torch.exp(lse_all[rank] - m_ref) / torch.where(full, den, torch.ones_like(den)),
                        torch.zeros_like(den))
    o_c = torch.where(scale[..., None] > 0, o.float() * scale[..., None], torch.zeros((), device=o.device))
    lse_new = torch.where(full, m + torch.log(torch.where(full, den, torch.ones_like(den))),
                          torch.full_like(den, float("-inf")))
    return o_c.to(o.dtype), lse_new


_COMPILED: dict = {}


def ag_correct_rs(b, o, lse, scatter: bool, out, lse_out):
    """The strongest torch composition of dcp_merge (what serving engines run):
    all-gather of the lse only, one fused correction kernel (torch.compile on
    GPUs), then a reduce-scatter of the corrected outputs over heads (scatter) or
    an all-reduce (every head). Writes out [T, Hs, D] (o's dtype) and lse_out
    [T, Hs] fp32; returns (out, lse_out). Graph-capturable once warmed up. Its
    sum is of bf16 corrected partials (two roundings), the kernel's of fp32."""
    import torch
    import torch.distributed as dist

    comm, W, rank = b.comm, b.comm.world_size, b.comm.rank
    T, H, D = o.shape
    Hs = H // W if scatter else H
    group = comm.context.torch_group()
    key = (T, H, D, scatter)
    if key not in _COMPILED:
        _COMPILED[key] = (_compiled(b, _correct_partial), torch.empty(W * T * H, dtype=torch.float32, device=b.dev))
    correct, lse_all = _COMPILED[key]
    dist.all_gather_into_tensor(lse_all, lse.contiguous().view(-1), group=group)
    o_c, lse_new = correct(o, lse_all.view(W, T, H), rank)
    heads = slice(rank * Hs, (rank + 1) * Hs)
    if scatter and b.cuda:  # rank q's block of the input holds heads q*Hs:(q+1)*Hs
        send = o_c.view(T, W, Hs, D).transpose(0, 1).contiguous()
        dist.reduce_scatter_tensor(out.view(-1), send.view(-1), group=group)
    else:  # every head (or a CPU dry run: gloo has no reduce-scatter; all-reduce, keep this rank's heads)
        dist.all_reduce(o_c, group=group)
        out.copy_(o_c[:, heads] if scatter else o_c)
    lse_out.copy_(lse_new[:, heads] if scatter else lse_new)
    return out, lse_out


def _compiled(b, fn):
    """fn compiled once per shape on GPUs (torch.compile, no graph breaks), as is on
    CPU dry runs; dynamo's per-function recompile limit (8) lifted for the sweep's
    108 shapes, else later shapes would run eagerly."""
    import torch

    if not b.cuda:
        return fn
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 1024))
    return torch.compile(fn, dynamic=False, fullgraph=True)


def ag_compiled_merge(b, o, lse, scatter: bool, out, lse_out):
    """dcp_nccl with its merge compiled: all-gather of o and lse through NCCL into
    preallocated buffers, then `merge_partials` as one torch.compile'd function.
    Writes out [T, Hs, D] and lse_out [T, Hs]; returns them."""
    import torch
    import torch.distributed as dist

    from sparkinfer.comm.dcp.reference import merge_partials

    comm, W, rank = b.comm, b.comm.world_size, b.comm.rank
    T, H, D = o.shape
    Hs = H // W if scatter else H
    group = comm.context.torch_group()
    key = ("merge", T, H, D, scatter)
    if key not in _COMPILED:
        def merge(o_all, l_all):
            heads = slice(rank * Hs, (rank + 1) * Hs) if scatter else slice(None)
            m_o, m_l = merge_partials(o_all[:, :, heads], l_all[:, :, heads])
            return m_o.to(o_all.dtype), m_l
        _COMPILED[key] = (_compiled(b, merge), torch.empty(W * T * H * D, dtype=o.dtype, device=b.dev),
                          torch.empty(W * T * H, dtype=torch.float32, device=b.dev))
    merge, o_all, l_all = _COMPILED[key]
    dist.all_gather_into_tensor(o_all, o.contiguous().view(-1), group=group)
    dist.all_gather_into_tensor(l_all, lse.contiguous().view(-1), group=group)
    m_o, m_l = merge(o_all.view(W, T, H, D), l_all.view(W, T, H))
    out.copy_(m_o)
    lse_out.copy_(m_l)
    return out, lse_out


def bench_dcp(b, H: int, D: int, T: int, scatter: bool) -> list[dict]:
    torch, comm, W, dev = b.torch, b.comm, b.comm.world_size, b.dev
    from sparkinfer.comm.dcp.reference import merge_partials

    o = torch.empty(T, H, D, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(T, H, dtype=torch.float32, device=dev)
    Hs = H // W if scatter else H
    o_out = torch.empty(T, Hs, D, dtype=torch.bfloat16, device=dev)
    l_out = torch.empty(T, Hs, dtype=torch.float32, device=dev)
    state = {}

    def load(seed):
        g = torch.Generator(device=dev).manual_seed(1000 * seed + T * 7 + H * 3 + D)
        os_ = torch.randn(W, T, H, D, generator=g, device=dev).bfloat16()
        ls = torch.randn(W, T, H, generator=g, device=dev) * 4 + 10
        gone = torch.rand(W, T, H, generator=g, device=dev) < 0.25  # empty shards: lse -inf, o NaN
        ls[gone] = float("-inf")
        os_[gone] = float("nan")
        o.copy_(os_[comm.rank])
        lse.copy_(ls[comm.rank])
        heads = slice(comm.rank * Hs, (comm.rank + 1) * Hs) if scatter else slice(None)
        ref_o, ref_l = merge_partials(os_[:, :, heads], ls[:, :, heads])
        state["ref"] = (ref_o.bfloat16(), ref_l)

    kw = dict(scatter_heads=scatter, return_lse=True)
    o_ag = torch.empty(T, Hs, D, dtype=torch.bfloat16, device=dev)
    l_ag = torch.empty(T, Hs, dtype=torch.float32, device=dev)
    o_cm, l_cm = torch.empty_like(o_ag), torch.empty_like(l_ag)
    impls = {
        "dcp_kernel": lambda: comm.dcp_merge(o, lse, out=o_out, lse_out=l_out, **kw),
        "dcp_nccl": lambda: comm.dcp_merge(o, lse, algorithm="nccl", **kw),
        "dcp_ag_rs": lambda: ag_correct_rs(b, o, lse, scatter, o_ag, l_ag),
        "dcp_nccl_compiled": lambda: ag_compiled_merge(b, o, lse, scatter, o_cm, l_cm),
    }
    if b.shared:
        impls = {"dcp_kernel": impls["dcp_kernel"]}
    # dcp_ag_rs sums bf16-rounded corrected partials and rounds the sum (one
    # more rounding each way than the fp32 merges): 8 eps
    tol = {"dcp_kernel": 4, "dcp_nccl": 4, "dcp_nccl_compiled": 4, "dcp_ag_rs": 8,
           "bitwise": ("dcp_kernel",) if not scatter else ()}
    base = dict(op="dcp_merge", H=H, D=D, T=T, scatter=scatter, dtype="bfloat16")
    rows = run_config(b, base, impls, load, lambda name: state["ref"], tol)
    per_row = D * 2 + 4
    for r in rows:
        if r["impl"] == "dcp_ag_rs":  # lse gather + outputs reduce-scattered (all-reduced: twice) in bf16
            r["link_bytes"] = (W - 1) * T * H * 4 + (W - 1) * T * H * D * 2 // W * (1 if scatter else 2)
            continue
        sent = Hs if r["impl"] == "dcp_kernel" else H  # the gathers move every head
        r["link_bytes"] = (W - 1) * T * sent * per_row
    return rows
