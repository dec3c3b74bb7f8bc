#!/usr/bin/env bash
# compare_fio.sh — tiermem-bench nvme against fio on the same file, interleaved pairs, medians.
#
#   bench/compare_fio.sh DIR [SIZE] [RUNTIME_S] [PAIRS]        (defaults: 1G 5 5)
#   TIERMEM_BENCH=build/default/bin/tiermem-bench bench/compare_fio.sh /mnt/nvme 512M 3 5
#   SEQ_QD="8 16 64" RANDREAD=0 bench/compare_fio.sh /mnt/nvme 512M 3 5   # a queue-depth sweep
#
# Cases: seq read 1 MiB and seq write 1 MiB at each queue depth in SEQ_QD (default 16), and 4 KiB
# randread qd 64 unless RANDREAD=0 (one job each). For
# each case it runs PAIRS rounds of {tiermem-bench, fio ioengine=io_uring, fio ioengine=libaio},
# rotating which goes first, all with O_DIRECT (direct=1) on DIR/tiermem-bench-nvme.dat (laid out
# once by a full sequential write), same bs / iodepth / size / runtime (time_based). Prints the
# median GB/s (1e9 B/s) and IOPS of each, and the ratios tiermem / fio.
set -euo pipefail
DIR=${1:?usage: compare_fio.sh DIR [SIZE] [RUNTIME_S] [PAIRS]}
SIZE=${2:-1G}
RT=${3:-5}
PAIRS=${4:-5}
BENCH=${TIERMEM_BENCH:-$(dirname "$0")/../build/default/bin/tiermem-bench}
FILE=$DIR/tiermem-bench-nvme.dat
command -v fio >/dev/null || { echo "compare_fio.sh: fio not found (apt-get install fio)" >&2; exit 2; }
[ -x "$BENCH" ] || { echo "compare_fio.sh: $BENCH not built (set TIERMEM_BENCH)" >&2; exit 2; }
mkdir -p "$DIR"

fio --name=layout --filename="$FILE" --rw=write --bs=1M --size="$SIZE" --direct=1 \
    --ioengine=io_uring --iodepth=16 --output-format=terse >/dev/null

run_fio() {  # engine rw bs qd -> "gbps iops"
  fio --name=cmp --filename="$FILE" --ioengine="$1" --direct=1 --rw="$2" --bs="$3" --iodepth="$4" \
      --size="$SIZE" --runtime="$RT" --time_based --output-format=json 2>/dev/null |
    python3 -c 'import json,sys
j=json.load(sys.stdin)["jobs"][0]; r=j["read"] if j["read"]["io_bytes"] else j["write"]
print(r["bw_bytes"]/1e9, r["iops"])'
}
run_tm() {  # rw bs qd -> "gbps iops"
  "$BENCH" nvme --path "$FILE" --rw "$1" --bs "$2" --qd "$3" --size "$SIZE" --runtime "$RT" \
      --engine uring --json 2>/dev/null | tail -n 1 |
    python3 -c 'import json,sys; j=json.loads(sys.stdin.read()); print(j["gbps"], j["iops"])'
}
median() { python3 -c 'import sys,statistics; print(statistics.median(float(x) for x in sys.argv[1:]))' "$@"; }

printf "%-14s %10s %10s %10s %10s %10s %8s %8s\n" case tm_GB/s uring_GB/s libaio_GB/s tm_IOPS \
    uring_IOPS tm/uring tm/libaio
cases=()
for q in ${SEQ_QD:-16}; do cases+=("seq-read-qd$q read 1M $q" "seq-write-qd$q write 1M $q"); done
[ "${RANDREAD:-1}" = 0 ] || cases+=("randread-4k randread 4K 64")
for c in "${cases[@]}"; do
  set -- $c
  name=$1 rw=$2 bs=$3 qd=$4
  tg=() ti=() ug=() ui=() lg=() li=()
  for ((i = 0; i < PAIRS; i++)); do
    for k in 0 1 2; do
      case $(((k + i) % 3)) in
        0) read -r g o < <(run_tm "$rw" "$bs" "$qd"); tg+=("$g"); ti+=("$o") ;;
        1) read -r g o < <(run_fio io_uring "$rw" "$bs" "$qd"); ug+=("$g"); ui+=("$o") ;;
        2) read -r g o < <(run_fio libaio "$rw" "$bs" "$qd"); lg+=("$g"); li+=("$o") ;;
      esac
    done
  done
  T=$(median "${tg[@]}") U=$(median "${ug[@]}") L=$(median "${lg[@]}")
  TI=$(median "${ti[@]}") UI=$(median "${ui[@]}")
  echo "# $name tiermem: ${tg[*]} | fio io_uring: ${ug[*]} | fio libaio: ${lg[*]}" >&2
  python3 -c 'import sys
n,t,u,l,ti,ui=sys.argv[1],*map(float,sys.argv[2:])
print("%-14s %10.3f %10.3f %10.3f %10.0f %10.0f %8.2f %8.2f" % (n,t,u,l,ti,ui,t/u,t/l))' \
    "$name" "$T" "$U" "$L" "$TI" "$UI"
done
