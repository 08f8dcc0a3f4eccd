import os

# One BLAS thread (set before numpy loads OpenBLAS): interpreted dots are small matmuls, and
# OpenBLAS's threads spinning beside the other worker and the ranks made them 3x slower here
# (runtime/ranks.py does the same for CPU ranks).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402

from sparkinfer.runtime import interpreter  # noqa: E402

# CPU ranks and in-process kernels run through the Triton interpreter; the
# launcher sets this for its children, and this covers in-process tests.
os.environ.setdefault("TRITON_INTERPRET", "1")
# interpreted dots whose bits do not follow the host's BLAS, and cheaper helper calls (CPU ranks do the same)
interpreter.install()


@pytest.hookimpl(tryfirst=True)  # before xdist's worker hook reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """Tests marked slow (runs of several interpreted ranks, 20-130 s each) go first
    and, under `-n 2 --dist loadgroup`, all to one worker, one after another, while
    the other worker takes the rest: two such runs side by side put four or more
    spinning ranks on two cores. The whole suite on this 2-core machine, pytest's
    own time: 1,415 s with `-n 2` alone (a fresh-clone CI run), 1,343 s with this
    grouping; 2,469 s as the suite grew, 1,316 s after the interpreter's front-end
    costs were cut (runtime/interpreter.py)."""
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.xdist_group("ranks"))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
