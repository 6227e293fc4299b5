"""The test suite's own layout: a test module imports helpers (tests/helpers/), never another
test module, so that each runs alone, and a helper has one home."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
#: Text without this has no import of a test module (most files: they are not parsed).
MAY_IMPORT_A_TEST_MODULE = re.compile(r"\btests\s*\.\s*test_|\bfrom\s+tests\s+import\b")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, at any depth (inside functions too)."""
    text = path.read_text()
    if not MAY_IMPORT_A_TEST_MODULE.search(text):  # nothing to find: spare the parse
        return []
    found = []
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from tests import test_x`` imports module tests.test_x.
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "tests" \
                else [node.module]
            found += [(node.lineno, name) for name in names]
    return found


def imports_a_test_module(module: str) -> bool:
    parts = module.split(".")
    return len(parts) >= 2 and parts[0] == "tests" and parts[1].startswith("test_")


def test_no_test_module_or_helper_imports_a_test_module() -> None:
    sources = sorted(TESTS.glob("test_*.py")) + sorted((TESTS / "helpers").glob("*.py"))
    offending = sorted({f"{path.relative_to(TESTS.parent)}:{line}: {module}"
                        for path in sources for line, module in imported_modules(path)
                        if imports_a_test_module(module)})
    assert not offending, ("move what these use into tests/helpers/:\n" + "\n".join(offending))


def test_the_check_sees_every_form_of_import(tmp_path: Path) -> None:
    source = tmp_path / "test_sample.py"
    source.write_text("import tests.test_a\nfrom tests.test_b import x\nfrom tests import test_c\n"
                      "def f():\n    from tests.test_d import y\n"
                      "from tests.helpers.procs import Cluster\n")
    hits = sorted({m for _, m in imported_modules(source) if imports_a_test_module(m)})
    assert hits == ["tests.test_a", "tests.test_b", "tests.test_c", "tests.test_d"]
