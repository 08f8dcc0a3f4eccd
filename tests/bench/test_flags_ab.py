"""benchmarks/sweeps/flags_ab.py: variants parsed and checked before any run, runs
interleaved round by round, rows tagged, medians per row key; end to end, each variant's
settings reach its own run (a setting that breaks the benchmark fails that run alone)."""

import json

import pytest

from tests.bench._util import ROOT, sweep_script

PROBE = 0  # a flag for the tests below


def _tool():
    return sweep_script("flags_ab")


def test_variants_parse_and_unknown_settings_fail_before_any_run():
    ab = _tool()
    assert ab.parse_variant("off:") == ("off", "")
    assert ab.parse_variant("on:tests.bench.test_flags_ab.PROBE=4") == ("on", "tests.bench.test_flags_ab.PROBE=4")
    assert PROBE == 0  # checked, not set
    for bad in ("nocolon", ":x.y=1", "v:novalue", "v:tests.bench.test_flags_ab.NOPE=1", "v:tests.nowhere.X=1"):
        with pytest.raises(SystemExit):
            ab.parse_variant(bad)


def test_rounds_interleave_the_variants_and_tag_their_rows():
    from sparkinfer import envs

    ab = _tool()
    order = []

    def runner(flags, argv):  # one run: rows whose metric shows the variant's flag
        probe = envs.parse_flags(flags).get(f"{__name__}.PROBE", 0)
        order.append(probe)
        out = argv[argv.index("--out") + 1]
        rows = [dict(preset="p", batch=b, us_per_step=100.0 * b + probe + len(order)) for b in (1, 8)]
        with open(out, "w") as f:
            json.dump(rows, f)
        return 0

    variants = [("off", ""), ("on", f"{__name__}.PROBE=50")]
    rows, failed = ab.run_ab(variants, 2, ["bench", "x"], runner=runner)
    assert not failed and order == [0, 50, 0, 50]  # round by round, each variant once
    assert [(r["variant"], r["ab_round"], r["batch"]) for r in rows] == [
        ("off", 1, 1), ("off", 1, 8), ("on", 1, 1), ("on", 1, 8), ("off", 2, 1), ("off", 2, 8), ("on", 2, 1),
        ("on", 2, 8)]
    med = {(dict(key)["batch"], name): m for key, name, m, _ in ab.medians(rows, "us_per_step")}
    assert med == {(1, "off"): 102.0, (1, "on"): 153.0, (8, "off"): 802.0, (8, "on"): 853.0}


def test_a_stopped_sweep_keeps_every_run_it_finished(tmp_path):
    """The suite's time limit kills a sweep part way: --out already holds each finished run."""
    ab = _tool()
    out = tmp_path / "ab.json"
    runs = []

    def runner(flags, argv):
        if len(runs) == 3:
            raise KeyboardInterrupt  # the kill, during the fourth run
        runs.append(flags)
        with open(argv[argv.index("--out") + 1], "w") as f:
            json.dump([dict(preset="p", batch=1, us_per_step=10.0 + len(runs))], f)
        return 0

    with pytest.raises(KeyboardInterrupt):
        ab.run_ab([("a", ""), ("b", f"{__name__}.PROBE=1")], 2, ["bench", "x"], runner=runner, out=str(out))
    rows = json.loads(out.read_text())
    assert [(r["variant"], r["ab_round"], r["us_per_step"]) for r in rows] == [("a", 1, 11.0), ("b", 1, 12.0),
                                                                                ("a", 2, 13.0)]
    assert not (tmp_path / "ab.json.part").exists()


def test_each_variant_reaches_its_own_run(tmp_path, monkeypatch, capsys):
    """`bench scheduler --dry-run` (CPU, seconds) under the defaults, with a harmless flag
    (its rows record it) and with its timing function replaced by a number (its run fails)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("SPARKINFER_FLAGS", raising=False)
    out = tmp_path / "ab.json"
    status = _tool().main(["--variant", "plain:", "--variant", "rows8:sparkinfer.engine.engine.MIXED_ROWS=8",
                           "--variant", "broken:sparkinfer.bench.scheduler.loop_us=0",
                           "--rounds", "1", "--out", str(out), "--", "bench", "scheduler", "--dry-run"])
    rows = json.loads(out.read_text())
    assert status == 1  # a run failed
    assert {r["variant"] for r in rows} == {"plain", "rows8"} and all(r["ab_status"] == 0 for r in rows)
    assert {r.get("flags") for r in rows if r["variant"] == "rows8"} == {"sparkinfer.engine.engine.MIXED_ROWS=8"}
    assert not any("flags" in r for r in rows if r["variant"] == "plain")
    assert "broken in round 1 exited 1 with 0 rows" in capsys.readouterr().out
