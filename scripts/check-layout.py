#!/usr/bin/env python3
"""scripts/check-layout.py — the mechanical layout rules of design.md and style.md: src/ and tools/
(sizes, includes), python/ (the package's import graph, the extension's includes), the engine's
composition (ZeroEngine::Impl's data members) and what a shared libtiermem exports.

  scripts/check-layout.py [--root DIR] [--allow FILE] [--only GROUP,...]
      exit 0: clean; 1: violations (listed). GROUP: cpp (the first five rules), python
      (import-cycle, import-in-function, include-private), engine (impl-members, impl-functions),
      api (export); default all.

Rules (each violation is one line "path:line: rule: detail"):
  file-size    a source file (.cc .h .cu) under src/ or tools/ has more than 700 lines
  function     a function body (.cc .h .cu under src/ and tools/) spans more than 120 lines
  include-up   a file under src/ includes something under tools/ or examples/ (or bench/), or a
               private header of a folder above its own in design.md's dependency order
  include-bare a quoted include under src/ or tools/ names no folder ("train_loop.h"): private
               headers are included as "<folder>/<file>.h", public ones as "tiermem/<file>.h"
  allow-stale  an allow-list entry that exempts nothing (the file or function is now within limits)
  import-cycle modules under python/tiermem import each other in a cycle (one violation per
               strongly connected set of modules, with one cycle through it spelled out)
  import-in-function  an import inside a function (or lambda) under python/tiermem, other than of
               an optional third-party package named in OPTIONAL_PACKAGES below (with its reason)
  include-private  a file under python/src includes a private header of src/ ("zero/...",
               "train/...", or any quoted include that is neither "tiermem/..." nor a file
               beside it in python/src); the extension sees only include/tiermem/
  impl-members `struct ZeroEngine::Impl` (searched for in src/zero/) declares more than 20
               non-static data members, or is not found there at all
  impl-functions  `struct ZeroEngine::Impl` declares more than 25 member functions (constructors,
               operators, static and template ones included; those of nested types not)
  export       a class or struct defined, or a function or extern variable declared, at namespace
               scope of include/tiermem/*.h outside tiermem::detail lacks TIERMEM_API
               (tiermem/export.h): the libraries are compiled with hidden visibility, so a shared
               libtiermem would not export it. Not asked of inline, constexpr and template
               declarations, enums, aliases and forward declarations (no symbol of their own).

What the function scan detects, honestly: comments, string, raw-string and character literals
are blanked, preprocessor lines dropped, then braces are matched. A '{' opened at namespace or
class scope whose preceding text (since the last ';', '{' or '}') contains ')' and is not a
control statement is a function body; its length is from the line of the '{' to the line of the
matching '}'. Lambdas and local classes count toward the function holding them. Not detected: a
function whose body starts inside a macro, or a constructor whose member-initialiser list uses
braces (`a_{1}`) — its body is then not measured.

What the import graph detects, honestly (ast, no import is executed): every `import X` and
`from X import a` anywhere in a module under python/tiermem, relative ones resolved against the
module's package, is an edge to the in-tree module it names; `from P import a` names P.a when
P/a.py or P/a/__init__.py exists, else P itself. The cycle graph takes imports at every depth
(an import inside a function is a run-time edge too) but not those under `if TYPE_CHECKING:`
(annotations only, never executed). A package's __init__ is not counted as imported by its
submodules (Python runs it first, but that is how packages re-export, not a cycle). Not
detected: importlib.import_module / __import__ with computed names, imports run by exec.

What the member count detects, honestly: the struct's body with comments, literals and
preprocessor lines blanked; upper-case macro calls (TM_GUARDED_BY(mu)) dropped; then each
declaration at the body's own brace level, ended by ';' (or by the '}' of a function body):
  - a function: '(' before any top-level '=' or '{' and outside '<...>', or the word `operator`
    (declarations, definitions, constructors, operators, `= default` / `= delete`, static and
    template member functions); counted as a member function (impl-functions). A constructor's
    member-initialiser list may hold braces (`a{1}`): its body is the brace group after them;
  - a nested struct/class/union/enum, `using`, `typedef`, `friend`, `static_assert`, `static`
    data and `template` declarations: not counted (a declarator after a nested type's '}' is);
  - anything else is data: one member per top-level ',' separated declarator (commas inside
    '<>', '()', '{}' and '[]' do not split). A brace initialiser may hold anything, lambdas
    included (`staging{comm, [this](int u) { f(u); }}` is one data member: its '{' comes before
    any '('). Not detected: a default initialiser holding a bare top-level '<' or '>' comparison
    (miscounts the template depth), a member of function-pointer type written `R (*f)(A)` (taken
    for a function; use std::function or an alias).

The allow-list (default scripts/layout-allow.txt): one entry a line, "<path>" (a file over the
size limit), "<path>:<function>" (a function over the length limit) or "<path>:include:<header>"
(a bare include), then at least one word saying why. '#' starts a comment.
"""
import argparse
import ast
import os
import re
import sys

