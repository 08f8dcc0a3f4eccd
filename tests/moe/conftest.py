import os

# MoE kernels run through the Triton interpreter on CPU CI (tests/conftest.py
# sets the same; this keeps `pytest tests/moe` alone working too).
os.environ.setdefault("TRITON_INTERPRET", "1")
