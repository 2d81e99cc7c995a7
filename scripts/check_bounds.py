#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The house's size bounds on the library's headers (include/cupipe): no file over 600 lines, no
function body over 80, and Pipeline's front (pipeline/pipeline.hpp) at 400 at most.

A file or function already over its bound when the bound was set is listed in docs/bounds.txt
with its size then: it may shrink but not grow, and a listed one that is back under its bound
must leave the list (so the list only gets shorter). Anything else over a bound fails.

    python3 scripts/check_bounds.py [repository root]      exit 0: every bound holds
    python3 scripts/check_bounds.py --list [root]          every file and function over a bound
    python3 scripts/check_bounds.py --self-test            the checker against made-up trees

A function is a brace block opened, at namespace or class scope, right after a parameter list's
`)` (and its qualifiers); lambdas and blocks inside a body count toward that body. Comments and
string literals are blanked first.
"""
import os
import re
import sys

FILE_LINES = 600
FUNCTION_LINES = 80
FRONT = ("include/cupipe/pipeline/pipeline.hpp", 400)


def blank(text):
    """Comments and string/char literals replaced by spaces; newlines kept."""
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
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif text.startswith('R"', i):
            m = re.match(r'R"([^(]*)\(', text[i:])
            end = text.find(")" + m.group(1) + '"', i) if m else -1
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
            i = j
        elif c in "\"'":
            if c == "'" and i > 0 and (text[i - 1].isalnum()):  # digit separator: 1'000
                out.append(c)
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(c + " " * (min(j, n) - i - 1) + (c if j < n else ""))
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


CONTROL = re.compile(r"\b(if|for|while|switch|catch|do|else|try)\b")


NOT_NAMES = {"requires", "noexcept", "decltype", "__launch_bounds__", "alignas", "sizeof", "explicit", "throw"}


def function_name(head):
    """The name before a function head's parameter list: the last top-level parenthesised group
    that is not a qualifier's (requires, noexcept, ...) and comes before a constructor's `:` list."""
    depth, groups, start = 0, [], 0
    for i, c in enumerate(head):
        if c == "(":
            if depth == 0:
                start = i
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                groups.append((start, i))
        elif c == ":" and depth == 0 and groups and head[groups[-1][1] + 1:i].strip() == "" and head[i:i + 2] != "::" \
                and head[i - 1] != ":":
            break  # a constructor's member initialisers follow
    for begin, _ in reversed(groups):
        m = re.search(r"(operator\s*\S+?|~?\w+)\s*$", head[:begin])
        if m and m.group(1) not in NOT_NAMES:
            return m.group(1)
    return "?"


def functions(text):
    """(name, first line, line count) of every function body at namespace or class scope."""
    code = blank(text)
    found, stack = [], []  # stack: (kind, start line, name)
    line, head_start = 1, 0
    for i, c in enumerate(code):
        if c == "\n":
            line += 1
        elif c == "{":
            head = code[head_start:i]
            outer = stack[-1][0] if stack else "namespace"
            if outer in ("function", "block"):
                kind, name = "block", ""
            elif re.search(r"\bnamespace\b", head) or re.search(r'\bextern\s*$', head):
                kind, name = "namespace", ""
            elif re.search(r"\b(class|struct|union|enum)\b", head) and "(" not in head.split("=")[0].split(":")[0]:
                kind, name = "class", ""
            elif ")" in head and not CONTROL.search(head.split("(")[0]) and not re.search(r"=\s*[^=]*$", head.split(")")[0]):
                kind, name = "function", function_name(head)
            else:
                kind, name = "block", ""
            stack.append((kind, line, name))
            head_start = i + 1
        elif c == "}":
            if stack:
                kind, start, name = stack.pop()
                if kind == "function":
                    found.append((name, start, line - start + 1))
            head_start = i + 1
        elif c == ";":
            head_start = i + 1
    return found


def measure(root):
    """{key: size} of everything over its bound: 'file:path' and 'function:path:name'."""
    over = {}
    base = os.path.join(root, "include", "cupipe")
    for folder, _, names in os.walk(base):
        for name in sorted(names):
            if not name.endswith((".hpp", ".cuh", ".h")):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            text = open(path, encoding="utf-8").read()
            lines = text.count("\n")
            limit = FRONT[1] if rel == FRONT[0] else FILE_LINES
            if lines > limit:
                over["file:" + rel] = lines
            for fn, _, count in functions(text):
                if count > FUNCTION_LINES:
                    key = "function:%s:%s" % (rel, fn)
                    over[key] = max(over.get(key, 0), count)
    return over


def allowed(root):
    table = {}
    path = os.path.join(root, "docs", "bounds.txt")
    if not os.path.exists(path):
        return table
    for raw in open(path, encoding="utf-8"):
        text = raw.split("#", 1)[0].strip()
        if text:
            key, size = text.rsplit(None, 1)
            table[key] = int(size)
    return table


def self_test():
    """Made-up trees: an oversize header and function fail, an allowed one may shrink but not grow,
    and an allowed one back under its bound must leave the list."""
    import tempfile

    def tree(body_lines, file_lines, allow):
        root = tempfile.mkdtemp()
        os.makedirs(os.path.join(root, "include", "cupipe", "x"))
        os.makedirs(os.path.join(root, "docs"))
        body = "".join("  int v%d = %d;  // { not a brace\n" % (i, i) for i in range(body_lines))
        text = ("namespace cupipe {\nstruct S {\n  template <class T>\n  int f(T t) const\n"
                "    requires(sizeof(T) > 0)\n  {\n" + body + "    return 0;\n  }\n};\n}\n")
        text += "// filler\n" * max(0, file_lines - text.count("\n"))
        open(os.path.join(root, "include", "cupipe", "x", "a.hpp"), "w").write(text)
        open(os.path.join(root, "docs", "bounds.txt"), "w").write("".join("%s %d\n" % kv for kv in allow.items()))
        return root

    def run(root):
        import contextlib
        import io
        with contextlib.redirect_stdout(io.StringIO()):
            return main([root])

    fn, fl = "function:include/cupipe/x/a.hpp:f", "file:include/cupipe/x/a.hpp"
    cases = [
        ("within bounds", tree(70, 100, {}), 0),
        ("a long function", tree(90, 200, {}), 1),
        ("a long file", tree(10, 650, {}), 1),
        ("an allowed function", tree(90, 200, {fn: 95}), 0),
        ("an allowed function grown", tree(90, 200, {fn: 85}), 1),
        ("an allowed function back under", tree(60, 200, {fn: 95}), 1),
        ("an allowed file grown", tree(10, 700, {fl: 650}), 1),
    ]
    bad = [name for name, root, want in cases if run(root) != want]
    found = measure(cases[1][1])
    if fn not in found or not 90 <= found[fn] <= 96:
        bad.append("the long function measured as %r" % found)
    for name in bad:
        print("check_bounds self-test failed: " + name)
    print("check_bounds self-test: %d of %d cases right" % (len(cases) + 1 - len(bad), len(cases) + 1))
    return 1 if bad else 0


def main(argv):
    if "--self-test" in argv:
        return self_test()
    listing = "--list" in argv
    args = [a for a in argv if a != "--list"]
    root = os.path.abspath(args[0] if args else os.path.join(os.path.dirname(__file__), ".."))
    over = measure(root)
    if listing:
        for key, size in sorted(over.items()):
            print(size, key)
        return 0
    table, failures = allowed(root), []
    for key, size in sorted(over.items()):
        if key not in table:
            failures.append("%s is %d lines, over its bound (%s)" % (key, size, "file" if key.startswith("file") else "function"))
        elif size > table[key]:
            failures.append("%s grew to %d lines from the %d docs/bounds.txt allows; it may only shrink" % (key, size, table[key]))
    for key in sorted(set(table) - set(over)):
        failures.append("%s is back under its bound: take it off docs/bounds.txt" % key)
    for f in failures:
        print("check_bounds: " + f)
    if not failures:
        print("check_bounds: every bound holds (%d known exceptions left in docs/bounds.txt)" % len(table))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
