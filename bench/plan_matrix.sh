#!/bin/sh
# bench/plan_matrix.sh — the docs/benchmarks.md "tiermem-plan: predicted vs measured" runs:
# tiermem-train on mini, gpt2 and gpt2-medium with offload nvme / cpu / none (a few steps, short
# sequences), each held against tiermem-plan --check with a profile of this machine.
#
#   bench/plan_matrix.sh [BUILD_DIR] [OUT_DIR]        (BUILD_DIR default build/default)
# Writes OUT_DIR/profile.json, OUT_DIR/<model>-<offload>.jsonl and prints one --check line per run.
set -eu
B=${1:-build/default}
O=${2:-/tmp/tiermem-plan-matrix}
T=$B/examples/gpt/tiermem-train
P=$B/examples/gpt/tiermem-plan
mkdir -p "$O"
for i in $(seq 1 400); do echo "the quick brown fox jumps over the lazy dog."; done > "$O/corpus.txt"
"$B/bench/tiermem-bench" profile --path "$O/swap" --json > "$O/profile.json"
run() {  # name, then tiermem-train flags
  name=$1; shift
  rm -rf "$O/swap"
  nice -n 10 "$T" "$@" --eval-every 0 --swap-dir "$O/swap" --data "$O/corpus.txt" --json > "$O/$name.jsonl"
  "$P" --check "$O/$name.jsonl" --profile "$O/profile.json" --json | tail -1 | python3 -c "
import json, sys
j = json.loads(sys.stdin.read())
print('%-22s step %7.2f s predicted, %7.2f s measured (%5.1f %%); peaks device %.1f %%, host %.1f %%, nvme %.1f %%' % (
    '$name', j['step_seconds_predicted'], j['step_seconds_measured'], 100 * j['step_seconds_rel_error'],
    100 * j['device_peak_bytes_rel_error'], 100 * j['host_peak_bytes_rel_error'], 100 * j['nvme_peak_bytes_rel_error']))"
}
for off in nvme cpu none; do
  run "mini-$off" --model mini --steps 4 --seq-len 64 --batch 4 --offload $off --host-budget 256MiB --device-budget 64MiB
done
for off in nvme cpu none; do
  run "gpt2-$off" --model gpt2 --steps 3 --seq-len 64 --batch 2 --offload $off --host-budget 4GiB --device-budget 2GiB
done
run "gpt2-nvme-default" --model gpt2 --steps 3 --seq-len 64 --batch 2 --offload nvme
for off in nvme cpu none; do
  run "gpt2-medium-$off" --model gpt2-medium --steps 3 --seq-len 64 --batch 2 --offload $off --host-budget 8GiB --device-budget 3GiB
done
