#!/bin/sh
# bench/plan_matrix.sh — the docs/benchmarks.md "tiermem-plan: predicted against measured" runs:
# tiermem-train on mini, gpt2 and gpt2-medium with offload nvme / cpu / none (short sequences;
# enough steps that the timed ones — every step after the first, whose median the summary's
# step_seconds is — add up to seconds: mini 30, gpt2 10, gpt2-medium 9), each held against
# tiermem-plan --check with a profile of this machine.
# Each line ends with the load average when the run ended (a shared machine's load moves the
# step time more than the model's error does).
#
#   bench/plan_matrix.sh [BUILD_DIR] [OUT_DIR] [ROUNDS]   (BUILD_DIR default build/default, ROUNDS 1)
# Writes OUT_DIR/profile-<k>.json (k = 0, 1, ...: one before the first run and one after every
# run), OUT_DIR/<run>.jsonl, OUT_DIR/profile-<run>.json (the mean of the profiles just before and
# just after that run), OUT_DIR/<run>.check.json (tiermem-plan --check --json's last line) and
# prints one --check line per run; <run> is <model>-<offload>, with .r<round> after it when
# ROUNDS > 1. With several rounds (the whole matrix again; round 1 in the order above, each later
# round in its own fixed shuffle, printed at the round's start) it ends with one
# line per configuration: the median predicted against the median measured step time over the
# rounds, and each round's error: the VM's speed moves by tens of percent within minutes, and a
# median over rounds of interleaved runs is the figure that says how close the model is.
#
# OMP_WAIT_POLICY=PASSIVE unless set: with libgomp's default (spin after each parallel region),
# its idle threads and OpenBLAS's own pthreads spin against each other on a small shared machine,
# and a step's compute then depends on the load and on how many kernels it runs, not on its FLOPs
# (docs/benchmarks.md: gpt2 4.7-4.9 s per step against 1.6-1.8 s passive, at the same load).
# A fresh profile (~35 s) is measured between every two runs, and each run is held to the mean of
# the two around it (profile-<run>.json): the VM's speed moves by tens of percent from one minute
# to the next; one profile per model (even one before and one after a model's runs) priced a run
# by minutes it did not run in (docs/notes/2026-12-01-planner-median-overlap-bracketing.md).
set -eu
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
B=${1:-build/default}
O=${2:-/tmp/tiermem-plan-matrix}
ROUNDS=${3:-1}
T=$B/bin/tiermem-train
P=$B/bin/tiermem-plan
mkdir -p "$O"
for i in $(seq 1 400); do echo "the quick brown fox jumps over the lazy dog."; done > "$O/corpus.txt"
profile() {  # file: measures a profile of this machine into OUT_DIR/<file>.json
  echo "profile $1 (OMP_WAIT_POLICY=$OMP_WAIT_POLICY): load $(cut -d' ' -f1-3 /proc/loadavg)"
  rm -rf "$O/swap"
  nice -n 10 "$B/bin/tiermem-bench" profile --path "$O/swap" --json > "$O/$1.json"
  grep -v '^{' "$O/$1.json"
}
merge() {  # before after out: OUT_DIR/<out>.json, every figure the mean of the two profiles
  python3 - "$O/$1.json" "$O/$2.json" "$O/$3.json" <<'PY'
import json, sys
def last(path):
    return json.loads([l for l in open(path) if l.startswith('{')][-1])
def mean(a, b):
    if isinstance(a, dict):
        return {k: mean(a[k], b[k]) if k in b else a[k] for k in a}
    if isinstance(a, (int, float)) and not isinstance(a, bool) and isinstance(b, (int, float)):
        return (a + b) / 2
    return a
a, b = last(sys.argv[1]), last(sys.argv[2])
m = mean(a, b)
m['profile']['name'] = 'this machine: the mean of the tiermem-bench profiles just before and after the run'
json.dump(m, open(sys.argv[3], 'w'))
PY
}
K=0
profile profile-0
run() {  # name, then tiermem-train flags: the run, the profile after it, the check against both
  name=$1$SUFFIX; shift
  rm -rf "$O/swap"
  nice -n 10 "$T" "$@" --eval-every 0 --swap-dir "$O/swap" --data "$O/corpus.txt" --json > "$O/$name.jsonl"
  cut -d' ' -f1-3 /proc/loadavg > "$O/$name.load"  # the load as the run ended
  profile "profile-$((K + 1))"
  merge "profile-$K" "profile-$((K + 1))" "profile-$name"
  K=$((K + 1))
  check "$name"
}
check() {  # run name: held against the mean of the profiles around it
  "$P" --check "$O/$1.jsonl" --profile "$O/profile-$1.json" --json | tail -1 > "$O/$1.check.json"
  python3 -c "
import json, sys
j = json.load(open('$O/$1.check.json'))
print('%-22s step %7.3f s predicted, %7.3f s measured (%5.1f %%); peaks device %.1f %%, host %.1f %%, nvme %.1f %%; %s' % (
    '$1', j['step_seconds_predicted'], j['step_seconds_measured'], 100 * j['step_seconds_rel_error'],
    100 * j['device_peak_bytes_rel_error'], 100 * j['host_peak_bytes_rel_error'], 100 * j['nvme_peak_bytes_rel_error'],
    'load ' + open('$O/$1.load').read().strip()))"
}
# ROWS (environment): the rows to run, a subset of these (default all eleven).
ROWS=${ROWS:-"mini-nvme mini-cpu mini-none gpt2-nvme gpt2-cpu gpt2-none gpt2-nvme-default gpt2-medium-nvme gpt2-medium-cpu gpt2-medium-none gpt2-medium-nvme-issue56"}
row() {  # row name: its tiermem-train run
  case $1 in
    mini-*) run "$1" --model mini --steps 30 --seq-len 64 --batch 4 --offload "${1#mini-}" --host-budget 256MiB --device-budget 64MiB ;;
    gpt2-nvme-default) run "$1" --model gpt2 --steps 10 --seq-len 64 --batch 2 --offload nvme ;;
    # issue 56's run as it was reported: the default budgets (1 GiB host and device), one sequence
    gpt2-medium-nvme-issue56) run "$1" --model gpt2-medium --steps 4 --seq-len 64 --batch 1 --offload nvme ;;
    gpt2-medium-*) run "$1" --model gpt2-medium --steps 9 --seq-len 64 --batch 2 --offload "${1#gpt2-medium-}" --host-budget 8GiB --device-budget 3GiB ;;
    gpt2-nvme|gpt2-cpu|gpt2-none) run "$1" --model gpt2 --steps 10 --seq-len 64 --batch 2 --offload "${1#gpt2-}" --host-budget 4GiB --device-budget 2GiB ;;
    *) echo "plan_matrix.sh: unknown row '$1' in ROWS" >&2; exit 2 ;;
  esac
}
order() {  # round: the rows in the order of ROWS for round 1, then a fixed shuffle per round
  # (seeded by the round) so that no row keeps its position or the row before it: six rounds in one
  # order always ran gpt2-cpu fifth, after gpt2-nvme, and it was faster than gpt2-none in all six
  # while alternating runs outside the matrix were not (docs/notes/2026-12-02-planner-gpt2-over-prediction.md)
  python3 -c "
import random, sys
rows = sys.argv[2:]
if int(sys.argv[1]) > 1:
    random.Random(int(sys.argv[1])).shuffle(rows)
print(' '.join(rows))" "$1" $ROWS
}
matrix() {  # round
  for name in $(order "$1"); do
    row "$name"
  done
}
SUFFIX=
if [ "$ROUNDS" -le 1 ]; then
  matrix 1
  exit 0
fi
for r in $(seq 1 "$ROUNDS"); do
  echo "round $r of $ROUNDS: $(order "$r")"
  SUFFIX=.r$r
  matrix "$r"
done
python3 - "$O" "$ROUNDS" "$ROWS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
rows = sys.argv[3].split()
print('medians over %d rounds (predicted / measured step time; each round\'s signed error):' % rounds)
within = 0
for row in rows:
    c = [json.load(open('%s/%s.r%d.check.json' % (out, row, r))) for r in range(1, rounds + 1)]
    p = statistics.median(x['step_seconds_predicted'] for x in c)
    m = statistics.median(x['step_seconds_measured'] for x in c)
    err = abs(p - m) / m
    within += err <= 0.15
    each = ' '.join('%+.1f' % (100 * (x['step_seconds_predicted'] / x['step_seconds_measured'] - 1)) for x in c)
    print('%-20s %7.3f / %7.3f s  %5.1f %%   rounds: %s %%' % (row, p, m, 100 * err, each))
print('%d of %d configurations within 15 %% (medians)' % (within, len(rows)))
PY
