#!/bin/bash
export NCCL_NVLS_ENABLE=0 TRITON_INTERPRET=0 SPARKINFER_COMMIT=$1
cd "$(dirname "$0")/.."
root=$PWD
t0=$(date +%s)
(
  CUDA_VISIBLE_DEVICES=0 timeout 240 python -m pytest -q tests/moe/test_gpu.py > $OUT/moe_gpu_tests.log 2>&1
  echo "tests rc=$? $(( $(date +%s) - t0 )) s" >> $OUT/moe_gpu_tests.log
  CUDA_VISIBLE_DEVICES=0 timeout 330 python3 benchmarks/bench_moe.py --quick --budget-s 240 --out $OUT/moe_h200.json > $OUT/moe_quick.log 2>&1
) &
(
  CUDA_VISIBLE_DEVICES=1 timeout 200 python3 .scratch/moe_ab.py act $OUT/ab_act.json dsv3_tp8,qwen3,dsv3 1,2 nvfp4 "s1x2:split1=2;s1x4:split1=4" > $OUT/ab_act.log 2>&1
  d=/tmp/tree_f; rm -rf $d; cp -r $root $d; cd $d && patch -p1 -s < .scratch/x_fusedact.patch
  CUDA_VISIBLE_DEVICES=1 timeout 120 python3 .scratch/moe_ab.py fusedact $OUT/ab_fusedact.json dsv3_tp8 1,2 nvfp4 "" > $OUT/ab_fusedact.log 2>&1
  CUDA_VISIBLE_DEVICES=1 timeout 200 python3 .scratch/moe_prof.py $OUT/prof.json dsv3,mixtral,qwen3,dsv3_tp8 1,8 "" > $OUT/prof.log 2>&1
) 
wait
echo "all done $(( $(date +%s) - t0 )) s"
tail -3 $OUT/moe_gpu_tests.log; grep "^time\|Error" $OUT/ab_*.log; grep "^prof\|Error" $OUT/prof.log; tail -36 $OUT/moe_quick.log
