#!/bin/bash
# Repeat a 2-GPU comm test N times (default 20), or until BUDGET_S seconds
# (second argument, default unlimited) have passed. Keeps the full output of
# failing runs only (${OUT:-/tmp/out}/gpu2_fail_<i>.log: the device tool returns
# few files) and one JSON row per run in gpu2_runs.jsonl; prints one line per run.
# TARGET (env) picks the tests, default the whole 2-GPU comm suite. Chases the
# failure of test_fused_norm.py::test_eager_capture_replay_new_inputs_replay
# (benchmarks/results/gpu2_tests_9b35ff1.json).
export NCCL_NVLS_ENABLE=0 TRITON_INTERPRET=0
out=${OUT:-/tmp/out}; mkdir -p "$out"
n=${1:-20}
budget=${2:-0}
target=${TARGET:-tests/comm -m gpu2}
start=$(date +%s)
cmd="python -m pytest -q -x $target --tb=long"
for i in $(seq 1 "$n"); do
  t0=$(date +%s)
  timeout 120 $cmd > /tmp/gpu2_run.log 2>&1
  rc=$?
  last=$(tail -1 /tmp/gpu2_run.log)
  # the first MAXFAIL (default 4) failing logs only (the device tool returns at most 8 files)
  [ "$rc" != 0 ] && [ "$(ls "$out"/gpu2_fail_*.log 2>/dev/null | wc -l)" -lt "${MAXFAIL:-4}" ] && cp /tmp/gpu2_run.log "$out/gpu2_fail_$i.log"
  echo "run $i rc=$rc $last"
  python - "$i" "$rc" "$last" "$cmd" "$((`date +%s` - t0))" >> "$out/gpu2_runs.jsonl" <<'PY'
import json, sys
i, rc, last, cmd, wall = sys.argv[1:]
print(json.dumps({"run": int(i), "rc": int(rc), "result": last, "command": cmd, "wall_s": int(wall)}))
PY
  if [ "$budget" -gt 0 ] && [ $(( $(date +%s) - start + 35 )) -gt "$budget" ]; then
    echo "stopping after $i runs: budget ${budget}s"; break
  fi
done
