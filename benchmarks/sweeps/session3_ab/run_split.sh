#!/bin/bash
export NCCL_NVLS_ENABLE=0 TRITON_INTERPRET=0 SPARKINFER_COMMIT=$1
cd "$(dirname "$0")/.."
CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/sweeps/moe_micro_ab.py --shapes dsv3,mixtral --m 1,2 --cfg "s1x2:split1=2;s1x3:split1=3;s1x4:split1=4" --profile --out $OUT/moe_split_ab_a.json > $OUT/split_a.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 300 python3 benchmarks/sweeps/moe_micro_ab.py --shapes qwen3,dsv3_tp8 --m 1,2 --cfg "s1x1:split1=1;s1x2:split1=2;s1x4:split1=4" --profile --out $OUT/moe_split_ab_b.json > $OUT/split_b.log 2>&1
wait
grep "^time\|^prof\|rror" $OUT/split_a.log $OUT/split_b.log | sed 's/.*log://'
