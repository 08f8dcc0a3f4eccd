#!/bin/bash
# One nvidia-h200-x2 call (about 9 minutes) that measures what this session
# could not, on the current main:
# 1. issue 4: the fused-norm timings after `do_not_specialize=["rank"]`
#    (bench_fused.py, full T list) and the 2-GPU comm tests repeated;
# 2. issue 5: the resident family's GPU tests (rewritten after 23874e4, not yet run).
# Output: $OUT/fused_2xh200.json, $OUT/bench_fused.log, $OUT/gpu2_runs.jsonl
# (+ gpu2_fail_<i>.log), $OUT/moe_gpu_resident.log: at most 8 files come back.
export NCCL_NVLS_ENABLE=0 TRITON_INTERPRET=0
out=${OUT:-/tmp/out}; mkdir -p "$out"
timeout 240 python3 benchmarks/bench_fused.py --only norm --budget-s 180 --out "$out/fused_2xh200.json" \
  > "$out/bench_fused.log" 2>&1; echo "bench_fused rc=$?"; grep -i "fail\|error" "$out/bench_fused.log" | head -5
timeout 150 python -m pytest -q tests/moe/test_gpu_resident.py --tb=short > "$out/moe_gpu_resident.log" 2>&1
echo "resident tests rc=$? $(tail -1 "$out/moe_gpu_resident.log")"
bash benchmarks/sweeps/session4_fused/repeat_gpu2.sh 20 $((560 - SECONDS))
# Second call (nvidia-h200, about 9 minutes): the planner's provisional thresholds
# (MICRO_MAX_TOKENS, PROGRAMS_PER_SM, GROUPED_BLOCK_M: plan.py) against their
# neighbours at the current kernels, for issue 5:
#   python3 benchmarks/bench_moe.py --sweep --m 4,8,16,32,64,256 --budget-s 500 \
#       --out $OUT/moe_sweep_h200.json
