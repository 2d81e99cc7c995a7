#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Namespaces follow folders: a reader who sees a qualified name finds its file from the name alone.

A header include/cupipe/<a>/<b>/<file>.hpp (or .cuh) may open:
- `cupipe` followed by a leading part of its folders: cupipe, cupipe::a, cupipe::a::b;
- the whole of its folders followed by the file's own name: cupipe::a::b::<file> (one header's own
  namespace, such as backend/cuda/cudnn_attention.hpp's cupipe::backend::cuda::cudnn_attention);
- a `detail` namespace anywhere inside those (everything from `detail` on is the file's private
  business);
- in backend/ and below, `cupipe::ops` (and cupipe::ops::checks, the ops' shape checks), the one
  namespace that is not a folder: an op is one name with an overload per backend, each overload beside its backend
  (backend/host, backend/cuda) and all in cupipe::ops, where argument-dependent lookup on any
  backend finds them. docs/ops.md is the op's one hop (scripts/check_ops.py keeps it true).

So cupipe::backend::cuda::kernels::X is in backend/cuda/kernels/, cupipe::comm::X in comm/ (or a
folder below it), and cupipe::X, the vocabulary a trainer writes (core's tensors, the layers, the
Pipeline front), anywhere: cupipe.hpp includes it all.

    python3 scripts/check_namespaces.py [repository root]   exit 0: every namespace is allowed
    python3 scripts/check_namespaces.py --self-test         the checker against made-up trees
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_bounds import blank  # noqa: E402  (comments and literals as spaces, newlines kept)

SOURCES = (".hpp", ".cuh", ".h")
EXCEPTIONS = {"cupipe::ops", "cupipe::ops::checks"}


def opened(code):
    """[(line, full namespace name)] of every namespace the code opens, nested ones in full."""
    found, stack, head_start = [], [], 0
    for i, c in enumerate(code):
        if c == "{":
            head = re.sub(r"\binline\s+", "", code[head_start:i])  # namespace a::inline b, inline namespace b
            m = re.search(r"\bnamespace\s*([\w:]*)\s*$", head)
            if not m and re.search(r"\bnamespace\b", head):
                found.append((code.count("\n", 0, i) + 1, "?"))  # attributes or a form this reader does not know
            if m and m.group(1):
                outer = [n for n in stack if n] if all(n is not None for n in stack) else None
                if outer is not None:
                    full = "::".join(outer + [m.group(1)])
                    found.append((code.count("\n", 0, i) + 1, full))
            stack.append(m.group(1) if m else None)
            head_start = i + 1
        elif c == "}":
            stack.pop() if stack else None
            head_start = i + 1
        elif c == ";":
            head_start = i + 1
    return found


def allowed(path, namespace):
    """Whether the header at `path` (relative to include/cupipe) may open `namespace`."""
    parts = namespace.split("::")
    if "detail" in parts:
        parts = parts[: parts.index("detail")]
    if not parts or parts[0] != "cupipe":
        return False  # outside cupipe, a top-level detail, or a namespace this reader could not name
    folders = path.split("/")[:-1]
    if "::".join(parts) in EXCEPTIONS:
        return folders[:1] == ["backend"]
    stem = os.path.splitext(os.path.basename(path))[0]
    rest = parts[1:]
    return any(rest == folders[:k] for k in range(len(folders) + 1)) or rest == folders + [stem]


def violations(root):
    """['path:line: namespace X ...'] for every namespace a header may not open."""
    base = os.path.join(root, "include", "cupipe")
    if not os.path.isdir(base):
        return [f"{base}: no such folder (the argument is the repository's root)"]
    found = []
    for folder, _, names in sorted(os.walk(base)):
        for file in sorted(names):
            if not file.endswith(SOURCES):
                continue
            full = os.path.join(folder, file)
            rel = os.path.relpath(full, base).replace(os.sep, "/")
            for line, ns in opened(blank(open(full, encoding="utf-8").read())):
                if not allowed(rel, ns):
                    found.append(f"include/cupipe/{rel}:{line}: namespace {ns} names no folder of its file "
                                 f"(allowed: cupipe, then a leading part of {'/'.join(rel.split('/')[:-1]) or '(none)'}, "
                                 f"optionally then {os.path.splitext(file)[0]}; detail inside any of them; cupipe::ops)")
    return found


def self_test():
    import tempfile
    cases = [
        ("a good tree", {
            "backend/cuda/kernels/relu.cuh": "namespace cupipe::backend::cuda::kernels {\nnamespace detail {}\n}\n",
            "backend/cuda/cuda.cuh": "namespace cupipe::backend {\n}\nnamespace cupipe::ops {\n}\n",
            "backend/op_checks.hpp": "namespace cupipe::ops::checks {\n}\n",
            "backend/cuda/cudnn_attention.hpp": "namespace cupipe::backend::cuda::cudnn_attention {\n}\n",
            "layers/linear.hpp": "namespace cupipe {\nnamespace detail {\nstruct X {};\n}\n}\n",
            "comm/mpi.hpp": "namespace cupipe::comm::detail::inner {\n}\n// namespace cupipe::gpu {\n"
                            "const char* s = \"namespace cupipe::gpu {\";\n",
        }, 0),
        ("a namespace that is no folder", {"backend/cuda/context.cuh": "namespace cupipe::gpu {\n}\n"}, 1),
        ("a nested one that is no folder", {"layers/sequential.hpp": "namespace cupipe {\nnamespace tensor_parallel {\n}\n}\n"}, 1),
        ("a folder's namespace in the wrong folder", {"pipeline/workers.hpp": "namespace cupipe::backend {\n}\n"}, 1),
        ("outside cupipe", {"core/x.hpp": "namespace cuda_detail {\n}\n"}, 1),
        ("a top-level detail", {"core/x.hpp": "namespace detail {\n}\n"}, 1),
        ("a file's name not under its folders", {"backend/cuda/kernels/attention_mma.cuh":
                                                 "namespace cupipe::attention_mma {\n}\n"}, 1),
        ("ops outside backend/", {"layers/x.hpp": "namespace cupipe::ops {\n}\n"}, 1),
        ("an inline namespace that is no folder", {"comm/x.hpp": "namespace cupipe::comm {\ninline namespace v1 {\n}\n}\n"}, 1),
        ("a namespace with attributes", {"comm/x.hpp": "namespace [[deprecated]] cupipe::comm {\n}\n"}, 1),
        ("inside ops but not its checks", {"backend/cuda/ops.cuh": "namespace cupipe::ops {\nnamespace cuda_detail {\n}\n}\n"}, 1),
        ("another file's name", {"backend/cuda/kernels/attention_mma.cuh":
                                 "namespace cupipe::backend::cuda::kernels::mma_attention {\n}\n"}, 1),
    ]
    wrong = 0
    with tempfile.TemporaryDirectory() as root:
        if len(violations(root)) != 1:
            wrong += 1
            print("self-test: a root without include/cupipe passed")
    for title, tree, expected in cases:
        with tempfile.TemporaryDirectory() as root:
            for rel, text in tree.items():
                path = os.path.join(root, "include", "cupipe", rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                open(path, "w", encoding="utf-8").write(text)
            got = violations(root)
            if expected and tree and not all(any(rel in g for rel in tree) for g in got):
                wrong += 1
                print(f"self-test: {title}: a violation names no file of the tree: {got}")
            elif len(got) != expected:
                wrong += 1
                print(f"self-test: {title}: expected {expected} violation(s), got {len(got)}: {got}")
    print(f"check_namespaces self-test: {len(cases) + 1 - wrong} of {len(cases) + 1} cases right")
    return 1 if wrong else 0


def main(argv):
    if "--self-test" in argv:
        return self_test()
    root = next((a for a in argv[1:] if not a.startswith("-")), ".")
    found = violations(root)
    for v in found:
        print(v)
    if found:
        print(f"check_namespaces: {len(found)} namespace(s) name no folder (scripts/check_namespaces.py says the rule)")
        return 1
    print("check_namespaces: every namespace names its folder or file")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
