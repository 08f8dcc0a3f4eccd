#!/bin/bash
export NCCL_NVLS_ENABLE=0 TRITON_INTERPRET=0 SPARKINFER_COMMIT=$1
cd "$(dirname "$0")/.."
root=$PWD
runv() {  # gpu variant
  d=/tmp/tree_$2; rm -rf $d; cp -r $root $d; cd $d
  [ $2 != base ] && patch -p1 -s < .scratch/x_$2.patch
  CUDA_VISIBLE_DEVICES=$1 timeout 200 python3 benchmarks/bench_moe.py --quick --m 1,2,8 --formats nvfp4 --no-baselines --budget-s 150 --out $OUT/q_$2.json > $OUT/q_$2.log 2>&1
  cd $root
}
( runv 0 base; runv 0 rot ) &
( runv 1 cm; runv 1 cmrot )
wait
for v in base rot cm cmrot; do echo "== $v"; grep "^time\|failed" $OUT/q_$v.log; done
