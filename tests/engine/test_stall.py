"""How long a serving rank may stall: a GPU's 60 s, CPU ranks' 300 s (interpreted steps
are slow; a tiny demo's 16-token-chunk prefill on a loaded 2-core host outlasted 60 s),
and their collectives' deadline as `generate` gives it, unless the user set either."""

from sparkinfer import envs
from sparkinfer.engine.config import GPU_STALL_S, EngineConfig


def test_a_rank_may_stall_longer_on_the_cpu_unless_the_user_said(monkeypatch):
    assert EngineConfig(model="m").stall_s("cuda") == GPU_STALL_S == 60.0
    assert EngineConfig(model="m").stall_s("cuda_shared") == 60.0
    assert EngineConfig(model="m").stall_s("cpu") == envs.CPU_TIMEOUT_S == 300
    assert EngineConfig(model="m", timeout_s=5.0).stall_s("cpu") == 5.0
    monkeypatch.delenv("SPARKINFER_TIMEOUT_S", raising=False)
    assert envs.cpu_rank_env("cpu") == {"SPARKINFER_TIMEOUT_S": "300"} and envs.cpu_rank_env("cuda") == {}
    monkeypatch.setenv("SPARKINFER_TIMEOUT_S", "7")
    assert envs.cpu_rank_env("cpu") == {}
