#!/usr/bin/env bash
# bench/checksum_cost.sh — what the swap checksums cost tiermem-train, side by side: ROUNDS
# interleaved pairs of the same run with "tiermem.checksum" true and false (the order alternates
# each round, so load on a shared machine hits both alike); prints every run and the medians of
# tokens/s and of the user+system CPU seconds the process used. A run that fails is printed with
# its error and left out of the medians.
#
#   bench/checksum_cost.sh BIN WORKDIR ROUNDS -- <tiermem-train arguments>
#   bench/checksum_cost.sh build/cpu/bin/tiermem-train /tmp/ck 3 -- \
#       --model mini --steps 40 --batch 8 --lr 2e-3        # the demo, 40 steps
#
# The arguments must leave --json, --config and --swap-dir to this script, and give --batch and
# --lr (with a --config, tiermem-train takes them from it, not from the model's demo defaults).
# Needs /usr/bin/time (GNU time). The final losses of a pair must be equal (checksums change no
# result); the script prints them.
set -euo pipefail
BIN=$(realpath "$1"); WORK=$2; ROUNDS=$3; shift 3
[[ "${1:-}" == "--" ]] && shift
mkdir -p "$WORK"
cd "$WORK"
# The demo's settings (what tiermem-train uses without --config: ZeRO-3, params and Adam state
# homed on NVMe, lr 1e-3, no weight decay), with the checksum switch.
for mode in on off; do
  [[ $mode == on ]] && flag=true || flag=false
  cat >$mode.json <<JSON
{"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "swap"},
                       "offload_optimizer": {"device": "nvme", "nvme_path": "swap"}},
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
 "tiermem": {"checksum": $flag}}
JSON
done
declare -A TPS CPU
for ((r = 0; r < ROUNDS; r++)); do
  if ((r % 2 == 0)); then order="on off"; else order="off on"; fi
  for mode in $order; do
    rm -rf swap
    if ! /usr/bin/time -f '%U %S' -o time.txt "$BIN" "$@" --config "$mode.json" --swap-dir swap \
        --json >out.txt 2>err.txt; then
      echo "round $r checksum $mode: FAILED (left out of the medians): $(grep 'error:' err.txt)"
      continue
    fi
    tps=$(tail -1 out.txt | python3 -c 'import json,sys; print(json.load(sys.stdin)["summary"]["tokens_per_s"])')
    cpu=$(awk '{print $1 + $2}' time.txt)
    loss=$(tail -1 out.txt | python3 -c 'import json,sys; print(json.load(sys.stdin)["summary"]["final_loss"])')
    echo "round $r checksum $mode: $tps tokens/s, $cpu CPU s, final loss $loss"
    TPS[$mode]+="$tps "; CPU[$mode]+="$cpu "
  done
done
median() { python3 -c 'import statistics,sys; print(statistics.median(map(float, sys.argv[1:])))' "$@"; }
on_t=$(median ${TPS[on]}); off_t=$(median ${TPS[off]}); on_c=$(median ${CPU[on]}); off_c=$(median ${CPU[off]})
python3 - "$on_t" "$off_t" "$on_c" "$off_c" <<'PY'
import sys
on_t, off_t, on_c, off_c = map(float, sys.argv[1:])
print(f"median tokens/s: checksum on {on_t:.1f}, off {off_t:.1f} -> cost {100 * (1 - on_t / off_t):+.1f} %")
print(f"median CPU s:    checksum on {on_c:.2f}, off {off_c:.2f} -> cost {100 * (on_c / off_c - 1):+.1f} %")
PY
