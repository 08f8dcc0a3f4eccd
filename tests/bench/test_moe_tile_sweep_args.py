"""benchmarks/sweeps/moe_tile_sweep.py: --tiles names outside tuning's tile tables, unknown
shapes and formats are refused before anything runs (an unknown tile name used to time the
planned config alone, silently; an unknown shape raised a KeyError after the device checks)."""

import os

import pytest

from tests.bench._util import sweep_script


def _tool():
    return sweep_script("moe_tile_sweep")


def test_tile_names_are_checked_before_any_run(capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", ""))  # --dry-run sets it
    sweep = _tool()
    args = sweep.parse_args(["--tiles", "n128-bn2-256,bm128-rescale-fc2-bm64", "--dry-run"])
    assert args.tiles == "n128-bn2-256,bm128-rescale-fc2-bm64"
    assert sweep.parse_args(["--tiles", "none", "--dry-run"]).tiles == "none"
    with pytest.raises(SystemExit) as e:
        sweep.parse_args(["--tiles", "n128,dequant,nvfp4-kernel", "--dry-run"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--tiles dequant,nvfp4-kernel: not in tuning's tile tables" in err and "bench moe --sweep" in err


@pytest.mark.parametrize("argv, what", [(["--shapes", "qwen3,qwen4"], "--shapes qwen3,qwen4: choose from"),
                                        (["--formats", "bf16,fp4"], "--formats bf16,fp4: choose from")])
def test_shapes_and_formats_are_checked_before_any_run(capsys, argv, what):
    with pytest.raises(SystemExit):
        _tool().parse_args(argv)
    assert what in capsys.readouterr().err
