"""`sparkinfer info`: library, torch and Triton versions, GPUs and their peer access."""

from __future__ import annotations

__all__ = ["add_parser"]


def info(args) -> int:
    import torch
    import triton

    import sparkinfer

    print(f"sparkinfer {sparkinfer.__version__}, torch {torch.__version__}, triton {triton.__version__}")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"GPUs: {n}")
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        peers = [j for j in range(n) if j != i and torch.cuda.can_device_access_peer(i, j)]
        print(f"  cuda:{i} {p.name} {p.multi_processor_count} SMs, peer access to {peers}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="library, torch, triton and GPU topology")
    p.set_defaults(run=info)
