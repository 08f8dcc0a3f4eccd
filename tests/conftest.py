import os
import sys

# One BLAS thread (set before numpy loads OpenBLAS): interpreted dots are small matmuls, and
# OpenBLAS's threads spinning beside the other worker and the ranks made them 3x slower here
# (runtime/ranks.py does the same for CPU ranks).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from sparkinfer.runtime import interpreter  # noqa: E402

# Property tests draw the same examples on every run, so a CI run is red only for a change,
# never for a draw (a flaky test is a defect); SPARKINFER_HYPOTHESIS=explore draws fresh ones.
settings.register_profile("fixed", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile(os.environ.get("SPARKINFER_HYPOTHESIS", "fixed"))

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
    costs were cut (runtime/interpreter.py). Under pytest 9 no group reached xdist
    (pyproject.toml's pin says why): 1,344 and 1,396 s at 7793703 and 68564df; with the
    groups working again and a module's tests grouped where they share a module
    fixture, 1,304 s (550ee3e)."""
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.xdist_group("ranks"))
        elif _module_fixture(item):
            # a module's tests on one worker, so its module fixtures (ranks running every
            # case, a subprocess compiling every case for sm_90) run once, not on both
            # workers: at d1549b0 the MoE sm_90 compile took 55 s, the fused norm's ranks
            # 42 s and the DCP merge's 35 s on each of the two
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def _module_fixture(item) -> bool:
    """Whether the test uses a fixture of module scope (its own module's or a conftest's)."""
    defs = getattr(item, "_fixtureinfo", None)
    return defs is not None and any(d.scope == "module" for ds in defs.name2fixturedefs.values() for d in ds)


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory():
    """After each test, hand the caching allocator's unused GPU blocks back: the GPU test
    files run as 4 xdist workers on one GPU, and on an 80 GB H100 four DeepSeek-V3 fp8_block
    cases ran out of memory asking 7 GiB (their worker held 15.2 GiB, 10.7 of it live
    tensors, the other three 18.5-23.1 GiB; gpu_tests_h100.json at 83ee40a; they passed
    alone). Whether this is enough there is not yet measured; on the CPU it does nothing."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
