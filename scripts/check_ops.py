#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""docs/ops.md's table of ops, checked against the code, so that the one place that names every op
stays true: an op is found in one hop, from its row, and not by following argument-dependent lookup
through the headers.

    python3 scripts/check_ops.py [repository root]    exit 0: the table and the code agree
    python3 scripts/check_ops.py --list [root]        every op overload the code defines, by backend
    python3 scripts/check_ops.py --self-test          the checker against made-up trees

An op overload is a function at namespace scope, in a namespace that argument-dependent lookup on
a backend searches (exactly `cupipe::ops` or `cupipe::backend`, not one nested in them), whose first parameter
is a backend: a class derived from ops::Dispatch (backend::Host, backend::Cuda) or an alias of one
(HostBf16). The table has one row per op, with the columns
    op | checks | host | CUDA wrapper | kernels | called by
Paths are under include/cupipe/ (or, failing that, the repository root); a cell that starts with
"—" names nothing, and text in parentheses is a note the checker skips. It fails, naming the row,
when:
- an overload in the code has no row, or its file is not named in its backend's column;
- a file named in the table does not exist;
- a backend column names a file without an overload of the row's op on that backend;
- a checks function `file: name` is not defined in the file, or a backend that claims the op calls
  none of the row's checks (`checks::name(`) in any file of its folder;
- a kernel `file: name` is not a `__global__` function of the file (a Capitalised name: a functor,
  `struct Name`), or a library call `Library file: name` is not called there;
