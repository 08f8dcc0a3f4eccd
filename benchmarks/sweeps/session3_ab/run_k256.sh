#!/bin/bash
export NCCL_NVLS_ENABLE=0 TRITON_INTERPRET=0 SPARKINFER_COMMIT=$1
cd "$(dirname "$0")/.."
root=$PWD
runv() {  # gpu variant
  d=/tmp/tree_$2; rm -rf $d; cp -r $root $d; cd $d
  [ $2 != base ] && patch -p1 -s < .scratch/x_$2.patch
  CUDA_VISIBLE_DEVICES=$1 timeout 250 python3 benchmarks/bench_moe.py --quick --m 1,2,8,64 --formats nvfp4 --no-baselines --budget-s 200 --out $OUT/q_$2.json > $OUT/q_$2.log 2>&1
  cd $root
}
runv 0 base &
runv 1 k256
wait
for v in base k256; do echo "== $v"; grep "^time\|failed\|rror" $OUT/q_$v.log; done
