#!/bin/bash
export NCCL_NVLS_ENABLE=0 TRITON_INTERPRET=0 SPARKINFER_COMMIT=$1
cd "$(dirname "$0")/.."
t0=$(date +%s)
(
  CUDA_VISIBLE_DEVICES=0 timeout 240 python -m pytest -q tests/moe/test_gpu.py > $OUT/moe_gpu_tests.log 2>&1
  echo "tests rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/moe_gpu_tests.log
  CUDA_VISIBLE_DEVICES=0 timeout 320 python3 benchmarks/bench_moe.py --quick --budget-s 230 --out $OUT/moe_h200.json > $OUT/moe_quick.log 2>&1
) &
CUDA_VISIBLE_DEVICES=1 timeout 400 python3 .scratch/moe_ab.py tiled $OUT/ab_cfg.json dsv3,qwen3,mixtral,dsv3_tp8 1,8 nvfp4 "bn2:block_n2=128;w8:block_n1=128,block_n2=128,num_warps=8;st6:stages1=6,stages2=6" > $OUT/ab_cfg.log 2>&1
wait
echo "all done $(( $(date +%s) - t0 )) s"
tail -5 $OUT/moe_gpu_tests.log; grep "^time\|done" $OUT/ab_cfg.log; tail -40 $OUT/moe_quick.log
