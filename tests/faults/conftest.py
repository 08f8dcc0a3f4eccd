"""Fixtures shared by the fault suite's files."""

import pytest

NONFINITE_TABLES = ("tests.faults.test_nonfinite", "tests.faults.test_nonfinite_norm_dcp")


@pytest.fixture(scope="session")
def nonfinite_outcomes():
    """Both non-finite case tables in one launch of two CPU ranks (a launch costs seconds
    of start-up): [{case id: (problems, hashes of the replicated outputs)}] in rank order."""
    from sparkinfer.runtime import run_ranks
    from tests.faults._util import run_case_table

    return run_ranks(run_case_table, 2, backend="cpu", args=(NONFINITE_TABLES,), timeout_s=300)
