"""The shape of the code: no function in src/ over 60 lines, none in core/ over 40."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "leangrpo"
LIMIT, CORE_LIMIT = 60, 40


def long_functions(root: Path) -> dict[str, int]:
    """'path:function' -> its lines (end_lineno - lineno + 1; nested functions count on their own) of
    every function over its limit: CORE_LIMIT in core/, LIMIT elsewhere."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        limit = CORE_LIMIT if rel.startswith("core/") else LIMIT
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found[f"{rel}:{node.name}"] = lines
    return found


def test_no_function_is_over_its_limit():
    over = long_functions(SRC)
    assert not over, f"split these (lines): {over}"


def test_long_functions_finds_one(tmp_path):
    (tmp_path / "core").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(40))
    (tmp_path / "core" / "m.py").write_text(f"def f():\n{body}\n")
    (tmp_path / "m.py").write_text(f"def f():\n{body}\n")
    assert long_functions(tmp_path) == {"core/m.py:f": 41}
