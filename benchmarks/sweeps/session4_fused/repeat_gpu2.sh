#!/bin/bash
# Repeat the 2-GPU comm tests N times (default 20), keeping every run's full output
# under ${OUT:-/tmp/out}/gpu2_run_<i>.log; prints one line per run. Chases the one
# unexplained failure of test_fused_norm.py::test_eager_capture_replay_new_inputs_replay
# seen at 9b35ff1 (benchmarks/results/gpu2_tests_9b35ff1.json).
export NCCL_NVLS_ENABLE=0 TRITON_INTERPRET=0
out=${OUT:-/tmp/out}; mkdir -p "$out"
n=${1:-20}
for i in $(seq 1 "$n"); do
  timeout 120 python -m pytest -q -x tests/comm -m gpu2 --tb=long > "$out/gpu2_run_$i.log" 2>&1
  echo "run $i rc=$? $(tail -1 "$out/gpu2_run_$i.log")"
done
