"""Code size: no function in wormhole/ is longer than 80 lines without a stated reason, no
module is longer than 600 lines and no class has more than 20 methods.

A function longer than ``LIMIT`` lines (``end_lineno - lineno + 1`` of its ``def``) passes
only if the line just above its ``def`` (or above its first decorator) is a comment
``# long: <reason>``, or if it is listed in ``ALLOWED`` below with its reason. ``ALLOWED`` is
for modules whose reason cannot be written next to the function yet.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

LIMIT = 80
MODULE_LINES = 600
CLASS_METHODS = 20
ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "wormhole"
REASON = re.compile(r"^\s*# long: \S")

# (path relative to the repository, qualified function name) -> why it is still long.
ALLOWED: dict[tuple[str, str], str] = {}


def _long_functions(
    package: Path = PACKAGE, root: Path = ROOT
) -> list[tuple[str, str, int, int, bool]]:
    """(path, qualified name, first line, length, has a reason comment) of each long function."""
    found = []
    for path in sorted(package.rglob("*.py")):
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines), filename=str(path))
        for qualname, node in _functions(tree, ""):
            length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            if length <= LIMIT:
                continue
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            above = lines[first - 2] if first >= 2 else ""
            relative = path.relative_to(root).as_posix()
            found.append((relative, qualname, node.lineno, length, bool(REASON.match(above))))
    return found


def _functions(node: ast.AST, prefix: str):  # type: ignore[no-untyped-def]
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + child.name
            yield name, child
            yield from _functions(child, name + ".")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, prefix + child.name + ".")
        else:
            yield from _functions(child, prefix)


def test_no_function_is_over_the_limit_without_a_reason() -> None:
    unexplained = [
        f"{path}:{line} {name} is {length} lines"
        for path, name, line, length, reasoned in _long_functions()
        if not reasoned and (path, name) not in ALLOWED
    ]
    assert not unexplained, (
        f"functions over {LIMIT} lines; split them, or put a comment '# long: <reason>' on the "
        "line above the def (or its decorator):\n" + "\n".join(unexplained)
    )


def test_every_allowed_function_exists_and_is_still_long() -> None:
    long = {(path, name) for path, name, _, _, _ in _long_functions()}
    stale = sorted(f"{path} {name}" for path, name in ALLOWED if (path, name) not in long)
    assert not stale, (
        f"ALLOWED in {Path(__file__).name} lists functions that are gone or now at most "
        f"{LIMIT} lines; remove them:\n" + "\n".join(stale)
    )


def test_the_check_sees_a_long_function_and_its_reason(tmp_path: Path) -> None:
    body = "".join(f"        x{i} = {i}\n" for i in range(LIMIT))
    (tmp_path / "m.py").write_text(
        f"class C:\n    @staticmethod\n    def bare():\n{body}\n"
        f"    # long: one state machine\n    @staticmethod\n    def reasoned():\n{body}\n"
        f"def short():\n    return 1\n"
    )
    found = {name: reasoned for _, name, _, _, reasoned in _long_functions(tmp_path, tmp_path)}
    assert found == {"C.bare": False, "C.reasoned": True}


def _sizes(package: Path = PACKAGE, root: Path = ROOT) -> tuple[list[str], list[str]]:
    """Modules over ``MODULE_LINES`` lines and classes over ``CLASS_METHODS`` methods."""
    modules, classes = [], []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        relative = path.relative_to(root).as_posix()
        if len(text.splitlines()) > MODULE_LINES:
            modules.append(f"{relative}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.ClassDef):
                methods = [
                    n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                ]
                if len(methods) > CLASS_METHODS:
                    classes.append(f"{relative}: {node.name} has {len(methods)} methods")
    return modules, classes


def test_no_module_or_class_is_too_big_to_read_in_one_sitting() -> None:
    modules, classes = _sizes()
    assert not modules, f"modules over {MODULE_LINES} lines; split them by concern:\n" + "\n".join(
        modules
    )
    assert not classes, (
        f"classes with more than {CLASS_METHODS} methods; give a concern its own class and "
        "hold it:\n" + "\n".join(classes)
    )


def test_the_size_check_sees_a_long_module_and_a_wide_class(tmp_path: Path) -> None:
    methods = "".join(
        f"    def m{i}(self):\n        return {i}\n" for i in range(CLASS_METHODS + 1)
    )
    (tmp_path / "wide.py").write_text(f"class Wide:\n{methods}")
    (tmp_path / "long.py").write_text("x = 1\n" * (MODULE_LINES + 1))
    (tmp_path / "fine.py").write_text("class Fine:\n    def m(self):\n        return 1\n")
    modules, classes = _sizes(tmp_path, tmp_path)
    assert modules == [f"long.py: {MODULE_LINES + 1} lines"]
    assert classes == [f"wide.py: Wide has {CLASS_METHODS + 1} methods"]
