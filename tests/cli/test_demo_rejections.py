"""`sparkinfer demo` and `demo-comm` reject what they cannot run with one line
on stderr and exit code 2, never a traceback and never a hang."""

import pytest
import torch

from sparkinfer.cli import main

CASES = [
    ("demo-world-0", ["demo", "--world-size", "0"], "world size 0: SparkInfer runs 1 to 16 ranks"),
    ("demo-world-17", ["demo", "--world-size", "17"], "world size 17: SparkInfer runs 1 to 16 ranks"),
    ("demo-comm-world-0", ["demo-comm", "--world-size", "0"], "world size 0: SparkInfer runs 1 to 16 ranks"),
    ("demo-comm-world-17", ["demo-comm", "--world-size", "17"], "world size 17: SparkInfer runs 1 to 16 ranks"),
]
if not torch.cuda.is_available():
    CASES += [
        ("demo-cuda-without-gpu", ["demo", "--backend", "cuda"], "backend 'cuda' with 2 ranks needs 2 GPU"),
        ("demo-comm-cuda-without-gpu", ["demo-comm", "--backend", "cuda"], "backend 'cuda' with 2 ranks needs 2 GPU"),
    ]


@pytest.mark.parametrize("argv,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_demo_rejects_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1, err
