#!/usr/bin/env bash
# tests/unit/examples_test.sh <sample> <binary> — runs one sample of examples/ and checks its exit
# status and what it printed (tests/unit/examples.cmake).
set -u
name=$1 bin=$2
out=$("$bin" 2>&1)
rc=$?
echo "$out"
[ $rc -eq 0 ] || { echo "FAIL: $name exited $rc"; exit 1; }
case $name in
  zero_mlp)
    # "loss <first> -> <last>; ...": the last is below half the first.
    line=$(grep -E '^loss [0-9.]+ -> [0-9.]+' <<<"$out") || { echo "FAIL: no loss summary"; exit 1; }
    read -r first last < <(sed -E 's/^loss ([0-9.]+) -> ([0-9.]+).*/\1 \2/' <<<"$line")
    awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a / 2) }' ||
      { echo "FAIL: loss $first -> $last did not halve"; exit 1; }
    [ "$(grep -c '^step ' <<<"$out")" -eq 30 ] || { echo "FAIL: expected 30 step lines"; exit 1; } ;;
  tensor_store_paging)
    grep -q '^ok: every tensor holds its value' <<<"$out" || { echo "FAIL: no ok line"; exit 1; }
    grep -qE '^ *nvme -> ' <<<"$out" || { echo "FAIL: nothing was read from NVMe"; exit 1; } ;;
  *) echo "FAIL: unknown sample $name"; exit 1 ;;
esac
echo "PASS: $name"
