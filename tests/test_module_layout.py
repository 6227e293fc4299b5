"""The package's layout stays readable: no import circles, no overgrown class or function,
and docs/design.md's module map ("## Layers") names exactly the modules there are.

Every module under peer_elastic/ is parsed (never imported), so this runs in a fraction of a
second and sees ``TYPE_CHECKING`` imports and imports inside functions alike.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "peer_elastic"
DESIGN = ROOT / "docs" / "design.md"

#: Import circles allowed, each with the reason it stays (none: a new circle fails; an entry
#: that is no circle any more fails too, so this list never lies).
KNOWN_CIRCLES: set[frozenset[str]] = set()

MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 80
#: Classes and functions allowed over those sizes, each with the reason it stays (none; an
#: entry within the limits fails).
KNOWN_OVERGROWN: set[str] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports, at any depth (under ``TYPE_CHECKING`` and
    inside functions too): for ``from a.b import c``, module ``a.b.c`` when there is one,
    else ``a.b``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{alias.name}" for alias in node.names]
            targets = [t if t in modules else base for t in targets]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # ``import a.b.c`` of a name in a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative: no recursion limit to mind)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in graph:
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def test_no_module_imports_one_that_imports_it_back() -> None:
    modules = package_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    found = set(circles(graph))
    new = [sorted(c) for c in found - KNOWN_CIRCLES]
    assert not new, ("import circles (move the shared type down into a module both can "
                     f"import; a TYPE_CHECKING import is still a circle): {new}")
    gone = [sorted(c) for c in KNOWN_CIRCLES - found]
    assert not gone, f"no longer circles: remove them from KNOWN_CIRCLES: {gone}"


def test_the_circle_finder_sees_long_circles_and_ignores_chains() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": set(), "f": {"f"}}
    assert circles(graph) == [frozenset({"a", "b", "c"})]


def test_the_import_reader_sees_every_form_of_import(tmp_path: Path) -> None:
    pkg = tmp_path / "peer_elastic"
    (pkg / "sub").mkdir(parents=True)
    for f in ("__init__.py", "one.py", "two.py", "sub/__init__.py", "sub/three.py"):
        (pkg / f).write_text("")
    source = pkg / "sub" / "four.py"
    source.write_text("from typing import TYPE_CHECKING\nimport peer_elastic.one\n"
                      "from peer_elastic.sub import three\nfrom .. import two\n"
                      "if TYPE_CHECKING:\n    from peer_elastic.one import Thing\n"
                      "def f():\n    from peer_elastic.sub.three import x\n")
    modules = {"peer_elastic": pkg / "__init__.py", "peer_elastic.one": pkg / "one.py",
               "peer_elastic.two": pkg / "two.py", "peer_elastic.sub": pkg / "sub/__init__.py",
               "peer_elastic.sub.three": pkg / "sub/three.py", "peer_elastic.sub.four": source}
    assert imports_of("peer_elastic.sub.four", source, modules) == {
        "peer_elastic.one", "peer_elastic.two", "peer_elastic.sub.three"}


def overgrown() -> dict[str, int]:
    """Dotted name -> lines of every class over MAX_CLASS_LINES and function (or method,
    at any depth) over MAX_FUNCTION_LINES."""
    found = {}
    for name, path in package_modules().items():
        if path.name.endswith("_pb2.py"):
            continue  # generated
        todo: list[tuple[ast.AST, str]] = [(ast.parse(path.read_text(), str(path)), name)]
        while todo:
            node, prefix = todo.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    qualified = f"{prefix}.{child.name}"
                    lines = (child.end_lineno or child.lineno) - child.lineno + 1
                    limit = MAX_CLASS_LINES if isinstance(child, ast.ClassDef) \
                        else MAX_FUNCTION_LINES
                    if lines > limit:
                        found[qualified] = lines
                    todo.append((child, qualified))
    return found


def test_no_class_or_function_is_overgrown() -> None:
    found = overgrown()
    new = {name: lines for name, lines in found.items() if name not in KNOWN_OVERGROWN}
    assert not new, (f"over {MAX_CLASS_LINES} lines a class or {MAX_FUNCTION_LINES} a "
                     f"function: move a concept out (lines by name): {new}")
    gone = sorted(KNOWN_OVERGROWN - set(found))
    assert not gone, f"within the limits now: remove them from KNOWN_OVERGROWN: {gone}"


def mapped_modules() -> list[str]:
    """The module paths docs/design.md's "## Layers" map lists, in order."""
    text = DESIGN.read_text()
    block = re.search(r"^## Layers\n.*?^```\n(.*?)^```", text, re.M | re.S)
    assert block, 'docs/design.md has no "## Layers" map in a fenced block'
    return [line.split()[0] for line in block.group(1).splitlines() if line.strip()]


def listed_module_paths() -> set[str]:
    """What the map must list: every module, and a package's ``__init__`` when it holds more
    than a docstring."""
    paths = set()
    for path in package_modules().values():
        if path.name == "__init__.py":
            body = ast.parse(path.read_text()).body
            if all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body):
                continue
        paths.add(str(path.relative_to(ROOT)))
    return paths


def test_the_design_map_lists_every_module_once_and_only_modules_that_exist() -> None:
    listed = mapped_modules()
    duplicates = sorted({m for m in listed if listed.count(m) > 1})
    assert not duplicates, f"listed twice in docs/design.md's map: {duplicates}"
    absent = sorted(m for m in listed if not (ROOT / m).is_file())
    assert not absent, f"docs/design.md's map lists modules that do not exist: {absent}"
    unlisted = sorted(listed_module_paths() - set(listed))
    assert not unlisted, f"add these to docs/design.md's map (## Layers): {unlisted}"
