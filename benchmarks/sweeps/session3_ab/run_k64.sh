#!/bin/bash
export NCCL_NVLS_ENABLE=0 TRITON_INTERPRET=0 SPARKINFER_COMMIT=$1
cd "$(dirname "$0")/.."
root=$PWD
d=/tmp/tree_k64; rm -rf $d; cp -r $root $d; cd $d; patch -p1 -s < .scratch/x_k64.patch
CUDA_VISIBLE_DEVICES=1 timeout 250 python3 benchmarks/bench_moe.py --quick --m 1,2,8,64 --formats nvfp4 --no-baselines --budget-s 200 --out $OUT/q_k64.json > $OUT/q_k64.log 2>&1 &
CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/sweeps/moe_micro_ab.py --m 1,8 --cfg "s1x2:split1=2;st6:stages1=6,stages2=6;st8:stages1=8,stages2=8" --out $OUT/ab_k64.json > $OUT/ab_k64.log 2>&1
wait
echo "== k64 quick"; grep "^time\|failed\|rror" $OUT/q_k64.log; echo "== k64 ab"; grep "^time\|rror" $OUT/ab_k64.log
