"""Stress the fused all-reduce + residual + RMSNorm graph test in one launch
(not collected by pytest): the ops of test_fused_norm's graph test (GRAPH_CASES)
run many times on fresh inputs, alternating eager calls and replays of one
captured graph, each result checked against the fp32 reference; the first
failures are reported with what was wrong (element counts, rows, NaN poison
left, values), and the ranks' result digests are compared.

    python -m tests.comm.stress_fused_graph [ITERS] [BUDGET_S] [--cpu]
        [--same [--jitter] | --fresh [--reload] [--with-dcp]]

Prints one JSON line: iterations run per rank, failures, rank digest mismatches.
--same: every iteration runs one input twice eagerly and twice as a replay and
compares the four results bitwise (the graph test's eager == replay check, which
the default mode cannot make); --jitter: rank 1 sleeps a random 0-300 us before
some eager ops, so that the ranks arrive skewed. --fresh: the test's own sequence
(graph_steps) per iteration on a new Communicator and new buffers; --reload:
with the kernels loaded again each time; --with-dcp: after test_dcp's graph
sequence each time (the 2-GPU suite's order).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import torch


def _check(out, ref, ulps, what):
    from tests.comm.test_fused_norm import assert_close_ulps

    try:
        assert_close_ulps(out, ref, ulps, what)
        return None
    except AssertionError as e:
        a, r = out.float(), ref.float()
        nan = ~torch.isfinite(a)
        bad = ((a - r).abs() > ulps * torch.finfo(out.dtype).eps * (r.abs() + 1e-3)) | nan
        rows = sorted({int(i) for i in bad.nonzero()[:, 0].tolist()})
        cols = bad.nonzero()[:, -1]
        return dict(what=what, msg=str(e)[:300], bad=int(bad.sum()), nan=int(nan.sum()),
                    numel=bad.numel(), rows=rows[:16],
                    col_lo=int(cols.min()), col_hi=int(cols.max()),
                    sample=[(float(x), float(y)) for x, y in zip(a[bad][:4], r[bad][:4])])


def _same_worker(world, iters: int, seed0: int, budget_s: float, jitter: bool):
    """--same: eager, eager, replay, replay on one input per iteration, compared bitwise."""
    import random

    from sparkinfer.comm import Communicator
    from sparkinfer.comm.fused_norm.reference import all_reduce_add_rms_norm_reference
    from tests.comm.graphs import Captured, bits_diff, worst_ulps
    from tests.comm.test_fused_norm import CAP, EPS, graph_ops, make_inputs

    comm = Communicator(capacity_bytes=CAP, timeout_s=10, channel_ids=("g",))
    W, rank, dev = world.world_size, world.rank, comm.device
    bufs, load, run = graph_ops(comm, world)
    rng = random.Random(rank)

    def run_jittered():
        for c, x, res, w, o, r in bufs:
            if jitter and rank == 1 and rng.random() < 0.5:
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                time.sleep(rng.random() * 3e-4)
            comm.all_reduce_add_rms_norm(x, res, w, EPS, out=o, residual_out=r, algorithm=c.algorithm)

    load(seed0)
    run()
    g = Captured(comm, run, "g")
    import torch.distributed as dist

    diffs, counts, t0, done = [], {}, time.time(), 0
    for it in range(iters):
        if it % 16 == 0:
            over = torch.tensor([float(time.time() - t0 > budget_s)], device=dev)
            dist.all_reduce(over, op=dist.ReduceOp.MAX)
            if over.item() > 0:
                break
        s = seed0 + 1 + it
        snaps = []
        for step in ("eager", "eager", "replay", "replay"):
            load(s)
            run_jittered() if step == "eager" else g.replay()
            snaps.append([(o.cpu(), r.cpu()) for c, x, res, w, o, r in bufs])
            comm.synchronize()  # a recorded error (a timeout) raises, typed
        for i, (c, *_rest) in enumerate(bufs):
            for (a, b), pair in (((0, 1), "eager/eager"), ((2, 3), "replay/replay"), ((0, 2), "eager/replay")):
                for k, name in ((0, "out"), (1, "residual_out")):
                    d = bits_diff(snaps[a][i][k], snaps[b][i][k], name)
                    if d is None:
                        continue
                    counts[f"{c.id} {pair} {name}"] = counts.get(f"{c.id} {pair} {name}", 0) + 1
                    if len(diffs) < 16:
                        ref_out, ref_res = all_reduce_add_rms_norm_reference(*make_inputs(c, W, s), EPS)
                        ref = ref_out if k == 0 else ref_res
                        diffs.append(dict(iter=it, rank=rank, case=c.id, pair=pair, **d,
                                          err_ulps=[worst_ulps(snaps[j][i][k], ref) for j in (a, b)]))
        done += 1
    del g
    comm.close()
    return dict(rank=rank, iters=done, seconds=time.time() - t0, counts=counts, diffs=diffs)


def _fresh_worker(world, iters: int, seed0: int, budget_s: float, reload: bool, with_dcp: bool = False):
    """--fresh: the graph test's whole sequence (graph_steps) per iteration on a new
    Communicator (fresh channels) and new buffers, checked the way the test checks.
    reload: drop Triton's in-process kernel caches first, so every iteration's first
    calls load their kernels again (as a new test process does). with_dcp: run
    test_dcp's graph sequence (its own Communicator) first, as the 2-GPU suite
    does, the only setting in which the test has failed since the rank fix."""
    import torch.distributed as dist

    from sparkinfer.comm import Communicator
    from sparkinfer.comm.fused_norm import kernel as fk
    from tests.comm.graphs import bits_diff, graph_steps
    from tests.comm.test_fused_norm import CAP, graph_ops

    diffs, t0, done = [], time.time(), 0
    for it in range(iters):
        over = torch.tensor([float(time.time() - t0 > budget_s)], device="cuda" if torch.cuda.is_available() else "cpu")
        dist.all_reduce(over, op=dist.ReduceOp.MAX)
        if over.item() > 0:
            break
        if with_dcp:
            from tests.comm.test_dcp import _graph_worker as dcp_sequence

            dcp_sequence(world, seed0 + it)
        if reload:
            for k in (fk.all_reduce_add_rms_norm_kernel, fk.all_reduce_add_rms_norm_ll_kernel):
                getattr(k, "device_caches", {}).clear()  # (interpreted kernels keep none)
        comm = Communicator(capacity_bytes=CAP, timeout_s=10, channel_ids=("g",))
        bufs, load, run = graph_ops(comm, world)
        res = [(o, r) for c, x, rr, w, o, r in bufs]
        steps = graph_steps(comm, run, load, lambda res=res: [(o.cpu(), r.cpu()) for o, r in res], seed0 + it)
        comm.close()
        for i, (c, *_rest) in enumerate(bufs):
            for k, name in ((0, "out"), (1, "residual_out")):
                d = bits_diff(steps["eager"][i][k], steps["replay"][i][k], name)
                if d is not None and len(diffs) < 16:
                    diffs.append(dict(iter=it, rank=world.rank, case=c.id, seed=seed0 + it, **d))
        done += 1
    return dict(rank=world.rank, iters=done, seconds=time.time() - t0, diffs=diffs)


def _stress_worker(world, iters: int, seed0: int, budget_s: float):
    from sparkinfer.comm import Communicator
    from sparkinfer.comm.fused_norm.reference import all_reduce_add_rms_norm_reference
    from tests.comm.graphs import Captured, pack
    from tests.comm.test_fused_norm import CAP, EPS, GRAPH_CASES, graph_ops, make_inputs

    comm = Communicator(capacity_bytes=CAP, timeout_s=10, channel_ids=("g",))
    W, rank, dev = world.world_size, world.rank, comm.device
    bufs, load, run = graph_ops(comm, world)

    load(seed0)
    run()
    g = Captured(comm, run, "g")
    failures, digests, case_digests, ring = [], [], [], {}
    t0 = time.time()
    done = 0
    import torch.distributed as dist

    for it in range(iters):
        if it % 64 == 0:  # the ranks stop together (a lone extra call would wait for its peer)
            over = torch.tensor([float(time.time() - t0 > budget_s)], device=dev)
            dist.all_reduce(over, op=dist.ReduceOp.MAX)
            if over.item() > 0:
                break
        s = seed0 + 1 + it
        replay = it % 2 == 1
        load(s)
        if replay:
            g.replay()
        else:
            run()
        h = hashlib.sha1()
        per_case = []
        ring[it % 512] = (it, [])
        for c, _x, _res, _w, o, r in bufs:
            out, res_out = o.cpu(), r.cpu()
            h.update(out.view(torch.uint8).numpy().tobytes())
            per_case.append(hashlib.sha1(out.view(torch.uint8).numpy().tobytes()
                                         + res_out.view(torch.uint8).numpy().tobytes()).hexdigest())
            ring[it % 512][1].append((out, res_out))
            ref_out, ref_res = all_reduce_add_rms_norm_reference(*make_inputs(c, W, s), EPS)
            for f in (_check(res_out, ref_res, 2, f"{c.id} residual_out"),
                      _check(out, ref_out, 4, f"{c.id} out")):
                if f is not None and len(failures) < 12:
                    failures.append(dict(iter=it, replay=replay, rank=rank, **f))
        comm.synchronize()
        digests.append(h.hexdigest())
        case_digests.append(per_case)
        done += 1
    del g
    # which (iteration, case) differ between the ranks: keep both ranks' tensors of the first few
    peers = [None] * W
    dist.all_gather_object(peers, (done, case_digests))
    n = min(d for d, _ in peers)
    diff = [(it, i) for it in range(max(0, n - 512), n) for i in range(len(bufs))
            if peers[0][1][it][i] != peers[1][1][it][i]]
    saved = []
    for it, i in diff[:6]:
        if ring[it % 512][0] == it:
            out, res_out = ring[it % 512][1][i]
            saved.append(dict(iter=it, case=GRAPH_CASES[i].id, replay=it % 2 == 1,
                              out=pack(out), res_out=pack(res_out)))
    comm.close()
    return dict(rank=rank, iters=done, failures=failures, digests=digests, seconds=time.time() - t0,
                diff=[(it, GRAPH_CASES[i].id) for it, i in diff], saved=saved)


def main(argv=None) -> int:
    from sparkinfer.runtime import run_ranks

    args = [a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--")]
    iters = int(args[0]) if args else 200
    budget = float(args[1]) if len(args) > 1 else 120.0
    flags = argv if argv is not None else sys.argv[1:]
    backend = "cpu" if "--cpu" in flags else "cuda"
    if "--fresh" in flags:
        reload, with_dcp = "--reload" in flags, "--with-dcp" in flags
        res = run_ranks(_fresh_worker, 2, backend=backend, args=(iters, 9000, budget, reload, with_dcp),
                        timeout_s=budget + 240)
        print(json.dumps(dict(mode="fresh", reload=reload, with_dcp=with_dcp, iters=[r["iters"] for r in res],
                              seconds=[round(r["seconds"], 1) for r in res],
                              diffs=[d for r in res for d in r["diffs"]])))
        return 0 if not any(r["diffs"] for r in res) else 1
    if "--same" in flags:
        res = run_ranks(_same_worker, 2, backend=backend, args=(iters, 5000, budget, "--jitter" in flags),
                     timeout_s=budget + 240)
        print(json.dumps(dict(iters=[r["iters"] for r in res], seconds=[round(r["seconds"], 1) for r in res],
                              jitter="--jitter" in flags, counts=[r["counts"] for r in res],
                              diffs=[d for r in res for d in r["diffs"]])))
        return 0 if not any(r["counts"] for r in res) else 1
    res = run_ranks(_stress_worker, 2, backend=backend, args=(iters, 1000, budget),
                 timeout_s=budget + 240)
    n = min(r["iters"] for r in res)
    differ = [i for i in range(n) if res[0]["digests"][i] != res[1]["digests"][i]]
    print(json.dumps(dict(iters=[r["iters"] for r in res], seconds=[round(r["seconds"], 1) for r in res],
                          failures=[f for r in res for f in r["failures"]],
                          rank_digest_mismatch_iters=differ[:20], case_diff=res[0]["diff"][:60])))
    if "--save" in (argv or sys.argv):
        torch.save([r["saved"] for r in res], "stress_saved.pt" if "OUT" not in os.environ
                   else os.path.join(os.environ["OUT"], "stress_saved.pt"))
    return 0 if not differ and not any(r["failures"] for r in res) else 1


if __name__ == "__main__":
    sys.exit(main())
