#!/usr/bin/env bash
# tests/unit/check_docs_map_test.sh <python3> <check-docs-map.py> — the map checker against a small
# tree: a map naming only what exists passes (files by path suffix, folders, wildcards, symbols
# qualified or not, config keys, fenced blocks and runtime paths left alone); each planted drift (a
# file gone, a folder gone, a symbol renamed, a class without that member, a broken link) fails
# naming the line and the name.
set -u
py=$1 checker=$2
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
fails=0
r=$T/tree
mkdir -p "$r/docs" "$r/src/zero" "$r/python/tiermem/torch" "$r/tests/unit" "$r/build/default"
printf 'namespace tiermem {\nclass Gatherer {\n  void publish_whole_modules(int module);\n};\n}\n' >"$r/src/zero/gatherer.h"
printf '#include "zero/gatherer.h"\nvoid tiermem::Gatherer::publish_whole_modules(int) {}\nstruct Impl { void step(); };\n' >"$r/src/zero/gatherer.cc"
printf 'class Unit:\n    def gather(self):\n        return self.tiermem.update_in_backward\n' >"$r/python/tiermem/torch/_unit.py"
printf 'tiermem_test(NAME zero_parts_test)\n' >"$r/tests/unit/zero.cmake"
printf '# notes\n' >"$r/docs/zero.md"
good() {
  cat <<'MD'
# Map
See [zero.md](zero.md) and the folder `src/zero` and `python/tiermem/torch/`.
| `zero/gatherer.cc` · `.h` | `Gatherer::publish_whole_modules` (`publish_whole_modules()`), `Impl::step` |
`_unit.py` `Unit.gather` → `tiermem.update_in_backward`; tests in `tests/unit/<subsystem>.cmake`, `zero_parts_test`.
Runtime only: `<path>/rank<r>`, `build/default/bin/`, `~/.cache/x`; a value `"auto"`, a word `step`.
```
src/nope/      a diagram: not checked
```
MD
}
check() {  # check <expect: pass|fail> <grep pattern or ""> <map>
  local expect=$1 pat=$2 out rc
  printf '%s\n' "$3" >"$r/docs/architecture.md"
  out=$("$py" "$checker" --root "$r" 2>&1); rc=$?
  if [ "$expect" = pass ] && [ $rc -ne 0 ]; then echo "FAIL: expected pass, got: $out"; fails=$((fails+1)); return; fi
  if [ "$expect" = fail ] && [ $rc -eq 0 ]; then echo "FAIL: expected a failure ($pat), passed"; fails=$((fails+1)); return; fi
  if [ -n "$pat" ] && ! grep -q -- "$pat" <<<"$out"; then echo "FAIL: no '$pat' in: $out"; fails=$((fails+1)); return; fi
  echo "ok: $expect ${pat:-clean}"
}
check pass "" "$(good)"
rm "$r/src/zero/gatherer.cc"
check fail 'architecture.md:3: path: `zero/gatherer.cc` matches no file' "$(good)"
printf '#include "zero/gatherer.h"\nvoid tiermem::Gatherer::publish_whole_modules(int) {}\nstruct Impl { void step(); };\n' >"$r/src/zero/gatherer.cc"
check fail 'path: `src/zerox`' "$(good | sed 's/`src\/zero`/`src\/zerox`/')"
check fail 'symbol: `Gatherer::publish_whole`: publish_whole not in the sources' "$(good | sed 's/Gatherer::publish_whole_modules/Gatherer::publish_whole/')"
check fail 'symbol: `Unit.publish_whole_modules`: Unit and publish_whole_modules never in one source file' "$(good | sed 's/`Unit.gather`/`Unit.publish_whole_modules`/')"
check fail 'symbol: `tiermem.update_in_backwards`' "$(good | sed 's/update_in_backward/update_in_backwards/')"
check fail 'link: (zero2.md)' "$(good | sed 's/(zero.md)/(zero2.md)/')"
[ $fails -eq 0 ] && echo "PASS: check-docs-map" || { echo "$fails check(s) failed"; exit 1; }
