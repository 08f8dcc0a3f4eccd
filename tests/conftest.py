import os

# CPU ranks and in-process kernels run through the Triton interpreter; the
# launcher sets this for its children, and this covers in-process tests.
os.environ.setdefault("TRITON_INTERPRET", "1")