MAX_FILE_LINES = 700
MAX_FUNCTION_LINES = 120
SOURCE_EXTS = (".cc", ".h", ".cu")
SCAN_DIRS = ("src", "tools")
# design.md's dependency order, lowest first; a folder may include private headers of its own
# level or below. Folders on one level do not depend on each other (nvme, cpu, gpu; train, plan).
LEVELS = [{"core"}, {"nvme", "cpu", "gpu"}, {"prefetch"}, {"runtime"}, {"comm"}, {"zero"}, {"gpt"},
          {"train", "plan"}]
LEVEL_OF = {folder: i for i, level in enumerate(LEVELS) for folder in level}
NEVER_FROM_SRC = ("tools/", "examples/", "bench/")
CONTROL = re.compile(r"\b(if|for|while|switch|catch|do|else|return|sizeof|decltype|alignas)\s*$")
SCOPE_KEYWORD = re.compile(r"\b(namespace|class|struct|union|enum)\b")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def blank_literals(text):
    """Returns text with comments and string/char literals replaced by spaces (newlines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "R" and text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            k = text.find("(", i + 2)
            delim = ")" + text[i + 2:k] + '"'
            j = text.find(delim, k)
            j = n if j < 0 else j + len(delim)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"' or (c == "'" and not (i > 0 and text[i - 1].isalnum())):  # ' after a digit: 1'000
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def functions(text):
    """Yields (name, first_line, last_line) of each function body at namespace or class scope."""
    code = blank_literals(text)
    code = "\n".join("" if line.lstrip().startswith("#") else line for line in code.split("\n"))
    stack = []  # scope kinds: "scope" (namespace/class/initialiser), "func"
    header_start, line = 0, 1
    func_start = None
    for i, c in enumerate(code):
        if c == "\n":
            line += 1
        elif c in ";{}":
            header = code[header_start:i]
            if c == "{" and "func" not in [s[0] for s in stack]:
                flat = " ".join(header.split())
                is_func = (")" in flat and not SCOPE_KEYWORD.search(flat.split("(")[0])
                           and not CONTROL.search(flat.split("(")[0]) and not flat.endswith("="))
                if is_func:
                    before = flat.split("(")[0].split()
                    name = before[-1] if before else "?"
                    stack.append(("func", name, line))
                else:
                    stack.append(("scope", None, line))
            elif c == "{":
                stack.append(("block", None, line))
            elif c == "}" and stack:
                kind, name, start = stack.pop()
                if kind == "func":
                    yield name, start, line
            header_start = i + 1


def scan(root, allow):
    problems, used = [], set()
    for top in SCAN_DIRS:
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for f in sorted(files):
                if not f.endswith(SOURCE_EXTS):
                    continue
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, root)
                with open(path, encoding="utf-8", errors="replace") as fh:
                    text = fh.read()
                lines = text.count("\n") + (0 if text.endswith("\n") else 1)
                if lines > MAX_FILE_LINES:
                    if rel in allow:
                        used.add(rel)
                    else:
                        problems.append(f"{rel}:1: file-size: {lines} lines > {MAX_FILE_LINES}")
                for name, first, last in functions(text):
                    span = last - first + 1
                    if span > MAX_FUNCTION_LINES:
                        key = f"{rel}:{name}"
                        if key in allow:
                            used.add(key)
                        else:
                            problems.append(f"{rel}:{first}: function: {name} spans {span} lines > {MAX_FUNCTION_LINES}")
                problems += check_includes(rel, text, allow, used)
    for key in sorted(set(allow) - used):
        problems.append(f"{allow[key]}: allow-stale: '{key}' is within the limits (or gone): remove the entry")
    return problems


def check_includes(rel, text, allow, used):
    problems = []
    parts = rel.split(os.sep)
    folder = parts[1] if parts[0] == "src" and len(parts) > 2 else None
    for n, line in enumerate(text.split("\n"), 1):
        m = INCLUDE.match(line)
        if not m:
            continue
        inc = m.group(1)
        if "/" not in inc:
            key = f"{rel}:include:{inc}"
            if key in allow:
                used.add(key)
                continue
            problems.append(f"{rel}:{n}: include-bare: \"{inc}\" (write \"<folder>/{inc}\" or \"tiermem/{inc}\")")
            continue
        if parts[0] != "src":
            continue
        if inc.startswith(NEVER_FROM_SRC):
            problems.append(f"{rel}:{n}: include-up: src/ includes \"{inc}\"")
            continue
        target = inc.split("/")[0]
        if folder in LEVEL_OF and target in LEVEL_OF and target != folder:
            if LEVEL_OF[target] >= LEVEL_OF[folder]:
                problems.append(f"{rel}:{n}: include-up: src/{folder} includes \"{inc}\" "
                                f"(src/{target} is not below src/{folder} in design.md's order)")
    return problems


# --- python/: the package's import graph, the extension's includes --------------------------------

# Optional third-party packages a function under python/tiermem may import (at call time, so that
# tiermem imports without them): name -> (where: path prefixes under the root, empty = anywhere;
# why). Anything else imported inside a function is a cycle being hidden or an import to hoist.
OPTIONAL_PACKAGES = {
    "transformers": ((), "Hugging Face models/Trainer: only the paths that integrate with them"),
    "deepspeed": ((), "DeepSpeed interop (its configs and checkpoints); never required"),
    "peft": ((), "PEFT adapters over frozen bases: only when the model has them"),
    "accelerate": ((), "Hugging Face Accelerate: only when launched through it"),
    "trl": ((), "TRL trainers: only when the caller uses them"),
    "torch": (("python/tiermem/__init__.py",),
              "the base package works on numpy alone; torch only when a torch tensor comes in "
              "(tiermem.torch needs torch and imports it at module level)"),
}
PY_ROOT = os.path.join("python", "tiermem")
PY_SRC = os.path.join("python", "src")
INCLUDE_ANY = re.compile(r'^\s*#\s*include\s+([<"])([^">]+)[">]')


def python_modules(root):
    """{module name: relative path} of every .py file under python/tiermem."""
    mods = {}
    base = os.path.join(root, PY_ROOT)
    for dirpath, dirs, files in os.walk(base):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), root)
            parts = os.path.relpath(os.path.join(dirpath, f), os.path.join(root, "python"))[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = rel
    return mods


def is_type_checking(test):
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(tree):
    """Yields (node, in_function, under_type_checking) for every import statement of a module."""
    def walk(node, in_func, tc):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_func, tc
            elif isinstance(child, ast.If) and is_type_checking(child.test):
                for n in child.body:
                    yield from walk_one(n, in_func, True)
                for n in child.orelse:
                    yield from walk_one(n, in_func, tc)
                continue
            yield from walk(child, in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)), tc)

    def walk_one(n, in_func, tc):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            yield n, in_func, tc
        else:
            yield from walk(n, in_func or isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)), tc)

    yield from walk(tree, False, False)


def import_targets(node, module, is_package, mods):
    """The in-tree modules an import statement names (see the docstring), and the top-level name of
    what it imports ("" for a relative import: always in-tree)."""
    if isinstance(node, ast.Import):
        out = []
        for a in node.names:
            parts = a.name.split(".")
            for k in range(len(parts), 0, -1):
                if ".".join(parts[:k]) in mods:
                    out.append(".".join(parts[:k]))
                    break
        return out, node.names[0].name.split(".")[0]
    if node.level:
        pkg = module.split(".") if is_package else module.split(".")[:-1]
        pkg = pkg[:len(pkg) - (node.level - 1)] if node.level > 1 else pkg
        base = ".".join(pkg + ([node.module] if node.module else []))
        top = ""
    else:
        base, top = node.module, node.module.split(".")[0]
    out = []
    for a in node.names:
        sub = f"{base}.{a.name}"
        if sub in mods:
            out.append(sub)
        elif base in mods:
            out.append(base)
    return out, top


def check_python(root):
    problems = []
    mods = python_modules(root)
    edges = {m: {} for m in mods}  # module -> {target: first line}
    for mod, rel in mods.items():
        with open(os.path.join(root, rel), encoding="utf-8") as fh:
            try:
                tree = ast.parse(fh.read(), rel)
            except SyntaxError as e:
                problems.append(f"{rel}:{e.lineno}: import-cycle: does not parse: {e.msg}")
                continue
        is_package = rel.endswith("__init__.py")
        for node, in_func, tc in imports_of(tree):
            targets, top = import_targets(node, mod, is_package, mods)
            if in_func:
                where, _ = OPTIONAL_PACKAGES.get(top, (None, None))
                allowed = top and top != "tiermem" and where is not None and (
                    not where or any(rel.startswith(w) for w in where))
                if not allowed:
                    what = ast.unparse(node)
                    problems.append(f"{rel}:{node.lineno}: import-in-function: {what} (hoist it to the "
                                    f"module's top; a cycle it hides goes through a leaf module)")
            if tc:
                continue
            for t in targets:
                if t != mod:
                    edges[mod].setdefault(t, node.lineno)
    for scc in strongly_connected(edges):
        start = min(scc)
        cycle = cycle_through(edges, scc, start)
        rel = mods[start]
        line = edges[start][cycle[1]]
        problems.append(f"{rel}:{line}: import-cycle: {' -> '.join(cycle)} "
                        f"(modules in the cycle: {', '.join(sorted(scc))})")
    return problems


def strongly_connected(edges):
    """Tarjan's strongly connected components of more than one module, each sorted, in order."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def cycle_through(edges, scc, start):
    """A shortest cycle from start back to start inside scc, as a list of modules (start twice)."""
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v]):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return list(reversed(path)) + [start]
                if w in scc and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start, start]


