#!/usr/bin/env python3
"""scripts/check-docs-map.py — docs/architecture.md, the map, cannot drift from the tree: every
path, file and code symbol it names in backticks must exist.

  scripts/check-docs-map.py [--root DIR] [--doc FILE]
      exit 0: clean; 1: names that do not exist (listed, "doc:line: kind: `name` ...").

What counts as named (inline code spans, `...`, outside fenced ``` blocks; the rest is prose):
  path    a span with a '/' or ending in a file extension (.cc .h .cu .py .cmake .sh .md .json .txt
          .in .toml): it exists when some file (or, ending in '/', some folder) of the tree has that
          path or ends with '/' + it — the map writes `zero/gatherer.cc` under src/, `_unit.py`
          under python/tiermem/torch. `<word>` and `*` are wildcards (`tests/unit/<subsystem>.cmake`);
          a lone extension (`.h`, the header beside a source), paths under build/, a home
          directory (`~/...`) or a placeholder made at run time (`<path>/rank<r>`) are not files
          of the tree. A path without a trailing '/' may name a folder (`src/train`).
  symbol  a span that is a dotted or `::` name of identifiers, optionally called (`Unit.gather`,
          `ZeroEngine::gather`, `publish_whole_modules`, `set_learning_rate()`), and looks like
          code: it holds `::`, a '.', an '_', or a capital after its first letter (`TensorStore`).
          It exists when each of its identifiers is a word of the tree's sources, and, for a
          qualified name, its last two identifiers occur in one source file together (a class
          and its member). Dotted names whose first part is a config section (`tiermem.`,
          `zero_optimization.`, `optimizer.`, `aio.`, ...) are config keys: their words are
          checked like any symbol's, so a key that no source reads is caught too.
  Not checked: spans with spaces or other characters (commands, values like `"auto"`, `-O2`),
  all-lowercase single words without '_' (`step`, `gather`: too common to prove anything), and
  links' targets other than backticked (a markdown link [x](zero.md) is a path, checked too).

The sources searched for words: every file under src/, include/, python/, tools/, bench/,
examples/, tests/, scripts/, cmake/ with a source extension, and the top-level CMakeLists.txt
and Makefile. Files: the whole tree, without .git, build*/ and __pycache__.
"""
import argparse
import os
import re
import sys

EXTS = (".cc", ".h", ".cu", ".py", ".cmake", ".sh", ".md", ".json", ".txt", ".in", ".toml")
SOURCE_EXTS = (".cc", ".h", ".cu", ".py", ".cmake", ".sh", ".txt", ".in", ".toml")
SOURCE_DIRS = ("src", "include", "python", "tools", "bench", "examples", "tests", "scripts", "cmake")
SKIP_DIRS = {".git", "__pycache__", "node_modules"}
SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
IDENT = r"~?[A-Za-z_][A-Za-z0-9_]*"
SYMBOL = re.compile(rf"^{IDENT}(?:(?:::|\.){IDENT})*(?:\(\))?$")
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def tree_files(root):
    out = []
    for dirpath, dirs, files in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not (rel_dir == "." and d.startswith("build")))
        for f in files:
            out.append(os.path.normpath(os.path.join(rel_dir, f)).replace(os.sep, "/"))
    return out


def source_words(root, files):
    """{word: set of files} over the sources."""
    words = {}
    for rel in files:
        top = rel.split("/")[0]
        if not ((top in SOURCE_DIRS and rel.endswith(SOURCE_EXTS)) or rel in ("CMakeLists.txt", "Makefile")):
            continue
        if top == "python" and rel.endswith(".md"):
            continue
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as fh:
            for w in set(WORD.findall(fh.read())):
                words.setdefault(w, set()).add(rel)
    return words


def path_pattern(name):
    """A regex matching a tree path that is `name` or ends with '/' + name (wildcards as above)."""
    parts = re.split(r"(<[^>]*>|\*)", name)
    body = "".join("[^/]+" if p.startswith("<") else "[^/]*" if p == "*" else re.escape(p) for p in parts)
    return re.compile(rf"(?:^|.*/){body}" + ("" if name.endswith("/") else "$"))


def is_path(span):
    return "/" in span or span.endswith(EXTS)


def check_path(name, files, dirs):
    if name.startswith(("build/", "~", "$", "/", "<")) or re.fullmatch(r"\.\w+", name):
        return True  # a build output, a place outside the tree or made at run time, a lone extension
    if " " in name or name.startswith("-"):
        return True  # a command line, not a path
    name = name.rstrip(":,")
    if name.endswith("/"):
        return any(path_pattern(name).match(d) for d in dirs)
    pat, as_dir = path_pattern(name), path_pattern(name + "/")
    return any(pat.match(p) for p in files) or any(as_dir.match(d) for d in dirs)


def looks_like_code(span):
    base = span[:-2] if span.endswith("()") else span
    if "::" in base or "." in base or "_" in base:
        return True
    return bool(re.search(r"^.[a-z0-9]*[A-Z]", base))


def check_symbol(name, words):
    base = name[:-2] if name.endswith("()") else name
    idents = [p.lstrip("~") for p in re.split(r"::|\.", base)]
    missing = [i for i in idents if i not in words]
    if missing:
        return f"{', '.join(missing)} not in the sources"
    if len(idents) >= 2 and not (words[idents[-2]] & words[idents[-1]]):
        return f"{idents[-2]} and {idents[-1]} never in one source file"
    return None


def check(root, doc):
    files = tree_files(root)
    dirs = sorted({f.rsplit("/", 1)[0] + "/" for f in files if "/" in f} |
                  {"/".join(f.split("/")[:k]) + "/" for f in files for k in range(1, f.count("/"))})
    words = source_words(root, files)
    doc_dir = os.path.relpath(os.path.dirname(os.path.join(root, doc)), root)
    problems = []
    fenced = False
    with open(os.path.join(root, doc), encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    for n, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):
                continue  # a URL
            rel = os.path.normpath(os.path.join(doc_dir, target)).replace(os.sep, "/")
            if not (os.path.exists(os.path.join(root, rel))):
                problems.append(f"{doc}:{n}: link: ({target}) is not a file or folder of the tree")
        for span in SPAN.findall(line):
            span = span.strip()
            if is_path(span):
                if not check_path(span, files, dirs):
                    problems.append(f"{doc}:{n}: path: `{span}` matches no file of the tree")
            elif SYMBOL.match(span) and looks_like_code(span):
                why = check_symbol(span, words)
                if why:
                    problems.append(f"{doc}:{n}: symbol: `{span}`: {why}")
    return problems


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=os.path.dirname(here))
    ap.add_argument("--doc", default="docs/architecture.md", help="the map, relative to the root")
    a = ap.parse_args()
    problems = check(a.root, a.doc)
    for p in problems:
        print(p)
    if problems:
        print(f"check-docs-map: {len(problems)} name(s) in {a.doc} that the tree does not have")
        return 1
    print(f"check-docs-map: ok ({a.doc})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
