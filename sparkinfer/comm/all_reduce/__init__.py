"""All-reduce: one-shot and two-shot Triton kernels, NCCL beyond them."""