def check_python_includes(root):
    problems = []
    src_folders = {d for d in os.listdir(os.path.join(root, "src"))
                   if os.path.isdir(os.path.join(root, "src", d))} if os.path.isdir(os.path.join(root, "src")) else set()
    base = os.path.join(root, PY_SRC)
    if not os.path.isdir(base):
        return problems
    for dirpath, _, files in os.walk(base):
        for f in sorted(files):
            if not f.endswith(SOURCE_EXTS):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, root)
            with open(path, encoding="utf-8", errors="replace") as fh:
                text = fh.read()
            code = blank_comments(text)
            for n, line in enumerate(code.split("\n"), 1):
                m = INCLUDE_ANY.match(line)
                if not m:
                    continue
                quote, inc = m.groups()
                first = inc.split("/")[0]
                if inc.startswith("tiermem/"):
                    continue
                if quote == '"' and os.path.exists(os.path.join(dirpath, inc)):
                    continue
                if quote == "<" and first not in src_folders:
                    continue
                problems.append(f"{rel}:{n}: include-private: \"{inc}\" is not a public header "
                                f"(python/src includes \"tiermem/...\" from include/, or its own files)")
    return problems


def blank_comments(text):
    """text with comments blanked and string literals kept (an #include's "path" must survive)."""
    out = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", out)


