#!/bin/bash
export NCCL_NVLS_ENABLE=0 TRITON_INTERPRET=0 SPARKINFER_COMMIT=$1
cd "$(dirname "$0")/.."
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 .scratch/reduce_bench.py $OUT/reduce.json > $OUT/reduce.log 2>&1 &
( CUDA_VISIBLE_DEVICES=1 timeout 200 python3 .scratch/moe_prof.py $OUT/prof.json dsv3_tp8,qwen3 1,2,8 "" > $OUT/prof.log 2>&1
  FMT=bf16 CUDA_VISIBLE_DEVICES=1 timeout 200 python3 .scratch/moe_prof.py $OUT/prof_bf16.json dsv3_tp8 1,4096 "" > $OUT/prof_bf16.log 2>&1 )
wait
echo "all done $(( $(date +%s) - t0 )) s"
grep "^reduce\|Error" $OUT/reduce.log; grep "^prof\|Error" $OUT/prof*.log