- a file in "called by" does not call the op;
- an op has two rows, or a row no overload.
Comments and string literals are blanked first (scripts/check_bounds.py's blank).
"""
import bisect
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_bounds import blank  # noqa: E402  (comments and literals as spaces, newlines kept)

TABLE = os.path.join("docs", "ops.md")
COLUMNS = ("op", "checks", "host", "CUDA wrapper", "kernels", "called by")
BACKEND_COLUMNS = {"Host": "host", "Cuda": "CUDA wrapper"}  # backend class -> its column
SOURCES = (".hpp", ".cuh", ".h")
PATH = r"[\w./-]+\.(?:hpp|cuh|h|cpp|cu)"
NOT_NAMES = {"requires", "decltype", "sizeof", "noexcept", "static_assert", "alignof"}
NOT_TYPES = {"return", "else", "throw", "case", "co_return", "new", "delete"}


def sources(root):
    """{repository-relative path: text} of the library's headers."""
    found = {}
    for folder, _, names in os.walk(os.path.join(root, "include", "cupipe")):
        for name in sorted(names):
            if name.endswith(SOURCES):
                path = os.path.join(folder, name)
                found[os.path.relpath(path, root)] = open(path, encoding="utf-8").read()
    return found


def scopes(code):
    """(brace positions, the scope stack after each): a namespace's name ('a::b'), or None for any
    other block (class, function, initialiser)."""
    positions, stacks, stack, head_start = [], [], [], 0
    for i, c in enumerate(code):
        if c == "{":
            m = re.search(r"\bnamespace\s*([\w:]*)\s*$", code[head_start:i])
            stack = stack + [m.group(1) if m else None]
            positions.append(i)
            stacks.append(stack)
            head_start = i + 1
        elif c == "}":
            stack = stack[:-1]
            positions.append(i)
            stacks.append(stack)
            head_start = i + 1
        elif c == ";":
            head_start = i + 1
    return positions, stacks


def op_namespace(stack):
    """Whether a position with this scope stack is where an op lives: namespace scope only, in a
    namespace ADL on a backend searches, outside every detail namespace."""
    if any(entry is None for entry in stack):
        return False
    names = [n for full in stack for n in full.split("::")]
    if any(n == "detail" or n.endswith("_detail") for n in names):
        return False
    # ADL on backend::Host or backend::Cuda searches the class's namespace and its base's
    # (ops::Dispatch): cupipe::backend and cupipe::ops, not the namespaces nested in them.
    return names[-2:] in (["cupipe", "ops"], ["cupipe", "backend"])


def backends(texts):
    """{type name as written in a signature: backend class}: the Dispatch-derived classes and their aliases."""
    found = {}
    for text in texts.values():
        for m in re.finditer(r"\b(?:class|struct)\s+(\w+)\s*(?:final\s*)?:\s*(?:public\s+)?(?:cupipe::)?(?:ops::)?Dispatch\b", text):
            found[m.group(1)] = m.group(1)
    for text in texts.values():
        for m in re.finditer(r"\busing\s+(\w+)\s*=\s*(?:cupipe::)?(?:backend::)?(\w+)\s*<", text):
            if m.group(2) in found:
                found[m.group(1)] = m.group(2)
    return found


def overloads(texts, kinds, code_of=lambda path, text: blank(text)):
    """{op: {backend class: {path, ...}}} of every op overload in the headers."""
    if not kinds:
        return {}
    classes = "|".join(sorted(k for k, v in kinds.items() if k == v))
    aliases = "|".join(sorted(k for k, v in kinds.items() if k != v))
    typ = r"(?:cupipe::)?(?:backend::)?(?P<backend>%s)\b(?:\s*<[^<>()]*(?:<[^<>()]*>[^<>()]*)*>)?" % classes
    if aliases:
        typ = r"(?:%s|(?P<alias>%s)\b)" % (typ, aliases)
    signature = re.compile(r"\b(?P<op>[A-Za-z_]\w*)\s*\(\s*(?:const\s+)?%s\s*&" % typ)
    found = {}
    for path, text in texts.items():
        if not signature.search(text):
            continue
        code = code_of(path, text)
        positions, stacks = scopes(code)
        for m in signature.finditer(code):
            if m.group("op") in NOT_NAMES:
                continue
            at = bisect.bisect_left(positions, m.start()) - 1
            if not op_namespace(stacks[at] if at >= 0 else []):
                continue
            kind = kinds[m.group("backend") or m.group("alias")]
            found.setdefault(m.group("op"), {}).setdefault(kind, set()).add(path)
    return found


def shown(rel):
    """A repository-relative path as the table writes it (under include/cupipe/ where it is)."""
    base = os.path.join("include", "cupipe")
    return os.path.relpath(rel, base) if rel.startswith(base + os.sep) else rel


def cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def table(text):
    """(header, [(line number, cells)]) of the first table whose first column is `op`."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.lstrip().startswith("|") and cells(line)[0].strip("` ") == "op":
            rows, j = [], i + 2
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                rows.append((j + 1, cells(lines[j])))
                j += 1
            return cells(line), rows
    return None, []


def plain(cell):
    """A cell without notes (parentheses), backticks and bold; '' when it names nothing (—)."""
    text, notes = cell, 1
    while notes:
        text, notes = re.subn(r"\([^()]*\)", "", text)
    text = text.replace("`", "").replace("**", "").strip()
    return "" if text.startswith(("—", "-")) or not text else text


def paths_in(cell):
    return re.findall(PATH, plain(cell))


def resolve(root, path):
    """The repository-relative path of a table's path (under include/cupipe/, else the root), or None."""
    for rel in (os.path.join("include", "cupipe", path), path):
        if os.path.isfile(os.path.join(root, rel)):
            return os.path.normpath(rel)
    return None


def defines(code, name):
    """Whether `code` defines (or declares) function `name`: a type token, then the name and `(`."""
    for m in re.finditer(r"([\w>\]&*]+)\s+(?:[\w:]+::)?%s\s*\(" % re.escape(name), code):
        if m.group(1) not in NOT_TYPES:
            return True
    return False


def kernel_found(code, name):
    """A `__global__` function `name`, a functor `struct Name`, qualified by its namespace if given."""
    *outer, last = name.split("::")
    if outer and not re.search(r"\bnamespace\s+[\w:]*\b%s\b" % re.escape(outer[-1]), code):
        return False
    if last[:1].isupper():
        return re.search(r"\b(?:struct|class)\s+%s\b" % re.escape(last), code) is not None
    return re.search(r"__global__[^;{}]*?\b%s\s*\(" % re.escape(last), code) is not None


def calls(code, name, member=False):
    """Whether `code` calls `name`, qualified or not; as a member (x.f(), x->f()) only if `member`."""
    before = r"(?<!\w)" if member else r"(?<![\w.>])"
    return re.search(before + r"%s\s*(?:<[^;{}()]*>)?\s*\(" % re.escape(name), code) is not None


class Checker:
    def __init__(self, root):
        self.root = root
        self.failures = []
        self.blanked = {}

    def code(self, rel, text=None):
        """The blanked text of a repository-relative file, read once."""
        if rel not in self.blanked:
            if text is None:
                text = open(os.path.join(self.root, rel), encoding="utf-8").read()
            self.blanked[rel] = blank(text)
        return self.blanked[rel]

    def fail(self, op, message):
        self.failures.append("row %s: %s" % (op, message) if op else message)

    def existing(self, op, column, cell):
        """The repository-relative paths a cell names; a missing one is a failure."""
        found = []
        for path in paths_in(cell):
            rel = resolve(self.root, path)
            if rel is None:
                self.fail(op, "its %s column names %s, which does not exist" % (column, path))
            else:
                found.append(rel)
        return found

    def check_checks(self, op, cell, claimed):
        names = []
        for item in filter(None, (s.strip() for s in plain(cell).split(";"))):
            m = re.match(r"^(%s)\s*:\s*(.+)$" % PATH, item)
            if not m:
                self.fail(op, "checks item %r is not `file: name, ...`" % item)
                continue
            rel = resolve(self.root, m.group(1))
            if rel is None:
                self.fail(op, "its checks column names %s, which does not exist" % m.group(1))
                continue
            for name in filter(None, (n.strip() for n in m.group(2).split(","))):
                names.append(name)
                if not defines(self.code(rel), name):
                    self.fail(op, "checks function %s is not defined in %s" % (name, m.group(1)))
        if not names:
            return
        for kind, files in sorted(claimed.items()):
            folders = sorted({os.path.dirname(f) for f in files})
            around = [os.path.join(d, n) for d in folders for n in sorted(os.listdir(os.path.join(self.root, d)))
                      if n.endswith(SOURCES)]
            if not any(re.search(r"\bchecks::(?:%s)\s*[<(]" % "|".join(map(re.escape, names)), self.code(f)) for f in around):
                self.fail(op, "backend %s calls none of the row's checks (checks::%s) in any file of %s" %
                          (kind, ", checks::".join(names), ", ".join(map(shown, folders))))

    def check_kernels(self, op, cell, cuda_files):
        items = [s.strip() for s in plain(cell).split(";") if s.strip()]
        if items and not cuda_files:
            self.fail(op, "it names kernels but no CUDA wrapper")
        for item in items:
            m = re.match(r"^(?P<lib>[^:]*?)\s*(?P<path>%s)\s*:\s*(?P<names>.+)$" % PATH, item)
            if not m:
                self.fail(op, "kernels item %r is not `file: name, ...` or `Library file: call, ...`" % item)
                continue
            rel = resolve(self.root, m.group("path"))
            if rel is None:
                self.fail(op, "its kernels column names %s, which does not exist" % m.group("path"))
                continue
            for name in filter(None, (n.strip() for n in re.split(r"[,+]", m.group("names")))):
                if m.group("lib"):
                    if not calls(self.code(rel), name, member=True):
                        self.fail(op, "%s call %s is not made in %s" % (m.group("lib"), name, m.group("path")))
                elif not kernel_found(self.code(rel), name):
                    what = "functor (struct)" if name.split("::")[-1][:1].isupper() else "__global__ kernel"
                    self.fail(op, "%s %s is not in %s" % (what, name, m.group("path")))

    def run(self):
        texts = sources(self.root)
        kinds = backends(texts)
        code_ops = overloads(texts, kinds, self.code)
        path = os.path.join(self.root, TABLE)
        if not os.path.isfile(path):
            self.fail(None, "%s does not exist; it must list every op (%d in the code)" % (TABLE, len(code_ops)))
            return code_ops
        header, rows = table(open(path, encoding="utf-8").read())
        if header is None or tuple(h.strip("` ") for h in header) != COLUMNS:
            self.fail(None, "%s has no table with the columns %s (found %s)" % (TABLE, " | ".join(COLUMNS), header))
            return code_ops
        seen = {}
        for line, row in rows:
            if len(row) != len(COLUMNS):
                self.fail(None, "%s:%d has %d cells, not %d" % (TABLE, line, len(row), len(COLUMNS)))
                continue
            cell = dict(zip(COLUMNS, row))
            op = cell["op"].strip("` ")
            if op in seen:
                self.fail(op, "named twice (%s lines %d and %d): every op is named once" % (TABLE, seen[op], line))
                continue
            seen[op] = line
            self.check_row(op, cell, code_ops.get(op, {}))
        for op in sorted(set(code_ops) - set(seen)):
            where = "; ".join("%s in %s" % (kind, ", ".join(sorted(map(shown, files)))) for kind, files in sorted(code_ops[op].items()))
            self.fail(None, "op %s is defined (%s) but has no row in %s" % (op, where, TABLE))
        return code_ops

    def check_row(self, op, cell, defined):
        claimed = {}
        for kind, files in sorted(defined.items()):
            if kind not in BACKEND_COLUMNS:
                self.fail(op, "%s has an overload on backend %s, which the table has no column for" % (
                    ", ".join(sorted(map(shown, files))), kind))
        for kind, column in BACKEND_COLUMNS.items():
            named = self.existing(op, column, cell[column])
            if named:
                claimed[kind] = named
            for rel in named:
                if rel not in defined.get(kind, set()):
                    self.fail(op, "its %s column names %s, which has no %s(backend::%s...&, ...)" % (
                        column, shown(rel), op, kind))
            for rel in sorted(defined.get(kind, set()) - set(named)):
                self.fail(op, "%s has %s(backend::%s...&, ...) but the %s column does not name it" % (
                    shown(rel), op, kind, column))
        if not defined and not claimed:
            self.fail(op, "no backend defines it (a row names an op of the code)")
        self.check_checks(op, cell["checks"], claimed)
        self.check_kernels(op, cell["kernels"], paths_in(cell["CUDA wrapper"]))
        for rel in self.existing(op, "called by", cell["called by"]):
            if not calls(self.code(rel), op):
                self.fail(op, "%s is in its called-by column but does not call %s(" % (shown(rel), op))


SELF_TEST_TREE = {
    "include/cupipe/backend/op_types.hpp": "namespace cupipe::ops {\nstruct Dispatch {};\n}\n",
    "include/cupipe/backend/op_checks.hpp": (
        "namespace cupipe::ops::checks {\ntemplate <class T>\nvoid scale(const T* x) {}  // scale( in a comment\n}\n"),
    "include/cupipe/backend/host/host.hpp": (
        "namespace cupipe::backend {\ntemplate <class S, class C = S>\nstruct Host : ops::Dispatch {};\n}\n"),
    "include/cupipe/backend/host/ops.hpp": (
        "namespace cupipe::ops {\nusing HostHalf = backend::Host<short, float>;\n"
        "template <class T>\nvoid scale(backend::Host<T>&, T* x) { checks::scale(x); }\n"
        "inline void scale(HostHalf& be, short* x) {}\n"
        "namespace detail {\ntemplate <class T>\nvoid helper(backend::Host<T>&) {}\n}  // namespace detail\n"
        "struct Runner {\n  template <class T>\n  void member(backend::Host<T>&) {}\n};\n}\n"),
    "include/cupipe/backend/cuda/cuda.cuh": (
        "namespace cupipe::backend {\ntemplate <class T, class C = T>\nclass Cuda : public ops::Dispatch {};\n}\n"),
    "include/cupipe/backend/cuda/ops.cuh": (
        "namespace cupipe::backend::cuda::detail {\ntemplate <class T, class C>\n"
        "void launch(backend::Cuda<T, C>& be) {}\n}  // namespace cupipe::backend::cuda::detail\nnamespace cupipe::ops {\n"
        "template <class T, class C>\nvoid scale(backend::Cuda<T, C>& be,\n           T* x) {\n"
        "  checks::scale(x);\n  cudaMemcpyAsync(x, x, 0);\n}\n}\n"),
    "include/cupipe/backend/cuda/kernels/scale.cuh": (
        "namespace cupipe::backend::cuda::kernels {\ntemplate <class T>\n__global__ void __launch_bounds__(256)\n"
        "    scale_kernel(T* x) {}\ntemplate <class T>\nstruct ScaleOp {};\n"
        "template <class T>\nvoid scale(T* x) { scale_kernel<<<1, 1>>>(x); }\n}\n"),
    "include/cupipe/layers/scale.hpp": (
        "namespace cupipe {\ntemplate <class B, class T>\nvoid forward(B& be, T* x) { scale(be, x); }\n}\n"),
    "docs/ops.md": (
        "# ops\n\n| op | checks | host | CUDA wrapper | kernels | called by |\n|---|---|---|---|---|---|\n"
        "| `scale` | `backend/op_checks.hpp`: scale | `backend/host/ops.hpp` | `backend/cuda/ops.cuh` (a note) "
        "| `backend/cuda/kernels/scale.cuh`: scale_kernel + ScaleOp; CUDA runtime `backend/cuda/ops.cuh`: cudaMemcpyAsync "
        "| `layers/scale.hpp` |\n"),
}


def self_test():
    """Made-up trees: a good one passes (helpers in detail namespaces and members are not ops); each
    kind of disagreement between the table and the code fails with a message naming the op."""
    import contextlib
    import io
    import tempfile

    def tree(changes):
        root = tempfile.mkdtemp(dir=base)
        files = dict(SELF_TEST_TREE)
        for path, old, new in changes:
            text = files.get(path, "")
            if old and old not in text:
                raise AssertionError("self-test tree: %r not in %s" % (old, path))
            files[path] = text.replace(old, new, 1) if old else text + new
        for path, text in files.items():
            os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
            open(os.path.join(root, path), "w", encoding="utf-8").write(text)
        return root

    host, cuda, doc = ("include/cupipe/backend/host/ops.hpp", "include/cupipe/backend/cuda/ops.cuh", "docs/ops.md")
    cases = [
        ("a good tree", [], 0, "every op"),
        ("a host op without a row", [(host, "namespace detail", "template <class T>\nvoid shift(backend::Host<T>&, T* x) {}\n"
                                      "namespace detail")], 1, "op shift is defined"),
        ("an overload in a file the row does not name",
         [("include/cupipe/backend/host/more.hpp", "", "namespace cupipe::ops {\ninline void scale(HostHalf&, int) {}\n}\n")],
         1, "backend/host/more.hpp has scale("),
        ("a file that does not exist", [(doc, "`backend/host/ops.hpp`", "`backend/host/gone.hpp`")], 1, "gone.hpp, which does not exist"),
        ("a CUDA column without the overload", [(cuda, "void scale(backend::Cuda<T, C>& be,", "void scaled(backend::Cuda<T, C>& be,")],
         1, "names backend/cuda/ops.cuh, which has no scale("),
        ("a checks function renamed", [(doc, "`backend/op_checks.hpp`: scale", "`backend/op_checks.hpp`: scale_shapes")],
         1, "checks function scale_shapes is not defined"),
        ("a backend that calls no checks", [(cuda, "  checks::scale(x);\n", "")], 1, "backend Cuda calls none of the row's checks"),
        ("a kernel renamed", [(doc, "scale_kernel +", "scale_kernal +")], 1, "__global__ kernel scale_kernal is not in"),
        ("a launcher named as a kernel", [(doc, "scale_kernel +", "scale +")], 1, "__global__ kernel scale is not in"),
        ("a functor renamed", [(doc, "+ ScaleOp", "+ ScalingOp")], 1, "functor (struct) ScalingOp is not in"),
        ("a library call not made", [(cuda, "cudaMemcpyAsync(x, x, 0);", "")], 1, "CUDA runtime call cudaMemcpyAsync is not made"),
        ("a caller that does not call", [("include/cupipe/layers/scale.hpp", "scale(be, x)", "shift(be, x)")], 1,
         "layers/scale.hpp is in its called-by column but does not call scale("),
        ("an op on a backend without a column",
         [("include/cupipe/backend/probe.hpp", "", "namespace cupipe::backend {\nstruct Probe : ops::Dispatch {};\n"
           "void scale(Probe&, float* x);\n}\n")], 1, "backend/probe.hpp has an overload on backend Probe"),
        ("an op named twice", [(doc, "", "| `scale` | — | — | — | — | — |\n")], 1, "named twice"),
        ("a row for no op", [(doc, "", "| `twist` | — | — | — | — | — |\n")], 1, "row twist: no backend defines it"),
        ("a missing column", [(doc, "| called by |", "|")], 1, "has no table with the columns"),
    ]
    bad = []
    with tempfile.TemporaryDirectory() as base:
        for name, changes, want, says in cases:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                got = main([tree(changes)])
            if got != want or says not in out.getvalue():
                bad.append("%s: exit %d (want %d), output %r lacks %r" % (name, got, want, out.getvalue(), says))
    for line in bad:
        print("check_ops self-test failed: " + line)
    print("check_ops self-test: %d of %d cases right" % (len(cases) - len(bad), len(cases)))
    return 1 if bad else 0


def main(argv):
    import argparse
    parser = argparse.ArgumentParser(prog="check_ops.py", description="docs/ops.md's table of ops against the code")
    parser.add_argument("root", nargs="?", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                        help="the repository root (default: this script's repository)")
    parser.add_argument("--list", action="store_true", help="print every op overload the code defines, by backend")
    parser.add_argument("--self-test", action="store_true", help="run the checker against made-up trees")
    options = parser.parse_args(argv)
    if options.self_test:
        return self_test()
    root = os.path.abspath(options.root)
    if options.list:
        texts = sources(root)
        for op, where in sorted(overloads(texts, backends(texts)).items()):
            print(op + ": " + "; ".join("%s %s" % (kind, ", ".join(sorted(map(shown, files)))) for kind, files in sorted(where.items())))
        return 0
    checker = Checker(root)
    code_ops = checker.run()
    for f in checker.failures:
        print("check_ops: " + f)
    if not checker.failures:
        print("check_ops: every op is named once in %s and every row agrees with the code (%d ops)" % (TABLE, len(code_ops)))
    return 1 if checker.failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
