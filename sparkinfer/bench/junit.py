"""GPU test logs as evidence: pytest's JUnit XML -> JSON rows under benchmarks/results/.

Run the GPU test files with JUnit XML, then convert on the same machine (the
rows take the GPU, driver, versions and commit from the machine that converts):

    pytest tests/moe/test_gpu.py tests/attention/test_gpu.py -rA --junitxml=gpu_tests.xml
    sparkinfer bench summarize --junit gpu_tests.xml     # -> benchmarks/results/gpu_tests_<machine>.json

One row per test case: kind "test", test_id (`path::name[params]`, as pytest
prints it), outcome (passed / failed / error / skipped), seconds and, when not
passed, the first 400 characters of the message; then one kind "summary" row
with the counts. A test case with no name is the test a timeout interrupted
(pytest writes an empty one): an error row, test_id "(interrupted)", never a pass.
`sparkinfer bench summarize` never tabulates these files.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from sparkinfer.bench import common

__all__ = ["junit_rows", "convert"]


def _test_id(case: ET.Element) -> str:
    """pytest's node id from a JUnit testcase: classname "tests.moe.test_gpu" (or
    "tests.moe.test_gpu.TestX") and name "test_y[p]" -> "tests/moe/test_gpu.py::test_y[p]"."""
    parts, name = case.get("classname", "").split("."), case.get("name", "")
    # the module is the last dotted part that starts with "test" and is not a class
    i = max((k for k, p in enumerate(parts) if p.startswith("test")), default=len(parts) - 1)
    if i > 0 and parts[i][:1].isupper():
        i -= 1
    path = "/".join(parts[:i + 1]) + ".py"
    return "::".join([path, *parts[i + 1:], name])


def junit_rows(path: str | Path) -> list[dict]:
    """Rows of a pytest JUnit XML file (see the module docstring)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    rows, counts = [], {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for suite in suites:
        for case in suite.iter("testcase"):
            outcome, message = "passed", None
            unnamed = not case.get("name")
            if unnamed:
                outcome, message = "error", "an unnamed test case: the run was interrupted during a test"
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome = {"failure": "failed"}.get(tag, tag)
                    message = (el.get("message") or el.text or "")[:400]
                    break
            counts[outcome] += 1
            row = dict(kind="test", test_id="(interrupted)" if unnamed else _test_id(case), outcome=outcome,
                       seconds=float(case.get("time", 0) or 0))
            if message:
                row["message"] = message
            rows.append(row)
    s = suites[0] if suites else root
    rows.append(dict(kind="summary", junit_file=Path(path).name, junit_timestamp=s.get("timestamp"),
                     junit_hostname=s.get("hostname"), tests=len(rows), **counts,
                     ok=counts["failed"] == 0 and counts["error"] == 0))
    return rows


def convert(junit: str | Path, out: str | Path | None = None, args=None) -> tuple[Path, dict]:
    """Append `junit`'s rows, with this machine's provenance (GPU, driver,
    versions, commit, date, command), to `out` (default
    benchmarks/results/gpu_tests_<machine>.json). Returns (path, summary row)."""
    meta = common.metadata(args)
    rows = junit_rows(junit)
    label = common.machine_label(meta, int(meta.get("gpu_count") or 1))
    path = Path(out) if out else common.RESULTS_DIR / f"gpu_tests_{label}.json"
    return common.append_rows(path, rows, meta), rows[-1]
