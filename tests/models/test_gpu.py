"""Whole models on a GPU: the compiled kernels and CUDA-graph decode steps against
transformers, speculative decoding with graphs on the "target" and "draft" channels,
and two ranks sharing one GPU (`cuda_shared`, start MPS first for speed).

Skipped without CUDA. The interleaved-replay test runs SPARKINFER_REPLAYS pairs
(default 10,000) of target and draft graph replays with new inputs.
"""

import os

import pytest
import torch

from sparkinfer.engine import SamplingParams
from sparkinfer.engine.session import GenerateRequest, ModelSession, generate_on_rank
from sparkinfer.models.hf_reference import compare, transformers_greedy
from sparkinfer.models.presets import make_checkpoint
from sparkinfer.runtime import run_ranks
from tests.models.test_generation import NEW, PROMPTS, SEEDS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for fam, seed in SEEDS.items():
        path = make_checkpoint(fam, tmp_path_factory.mktemp(fam), seed=seed)
        out[fam] = (path, transformers_greedy(path, PROMPTS, NEW))
    return out


def _graphs_vs_eager(world, path, fmt):
    params = SamplingParams(max_new_tokens=NEW)
    outs = []
    for graphs in (True, False):
        s = ModelSession(world, GenerateRequest(str(path), PROMPTS, params, moe_format=fmt, graphs=graphs,
                                                max_len=32, self_draft=1, spec_k=3))
        try:
            plain = s.engine.generate(PROMPTS, params, keep_logits=True)
            spec = s.speculative.generate(PROMPTS, params)
            outs.append((plain.tokens, plain.logits, spec.tokens))
        finally:
            s.close()
    return outs


@pytest.mark.parametrize("family", list(SEEDS))
def test_gpu_graphs_match_transformers_and_eager(checkpoints, family):
    path, ref = checkpoints[family]
    (g_tok, g_log, g_spec), (e_tok, e_log, e_spec) = run_ranks(_graphs_vs_eager, 1, backend="cuda",
                                                               args=(path, "bf16"), timeout_s=600)[0]
    assert compare(ref, g_tok, g_log) == []
    assert g_tok == e_tok and all(torch.equal(a, b) for a, b in zip(g_log, e_log)), "graph replay != eager"
    assert g_spec == g_tok and e_spec == e_tok, "speculative != plain greedy"


@pytest.mark.parametrize("world,dcp", [(2, 1), (2, 2)], ids=["tp2", "tp2_dcp2"])
def test_gpu_two_ranks_on_one_gpu(checkpoints, world, dcp):
    path, ref = checkpoints["qwen3_moe-tiny"]
    req = GenerateRequest(str(path), PROMPTS, SamplingParams(max_new_tokens=NEW), dcp=dcp, keep_logits=True,
                          max_len=32)
    results = run_ranks(generate_on_rank, world, backend="cuda_shared", args=(req,), timeout_s=600)
    assert compare(ref, results[0].tokens, results[0].logits) == []
    assert all(r.tokens == results[0].tokens for r in results)
    assert all(torch.equal(a, b) for r in results for a, b in zip(r.logits, results[0].logits))


def _interleaved(world, path, pairs):
    """Target and draft decode graphs replayed alternately with new inputs; every
    100th pair is recomputed eagerly and must match bitwise. Returns (pairs, mismatches)."""
    params = SamplingParams(max_new_tokens=NEW)
    s = ModelSession(world, GenerateRequest(str(path), PROMPTS, params, max_len=32, self_draft=1, spec_k=3))
    try:
        for i, p in enumerate(PROMPTS):
            s.engine.prefill(p, i)
            s.speculative.draft.prefill(p, i)
        gen = torch.Generator().manual_seed(0)
        vocab = s.decoder.spec.vocab_size
        bad = 0
        for n in range(pairs):
            for eng in (s.engine, s.speculative.draft):
                toks = torch.randint(0, vocab, (2,), generator=gen).tolist()
                pos = torch.randint(6, 24, (2,), generator=gen).tolist()
                logits, _ = eng.step([[t] for t in toks], pos, [0, 1], params)
                if n % 100 == 0:
                    got = logits.clone()
                    bufs, _ = eng._graph_step(eng.bucket(2), 1, params)
                    bad += not torch.equal(got, eng.dec(bufs.step)[:2])
        return pairs, bad
    finally:
        s.close()


def test_gpu_target_and_draft_graphs_interleaved(checkpoints):
    path, _ = checkpoints["glm4_moe-tiny"]
    pairs = int(os.environ.get("SPARKINFER_REPLAYS", "10000"))
    done, bad = run_ranks(_interleaved, 1, backend="cuda", args=(path, pairs), timeout_s=900)[0]
    assert done == pairs and bad == 0


def test_gpu_speculative_on_two_channels_two_ranks(checkpoints):
    path, _ = checkpoints["mixtral-tiny"]

    def tokens(k):
        req = GenerateRequest(str(path), PROMPTS, SamplingParams(max_new_tokens=NEW), max_len=32,
                              self_draft=1 if k else 0, spec_k=k or 1)
        return run_ranks(generate_on_rank, 2, backend="cuda_shared", args=(req,), timeout_s=600)

    plain, spec = tokens(0), tokens(3)
    assert plain[0].tokens == spec[0].tokens == spec[1].tokens


def _failed_capture(world, path):
    """Capture a decode step that raises midway; the pool must hold exactly the channels it
    held before, and the next capture must work."""
    params = SamplingParams(max_new_tokens=NEW)
    s = ModelSession(world, GenerateRequest(str(path), PROMPTS, params, max_len=32))
    try:
        before = list(s.comm.pool.channel_ids)
        real = s.decoder.__call__

        def broken(step):
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("injected failure inside the capture")
            return real(step)
        s.decoder.__class__ = type("Broken", (type(s.decoder),), {"__call__": lambda self, st: broken(st)})
        try:
            s.engine.generate(PROMPTS, params)
            raised = False
        except RuntimeError as e:
            raised = "injected" in str(e)
        after = list(s.comm.pool.channel_ids)
        s.decoder.__class__ = type(s.decoder).__mro__[1]
        s.engine._steps.clear()
        tokens = s.engine.generate(PROMPTS, params).tokens
        return raised, before, after, tokens
    finally:
        s.close()


def test_gpu_failed_capture_leaves_no_channel_and_recovers(checkpoints):
    path, ref = checkpoints["qwen3_moe-tiny"]
    results = run_ranks(_failed_capture, 2, backend="cuda_shared", args=(path,), timeout_s=600)
    for raised, before, after, tokens in results:
        assert raised and before == after
        assert tokens == ref.tokens
