"""SPARKINFER_FLAGS (`sparkinfer.envs`): parsed, checked before anything is set, applied once
a process, and refused in one line by the command line when it names no flag."""

import os
import subprocess
import sys

import pytest

from sparkinfer import envs
from sparkinfer.errors import SetupError

PROBE = 0  # a flag for the tests below


def test_parse_and_check():
    assert envs.parse_flags("") == {}
    assert envs.parse_flags("a.b.C=4, a.b.D=True,a.b.E=ptx,") == {"a.b.C": 4, "a.b.D": True, "a.b.E": "ptx"}
    for bad in ("novalue", "NAME=1", ".X=1"):
        with pytest.raises(SetupError, match="module.path.NAME=value"):
            envs.parse_flags(bad)
    assert envs.check_flags("tests.test_flags_env.PROBE=3") == {"tests.test_flags_env.PROBE": 3}
    assert PROBE == 0  # checked, not set
    with pytest.raises(SetupError, match="has no flag 'NOPE'"):
        envs.check_flags("tests.test_flags_env.NOPE=1")
    with pytest.raises(SetupError, match="does not import"):
        envs.check_flags("tests.nowhere.X=1")


def test_apply_sets_the_flags_once(monkeypatch):
    monkeypatch.setattr(envs, "_FLAGS_APPLIED", [])
    monkeypatch.setenv("SPARKINFER_FLAGS", "tests.test_flags_env.PROBE=5")
    try:
        assert envs.apply_flags() == {"tests.test_flags_env.PROBE": 5} and PROBE == 5
        globals()["PROBE"] = 1
        envs.apply_flags()  # the same text again: already applied in this process
        assert PROBE == 1
    finally:
        globals()["PROBE"] = 0


def test_the_command_line_refuses_an_unknown_flag_in_one_line():
    env = dict(os.environ, SPARKINFER_FLAGS="sparkinfer.engine.engine.NO_SUCH_FLAG=1")
    res = subprocess.run([sys.executable, "-m", "sparkinfer.cli", "info"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip() == ("sparkinfer info: SetupError: SPARKINFER_FLAGS "
                                  "sparkinfer.engine.engine.NO_SUCH_FLAG: sparkinfer.engine.engine has no flag "
                                  "'NO_SUCH_FLAG'")
