#!/usr/bin/env bash
# tests/unit/check_layout_test.sh <python3> <check-layout.py> — the layout checker against small
# trees: a clean one passes; each planted violation (a file over 700 lines, a function over 120,
# src/ including tools/ and examples/, a header of a higher folder, a bare include, a stale
# allow-list entry, an entry without a reason) fails with its rule named; an allow-list entry
# exempts what it names.
set -u
py=$1 checker=$2
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
fails=0
check() {  # check <expect: pass|fail> <rule or ""> <root> [allow]
  local expect=$1 rule=$2 root=$3 allow=${4:-/dev/null} out rc
  out=$("$py" "$checker" --root "$root" --allow "$allow" 2>&1); rc=$?
  if [ "$expect" = pass ] && [ $rc -ne 0 ]; then echo "FAIL: expected pass, got: $out"; fails=$((fails+1)); return; fi
  if [ "$expect" = fail ] && [ $rc -eq 0 ]; then echo "FAIL: expected '$rule' violation, passed"; fails=$((fails+1)); return; fi
  if [ -n "$rule" ] && ! grep -q ": $rule:" <<<"$out"; then echo "FAIL: no '$rule' in: $out"; fails=$((fails+1)); return; fi
  echo "ok: $expect ${rule:-clean} ($root)"
}
fresh() {  # a clean tree: src/core, src/zero, tools/x
  local r=$T/$1; mkdir -p "$r/src/core" "$r/src/zero" "$r/tools/x"
  printf '#pragma once\nnamespace tm { int f(); }\n' >"$r/src/core/a.h"
  printf '#include "core/a.h"\n#include <vector>\nnamespace tm {\nint f() {\n  const char* s = "}{";\n  return s[0];\n}\n}  // namespace tm\n' >"$r/src/core/a.cc"
  printf '#include "core/a.h"\n#include "tiermem/x.h"\nint g() { return tm::f(); }\n' >"$r/src/zero/z.cc"
  printf '#include "zero/z.h"\nint main() { return 0; }\n' >"$r/tools/x/main.cc"
  echo "$r"
}
long_function() {  # long_function <lines>: a function body of that many lines
  echo "int long_one(int x) {"; for i in $(seq 3 "$1"); do echo "  x += $i;  // { not a brace"; done; echo "  return x; }"
}

check pass "" "$(fresh clean)"
r=$(fresh big); for i in $(seq 701); do echo "// line $i"; done >"$r/src/core/big.cc"
check fail file-size "$r"
r=$(fresh longfn); long_function 121 >"$r/tools/x/long.cc"
check fail function "$r"
r=$(fresh okfn); long_function 120 >"$r/tools/x/long.cc"
check pass "" "$r"
r=$(fresh rawstr); { echo 'const char* j = R"({"a": {"b": 1}})";'; long_function 121; } >"$r/src/core/raw.cc"
check fail function "$r"
r=$(fresh tools); echo '#include "tools/x/main.h"' >>"$r/src/core/a.cc"
check fail include-up "$r"
r=$(fresh examples); echo '#include "examples/gpt/model.h"' >>"$r/src/zero/z.cc"
check fail include-up "$r"
r=$(fresh upward); echo '#include "zero/zero_impl.h"' >>"$r/src/core/a.cc"
check fail include-up "$r"
r=$(fresh bare); echo '#include "a.h"' >>"$r/src/core/a.cc"
check fail include-bare "$r"
r=$(fresh allowed); long_function 200 >"$r/tools/x/long.cc"
printf '# comment\ntools/x/long.cc:long_one  generated, a test of the allow-list\n' >"$T/allow-ok"
check pass "" "$r" "$T/allow-ok"
printf 'tools/x/main.cc:main  not long at all\n' >"$T/allow-stale"
check fail allow-stale "$(fresh stale)" "$T/allow-stale"
printf 'tools/x/long.cc:long_one\n' >"$T/allow-noreason"
check fail "" "$r" "$T/allow-noreason"

[ $fails -eq 0 ] && echo "PASS: check-layout" || { echo "$fails check(s) failed"; exit 1; }