# --- engine: ZeroEngine::Impl is a composition ----------------------------------------------------

MAX_IMPL_MEMBERS = 20
MAX_IMPL_FUNCTIONS = 25
IMPL_DEF = re.compile(r"\b(?:struct|class)\s+ZeroEngine::Impl\b[^;{]*\{")
MACRO_CALL = re.compile(r"\b[A-Z][A-Z0-9_]*\s*\((?:[^()]|\([^()]*\))*\)")
NOT_DATA = re.compile(r"^(?:using|typedef|friend|static_assert|static|template)\b|"
                      r"\b(?:struct|class|union|enum)\b")


def split_top(text, sep):
    """Splits at `sep` characters outside (), [], {} and <>; returns the parts."""
    parts, depth, cur = [], 0, []
    for c in text:
        if c in "([{<":
            depth += 1
        elif c in ")]}>" and depth:
            depth -= 1
        if c == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return parts


def paren_before_assign(decl):
    """True when decl has a '(' outside '<>' before any top-level '=' or '{': a function (as is
    any `operator...`, whose name may hold '=' or '<'). A '{' first is a brace initialiser, which
    may hold a lambda's parentheses."""
    if re.search(r"\boperator\b", decl):
        return True
    angle = 0
    for c in decl:
        if c == "<":
            angle += 1
        elif c == ">" and angle:
            angle -= 1
        elif c in "={" and angle == 0:
            return False
        elif c == "(" and angle == 0:
            return True
    return False


def function_name(decl):
    """The name a function declaration declares: `operator...`, or the word before its '('."""
    m = re.search(r"\boperator\b\s*(\(\)|[^(\s]*)", decl)
    if m:
        return "operator" + m.group(1)
    angle = 0
    for k, c in enumerate(decl):
        if c == "<":
            angle += 1
        elif c == ">" and angle:
            angle -= 1
        elif c == "(" and angle == 0:
            names = re.findall(r"~?[A-Za-z_]\w*", decl[:k])
            return names[-1] if names else "?"
    return "?"


