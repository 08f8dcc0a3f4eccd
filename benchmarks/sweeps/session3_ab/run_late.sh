#!/bin/bash
export NCCL_NVLS_ENABLE=0 TRITON_INTERPRET=0 SPARKINFER_COMMIT=$1
cd "$(dirname "$0")/.."
root=$PWD
runv() {  # gpu variant
  d=/tmp/tree_$2; rm -rf $d; cp -r $root $d; cd $d
  patch -p1 -s < .scratch/x_$2.patch
  CUDA_VISIBLE_DEVICES=$1 timeout 250 python3 benchmarks/bench_moe.py --quick --m 1,2,8 --no-baselines --budget-s 200 --out $OUT/q_$2.json > $OUT/q_$2.log 2>&1
  cd $root
}
runv 0 late &
runv 1 latenopf
wait
for v in late latenopf; do echo "== $v"; grep "^time\|failed\|rror" $OUT/q_$v.log; done
