#!/bin/bash
export NCCL_NVLS_ENABLE=0 TRITON_INTERPRET=0 SPARKINFER_COMMIT=$1
cd "$(dirname "$0")/.."
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=0 timeout 300 python3 .scratch/moe_prof.py $OUT/prof.json dsv3,mixtral,qwen3,dsv3_tp8 1,8 "bn2:block_n2=128" > $OUT/prof.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 300 python3 .scratch/moe_ab.py tiled2 $OUT/ab_cfg2.json dsv3,mixtral,qwen3 1,8 nvfp4 "s1_6:stages1=6;s2_6:stages2=6;bn2:block_n2=128;bn2s2_6:block_n2=128,stages2=6" > $OUT/ab_cfg2.log 2>&1
wait
echo "all done $(( $(date +%s) - t0 )) s"
grep "^prof\|Error\|error" $OUT/prof.log | head -40; grep "^time\|done" $OUT/ab_cfg2.log
