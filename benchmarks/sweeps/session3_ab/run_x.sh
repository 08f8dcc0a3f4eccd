#!/bin/bash
# usage: run_x.sh "gpu0 variants" "gpu1 variants"; variant = patch name under .scratch/x_<v>.patch or base
export NCCL_NVLS_ENABLE=0 TRITON_INTERPRET=0
SHAPES=${SHAPES:-dsv3,qwen3,mixtral,dsv3_tp8} MS=${MS:-1,8} FMT=${FMT:-nvfp4}
cd "$(dirname "$0")/.."
root=$PWD
runq() {  # gpu, variants...
  g=$1; shift
  for v in "$@"; do
    d=/tmp/tree_$v; rm -rf $d; cp -r $root $d
    [ $v != base ] && (cd $d && patch -p1 -s < .scratch/x_$v.patch)
    (cd $d && CUDA_VISIBLE_DEVICES=$g timeout 280 python3 .scratch/moe_ab.py $v $OUT/ab_$v.json $SHAPES $MS $FMT > $OUT/ab_$v.log 2>&1)
  done
}
runq 0 $1 &
runq 1 $2
wait
for f in $OUT/ab_*.log; do echo "== $f"; grep -v "^\s*$" $f | tail -12; done
