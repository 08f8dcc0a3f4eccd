#!/bin/bash
# H200: the resident family against micro at decode sizes (one device call).
# 1. GPU tests of the MoE families (resident bitwise == micro, replays), full output kept;
# 2. moe_micro_ab.py per shape: planned (micro) vs resident with 1 or 2 programs per SM
#    and each prefetch mode, NVFP4 at M 1, 4, 8 (1, 8 for the large shapes); bf16 at M 1, 8.
# Rows go to ${OUT}/moe_resident_ab_h200.json, logs next to it.
set -u
export TRITON_INTERPRET=0
out=${OUT:-/tmp/out}; mkdir -p "$out"
timeout 200 python -m pytest -q tests/moe/test_gpu_resident.py tests/moe/test_gpu.py --tb=long \
  > "$out/moe_gpu_tests.log" 2>&1; echo "tests rc=$? $(tail -1 "$out/moe_gpu_tests.log")"
cfg="res2p1:family=resident,grid_per_sm=2,prefetch=1;res1p1:family=resident,grid_per_sm=1,prefetch=1"
cfg="$cfg;res2p0:family=resident,grid_per_sm=2,prefetch=0;res2p2:family=resident,grid_per_sm=2,prefetch=2"
for sm in qwen3:1,4,8 dsv3_tp8:1,4,8 mixtral:1,8 dsv3:1,8; do
  shape=${sm%%:*}
  timeout 100 python benchmarks/sweeps/moe_micro_ab.py --shapes $shape --m ${sm#*:} --cfg "$cfg" \
    --out "$out/moe_resident_ab_h200.json" >> "$out/moe_resident_ab.log" 2>&1
  echo "nvfp4 $shape rc=$?"
done
for shape in qwen3; do
  timeout 60 python benchmarks/sweeps/moe_micro_ab.py --shapes $shape --m 1,8 --format bf16 \
    --cfg "res2p1:family=resident,grid_per_sm=2,prefetch=1" \
    --out "$out/moe_resident_ab_h200.json" >> "$out/moe_resident_ab.log" 2>&1
  echo "bf16 $shape rc=$?"
done
grep "^time" "$out/moe_resident_ab.log" | awk '{print $2, $3, $4, $5, $7, $9, $10}'