NOT_FUNCTION = re.compile(r"^(?:using|typedef|friend|static_assert)\b")
CTOR_INIT = re.compile(r"\)\s*(?:noexcept\s*)?:(?!:)")


def impl_members(body):
    """The members declared in a class body (its text between the braces): ([(line, name)] of the
    data members, [(line, name)] of the member functions)."""
    code = blank_literals(body)
    code = "\n".join("" if line.lstrip().startswith("#") else line for line in code.split("\n"))
    code = MACRO_CALL.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), code)
    code = re.sub(r"\b(public|private|protected)\s*:(?!:)", lambda m: " " * len(m.group(0)), code)
    members, funcs, start, i, n, line = [], [], 0, 0, len(code), 1
    after_type = False  # the declaration under way follows a nested type's '}'
    paren = 0  # '{' inside parentheses (a default argument `= {}`) is not a body

    def declarators(decl, at):
        flat = " ".join(decl.split())
        if not flat:
            return
        for d in split_top(flat, ","):
            names = re.findall(r"[A-Za-z_]\w*", d.split("=")[0].split("{")[0].split("[")[0])
            members.append((at, names[-1] if names else "?"))

    def match(k):  # the index of the '}' closing the '{' at k
        depth = 0
        while k < n:
            if code[k] == "{":
                depth += 1
            elif code[k] == "}":
                depth -= 1
                if depth == 0:
                    break
            k += 1
        return k

    def next_char(k):  # the index of the next non-space character from k
        while k < n and code[k].isspace():
            k += 1
        return k

    while i < n:
        c = code[i]
        if c in "()":
            paren = max(0, paren + (1 if c == "(" else -1))
        elif paren:
            pass
        elif c == ";":
            decl = code[start:i]
            flat = " ".join(decl.split())
            if after_type:
                declarators(flat, line)
            elif flat and paren_before_assign(flat):
                if not NOT_FUNCTION.search(flat):
                    funcs.append((line, function_name(flat)))
            elif flat and not NOT_DATA.search(flat.split("=")[0]):
                declarators(flat, line)
            after_type = False
            start = i + 1
        elif c == "{":
            header = " ".join(code[start:i].split())
            j = match(i)
            if paren_before_assign(header) and not header.startswith("=") and "=" not in header.split("(")[0]:
                funcs.append((line, function_name(header)))
                if CTOR_INIT.search(header):  # braces in a member-initialiser list: the body follows
                    while True:
                        k = next_char(j + 1)
                        if k < n and code[k] == "{":  # the body, after an initialiser's braces
                            j = match(k)
                            break
                        if k < n and code[k] == ",":  # more initialisers: the next brace group
                            depth, k2 = 0, k
                            while k2 < n and not (code[k2] == "{" and depth == 0):
                                depth += {"(": 1, ")": -1}.get(code[k2], 0)
                                k2 += 1
                            j = match(k2)
                            continue
                        break
                start = j + 1  # a function body: the declaration ends here
            elif NOT_DATA.search(header) and "=" not in header and not after_type:
                after_type = True  # nested type: what follows up to ';' declares members, if anything
                start = j + 1
            # else: a brace initialiser; the declaration goes on to its ';'
            line += code[i:j].count("\n")
            i = j + 1
            continue
        if c == "\n":
            line += 1
        i += 1
    return members, funcs


def check_impl(root):
    base = os.path.join(root, "src", "zero")
    for dirpath, _, files in os.walk(base):
        for f in sorted(files):
            if not f.endswith(SOURCE_EXTS):
                continue
            path = os.path.join(dirpath, f)
            with open(path, encoding="utf-8", errors="replace") as fh:
                text = fh.read()
            m = IMPL_DEF.search(blank_literals(text))
            if not m:
                continue
            rel = os.path.relpath(path, root)
            open_at = m.end() - 1
            depth, j = 0, open_at
            code = blank_literals(text)
            while j < len(code):
                if code[j] == "{":
                    depth += 1
                elif code[j] == "}":
                    depth -= 1
                    if depth == 0:
                        break
                j += 1
            first = text.count("\n", 0, open_at) + 1
            members, funcs = impl_members(text[open_at + 1:j])
            problems = []
            if len(members) > MAX_IMPL_MEMBERS:
                names = ", ".join(name for _, name in members)
                problems.append(f"{rel}:{first}: impl-members: ZeroEngine::Impl has {len(members)} data members > "
                                f"{MAX_IMPL_MEMBERS} ({names})")
            if len(funcs) > MAX_IMPL_FUNCTIONS:
                names = ", ".join(name for _, name in funcs)
                problems.append(f"{rel}:{first}: impl-functions: ZeroEngine::Impl has {len(funcs)} member functions > "
                                f"{MAX_IMPL_FUNCTIONS} ({names})")
            return problems
    return [f"src/zero:1: impl-members: no `struct ZeroEngine::Impl {{` definition found under src/zero "
            f"(the rule counts its data members; update the checker if it moved)"]


