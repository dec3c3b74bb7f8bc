#!/usr/bin/env bash
# tests/unit/check_layout_test.sh <python3> <check-layout.py> — the layout checker against small
# trees: a clean one passes; each planted violation (a file over 700 lines, a function over 120,
# src/ including tools/ and examples/, a header of a higher folder, a bare include, a stale
# allow-list entry, an entry without a reason; an import cycle under python/tiermem, an import in
# a function there, a private include from python/src, ZeroEngine::Impl over 20 data members, a
# 21st member whose brace initialiser holds a lambda, over 25 member functions, Impl missing, a
# public header's function or class without TIERMEM_API)
# fails with its rule named; an allow-list entry exempts what it names; what each rule must
# let through (TYPE_CHECKING imports, an optional package imported in a function, the extension's
# own headers, functions, nested types and statics beside Impl's members) passes.
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
fresh() {  # a clean tree: src/core, src/zero (with an Impl of 20 members, 25 functions), tools/x, python/
  local r=$T/$1; mkdir -p "$r/src/core" "$r/src/zero" "$r/tools/x" "$r/python/src" "$r/python/tiermem/torch"
  printf '#pragma once\nnamespace tm { int f(); }\n' >"$r/src/core/a.h"
  printf '#include "core/a.h"\n#include <vector>\nnamespace tm {\nint f() {\n  const char* s = "}{";\n  return s[0];\n}\n}  // namespace tm\n' >"$r/src/core/a.cc"
  printf '#include "core/a.h"\n#include "tiermem/x.h"\nint g() { return tm::f(); }\n' >"$r/src/zero/z.cc"
  impl 20 >"$r/src/zero/zero_impl.h"
  printf '#include "zero/z.h"\nint main() { return 0; }\n' >"$r/tools/x/main.cc"
  printf '#pragma once\n#include <nanobind/nanobind.h>\n' >"$r/python/src/bindings.h"
  printf '#include <vector>\n#include <nanobind/stl/string.h>\n#include "bindings.h"\n#include "tiermem/zero_engine.h"\n// #include "zero/old.h" in a comment\n' >"$r/python/src/m.cc"
  # tiermem -> _leaf; torch/__init__ re-exports engine (which imports its package's leaf and the
  # base package): no cycle; engine imports an optional package inside a function.
  printf 'from . import _leaf\n\ndef f():\n    import torch\n    return torch\n' >"$r/python/tiermem/__init__.py"
  printf 'X = 1\n' >"$r/python/tiermem/_leaf.py"
  printf 'from .engine import Engine\nfrom . import engine\n' >"$r/python/tiermem/torch/__init__.py"
  printf 'from typing import TYPE_CHECKING\nimport torch\nfrom .. import _leaf\nfrom ._units import Unit\nif TYPE_CHECKING:\n    from .checkpoint import Saver\n\nclass Engine:\n    def hf(self):\n        import transformers.modeling_utils as mu\n        return mu\n' >"$r/python/tiermem/torch/engine.py"
  printf 'import tiermem._leaf\n\nclass Unit:\n    pass\n' >"$r/python/tiermem/torch/_units.py"
  printf 'from .engine import Engine\n\nclass Saver:\n    pass\n' >"$r/python/tiermem/torch/checkpoint.py"
  echo "$r"
}
impl() {  # impl <n> [f]: a ZeroEngine::Impl of n data members and f member functions (default 25;
          # at least 8), with what must not count beside them
  local f=${2:-25}
  echo '#pragma once'
  echo 'struct ZeroEngine::Impl {'
  echo '  Communicator& comm;'
  echo '  int rank = 0, world = 1;                      // two'
  echo '  std::map<int, std::pair<int, int>> table;     // commas inside <>'
  echo '  std::function<void(int, float)> on_grad;      // ( inside <>'
  echo '  DeviceBuf grad_scratch{1, 2}, out_scratch{};  // brace initialisers, two'
  echo '  std::mutex mu_;'
  echo '  std::uint64_t live TM_GUARDED_BY(mu_) = 0;    // an annotation, not a function'
  echo '  Staging staging{comm, rank, [this](std::uint64_t u) { sample(u); }};  // a lambda inside: data'
  echo '  Reducer reducer{comm,   rank, opts(), table,'
  echo '                  [this](std::uint64_t u) { sample(u); }};  // a call and a lambda, two lines'
  echo '  static constexpr int kMax = 4;'
  echo '  using Clock = std::chrono::steady_clock;'
  echo '  struct Inflight { int a, b; std::vector<float> send; int size() const { return a; } };'
  echo '  enum class Kind { kA, kB };'
  echo '  Impl(Communicator& c) : comm(c), rank{0}, world{1} {}                   // functions: 1'
  echo '  ~Impl();                                                                 // 2'
  echo '  void f(int k, std::optional<double> partial = {}) const;                 // 3'
  echo '  std::size_t g() const { if (rank > 1) { return 1; } return 0; }          // 4'
  echo '  bool operator==(const Impl&) const = default;                            // 5'
  echo '  template <class T> T get(int i);                                         // 6'
  echo '  static Options opts() { return {1, 2}; }                                 // 7'
  echo '  void sample(std::uint64_t u) { live = std::max(live, u); }               // 8'
  echo '  friend void swap(Impl&, Impl&);'
  for i in $(seq 9 "$f"); do echo "  void h$i(int x);"; done
  echo '  class Out {'
  echo '   public:'
  echo '    void dest();'
  echo '   private:'
  echo '    int module_ = -1;'
  echo '  };'
  echo ' private:'
  for i in $(seq 12 "$1"); do echo "  double m$i = 0.5;  // \"; a string ; in a comment"; done
  echo '};'
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

# python/: the import graph, imports in functions, the extension's includes.
r=$(fresh cycle); printf 'from .engine import Engine\n' >>"$r/python/tiermem/torch/_units.py"
check fail import-cycle "$r"
r=$(fresh cycle_init); printf 'from tiermem.torch import Engine\n' >>"$r/python/tiermem/torch/_units.py"
check fail import-cycle "$r"
r=$(fresh cycle_fn); printf '\ndef late():\n    from . import engine\n    return engine\n' >>"$r/python/tiermem/torch/_units.py"
check fail import-cycle "$r"
check fail import-in-function "$r"
r=$(fresh fn_stdlib); printf '\nclass K:\n    def f(self):\n        import ctypes\n        return ctypes\n' >>"$r/python/tiermem/_leaf.py"
check fail import-in-function "$r"
r=$(fresh fn_torch); printf '\ndef f():\n    import torch.distributed as dist\n    return dist\n' >>"$r/python/tiermem/torch/_units.py"
check fail import-in-function "$r"
r=$(fresh fn_optional); printf '\ndef f():\n    from peft import PeftModel\n    import deepspeed, accelerate, trl\n    return PeftModel\n' >>"$r/python/tiermem/torch/_units.py"
check pass "" "$r"
r=$(fresh private_quoted); echo '#include "train/checkpoint.h"' >>"$r/python/src/m.cc"
check fail include-private "$r"
r=$(fresh private_angle); echo '#include <zero/zero_impl.h>' >>"$r/python/src/m.cc"
check fail include-private "$r"
r=$(fresh private_missing); echo '#include "checkpoint.h"' >>"$r/python/src/m.cc"
check fail include-private "$r"
# engine: ZeroEngine::Impl's data members.
r=$(fresh impl21); impl 21 >"$r/src/zero/zero_impl.h"
check fail impl-members "$r"
r=$(fresh impl_lambda); impl 20 | sed 's/^  double m12 = 0.5;.*/  Out out{[this] { return Out(); }()};  \/\/ an immediately called lambda: data/' >"$r/src/zero/zero_impl.h"
check pass "" "$r"
impl 20 | sed 's/^  Staging staging{/  Staging staging2{comm, [this](int) {}}, staging{/' >"$r/src/zero/zero_impl.h"
out=$("$py" "$checker" --root "$r" --allow /dev/null --only engine 2>&1)
grep -q ": impl-members: ZeroEngine::Impl has 21 data members .*staging2, staging," <<<"$out" \
  && echo "ok: a brace initialiser holding a lambda is a data member" || { echo "FAIL: lambda initialiser: $out"; fails=$((fails+1)); }
r=$(fresh impl26fn); impl 20 26 >"$r/src/zero/zero_impl.h"
check fail impl-functions "$r"
out=$("$py" "$checker" --root "$r" --allow /dev/null --only engine 2>&1)
grep -q "26 member functions > 25 (Impl, ~Impl, f, g, operator==, get, opts, sample, h9," <<<"$out" \
  && echo "ok: the member functions, named" || { echo "FAIL: member functions: $out"; fails=$((fails+1)); }
r=$(fresh impl_moved); rm "$r/src/zero/zero_impl.h"; impl 20 | sed 's/ZeroEngine::Impl/ZeroEngine::Body/' >"$r/src/zero/zero_engine.h"
check fail impl-members "$r"
r=$(fresh impl_elsewhere); mv "$r/src/zero/zero_impl.h" "$r/src/zero/zero_engine_impl.h"
check pass "" "$r"
# --only: a group's rules alone.
r=$(fresh only); impl 30 >"$r/src/zero/zero_impl.h"; long_function 200 >"$r/tools/x/long.cc"
out=$("$py" "$checker" --root "$r" --allow /dev/null --only python 2>&1) && echo "ok: --only python skips the others" \
  || { echo "FAIL: --only python: $out"; fails=$((fails+1)); }
out=$("$py" "$checker" --root "$r" --allow /dev/null --only engine 2>&1); grep -q ": impl-members:" <<<"$out" && ! grep -q ": function:" <<<"$out" \
  && echo "ok: --only engine" || { echo "FAIL: --only engine: $out"; fails=$((fails+1)); }

# api: a public header's declarations carry TIERMEM_API; what has no symbol of its own, and
# tiermem::detail, need not.
r=$(fresh api); mkdir -p "$r/include/tiermem"
cat >"$r/include/tiermem/a.h" <<'H'
#pragma once
#include "tiermem/export.h"
namespace tiermem {
class Device;                                   // a forward declaration
struct TIERMEM_API Options { int n = 1'000; static Options from(const char* s = "{"); };
class TIERMEM_API Engine final : public Base { public: void run(); struct Inner { void f(); }; };
enum class Kind : int { kA, kB };
using Id = unsigned;
inline constexpr int kMax = 4;
inline int twice(int x) { return 2 * x; }
template <typename T> T first(const T* p) { return p[0]; }
TIERMEM_API Engine make_engine(const Options& o = {});
[[nodiscard]] TIERMEM_API int count(Kind k);
namespace detail { void kernel(); struct State { void g(); }; }
}  // namespace tiermem
H
check pass "" "$r"
printf 'namespace tiermem {
int count_all();
}
' >"$r/include/tiermem/b.h"
check fail export "$r"
printf 'namespace tiermem {
struct Plan { int f() const; };
}
' >"$r/include/tiermem/b.h"
check fail export "$r"
printf 'namespace tiermem {
void f(const Options& o = {});
}
' >"$r/include/tiermem/b.h"
check fail export "$r"

[ $fails -eq 0 ] && echo "PASS: check-layout" || { echo "$fails check(s) failed"; exit 1; }
