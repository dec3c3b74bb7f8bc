#!/usr/bin/env python3
"""scripts/check-layout.py — the mechanical layout rules of design.md, checked over src/ and tools/.

  scripts/check-layout.py [--root DIR] [--allow FILE]     exit 0: clean; 1: violations (listed)

Rules (each violation is one line "path:line: rule: detail"):
  file-size    a source file (.cc .h .cu) under src/ or tools/ has more than 700 lines
  function     a function body (.cc .h .cu under src/ and tools/) spans more than 120 lines
  include-up   a file under src/ includes something under tools/ or examples/ (or bench/), or a
               private header of a folder above its own in design.md's dependency order
  include-bare a quoted include under src/ or tools/ names no folder ("train_loop.h"): private
               headers are included as "<folder>/<file>.h", public ones as "tiermem/<file>.h"
  allow-stale  an allow-list entry that exempts nothing (the file or function is now within limits)

What the function scan detects, honestly: comments, string, raw-string and character literals
are blanked, preprocessor lines dropped, then braces are matched. A '{' opened at namespace or
class scope whose preceding text (since the last ';', '{' or '}') contains ')' and is not a
control statement is a function body; its length is from the line of the '{' to the line of the
matching '}'. Lambdas and local classes count toward the function holding them. Not detected: a
function whose body starts inside a macro, or a constructor whose member-initialiser list uses
braces (`a_{1}`) — its body is then not measured.

The allow-list (default scripts/layout-allow.txt): one entry a line, "<path>" (a file over the
size limit), "<path>:<function>" (a function over the length limit) or "<path>:include:<header>"
(a bare include), then at least one word saying why. '#' starts a comment.
"""
import argparse
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
    a = ap.parse_args()
    allow = load_allow(a.allow or os.path.join(a.root, "scripts", "layout-allow.txt"))
    problems = scan(a.root, allow)
    for p in problems:
        print(p)
    if problems:
        print(f"check-layout: {len(problems)} violation(s)")
        return 1
    print("check-layout: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