# --- api: what a shared libtiermem exports ------------------------------------------------------

API_EXEMPT = re.compile(r"^(?:TIERMEM_API|inline|constexpr|consteval|template|static|using|typedef|"
                        r"enum|friend|static_assert|extern\s+template)\b")


def api_declaration(decl, ends_with):
    """What `decl` (a namespace-scope statement, up to its first '{' or ';') must export: "class",
    "function", "variable" or None."""
    decl = re.sub(r"^(?:\[\[.*?\]\]\s*)+", "", decl)
    if API_EXEMPT.match(decl):
        return None
    m = re.match(r"(?:class|struct|union)\s+(\w+)", decl)
    if m:
        return "class" if ends_with == "{" and m.group(1) != "TIERMEM_API" else None
    if decl.startswith("extern"):
        return "variable" if ends_with == ";" else None
    return "function" if "(" in decl else None


def check_api(root):
    inc = os.path.join(root, "include", "tiermem")
    if not os.path.isdir(inc):
        return []
    problems = []
    for name in sorted(os.listdir(inc)):
        if not name.endswith(".h"):
            continue
        with open(os.path.join(inc, name), encoding="utf-8", errors="replace") as fh:
            text = blank_literals(fh.read())
        text = re.sub(r"(?m)^[ \t]*#.*$", lambda m: " " * len(m.group(0)), text)  # preprocessor
        scopes, stmt, line, start = [], "", 1, None  # scopes: a namespace's name, or None
        for ch in text:
            if ch == "\n":
                line += 1
            if ch in "{;":
                decl = " ".join(stmt.split())
                ns = re.match(r"namespace\s+([\w:]+)\s*$", decl) if ch == "{" else None
                public = scopes and None not in scopes and "detail" not in "::".join(scopes).split("::")
                kind = api_declaration(decl, ch) if public and decl else None
                if kind:
                    problems.append(f"include/tiermem/{name}:{start}: export: {kind} without "
                                    f"TIERMEM_API: {decl[:70]}")
                if ch == "{":
                    scopes.append(ns.group(1) if ns else None)
                stmt, start = "", None
            elif ch == "}":
                if scopes:
                    scopes.pop()
                stmt, start = "", None
            else:
                if start is None and not ch.isspace():
                    start = line
                stmt += ch
    return problems


def load_allow(path):
    allow = {}
    if not os.path.exists(path):
        return allow
    with open(path, encoding="utf-8") as fh:
        for n, raw in enumerate(fh, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            fields = line.split(None, 1)
            if len(fields) < 2:
                sys.exit(f"{path}:{n}: an allow-list entry needs a reason after the name: {line!r}")
            allow[fields[0]] = f"{os.path.basename(path)}:{n}"
    return allow


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=os.path.dirname(here))
    ap.add_argument("--allow", default=None, help="allow-list (default <root>/scripts/layout-allow.txt)")
    ap.add_argument("--only", default="cpp,python,engine,api", help="rule groups: cpp, python, engine, api")
    a = ap.parse_args()
    groups = set(a.only.split(","))
    if groups - {"cpp", "python", "engine", "api"}:
        ap.error(f"--only: unknown group(s) {sorted(groups - {'cpp', 'python', 'engine', 'api'})}")
    allow = load_allow(a.allow or os.path.join(a.root, "scripts", "layout-allow.txt"))
    problems = []
    if "cpp" in groups:
        problems += scan(a.root, allow)
    if "python" in groups:
        problems += check_python(a.root) + check_python_includes(a.root)
    if "engine" in groups:
        problems += check_impl(a.root)
    if "api" in groups:
        problems += check_api(a.root)
    for p in problems:
        print(p)
    if problems:
        print(f"check-layout: {len(problems)} violation(s)")
        return 1
    print("check-layout: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
