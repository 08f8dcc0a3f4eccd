#!/bin/bash
export NCCL_NVLS_ENABLE=0 TRITON_INTERPRET=0 SPARKINFER_COMMIT=$1
cd "$(dirname "$0")/.."
root=$PWD
runv() {  # gpu variant
  d=/tmp/tree_$2; rm -rf $d; cp -r $root $d; cd $d
  [ $2 != pdl ] && patch -p1 -s < .scratch/x_$2.patch
  CUDA_VISIBLE_DEVICES=$1 timeout 250 python3 benchmarks/bench_moe.py --quick --m 1,2,8 --no-baselines --budget-s 200 --out $OUT/q_$2.json > $OUT/q_$2.log 2>&1
  cd $root
}
( CUDA_VISIBLE_DEVICES=0 timeout 200 python -m pytest -q tests/moe/test_gpu.py > $OUT/gpu_tests.log 2>&1; runv 0 pdl ) &
runv 1 nopdl
wait
tail -3 $OUT/gpu_tests.log
for v in pdl nopdl; do echo "== $v"; grep "^time\|failed\|rror" $OUT/q_$v.log; done
python3 -c "
import json
for v in ('pdl','nopdl'):
    r=[x for x in json.load(open('$OUT/q_'+v+'.json')) if x.get('kind')=='time']
    print(v, sorted(set(x.get('mode') for x in r)))
"
