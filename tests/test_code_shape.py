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


CLASS_LIMIT, TRAINER_LINES = 25, 400


def big_classes(root: Path) -> dict[str, int]:
    """'path:Class' -> its methods, for every class with more than CLASS_LIMIT (nested functions aside)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                if len(methods) > CLASS_LIMIT:
                    found[f"{path.relative_to(root).as_posix()}:{node.name}"] = len(methods)
    return found


def test_no_class_is_over_its_limit():
    """A class that collects every role is split by role (issue 48: the Trainer had 54 methods)."""
    over = big_classes(SRC)
    assert not over, f"split these by role (methods): {over}"


def test_big_classes_finds_one(tmp_path):
    methods = "\n".join(f"    def m{i}(self): pass" for i in range(CLASS_LIMIT + 1))
    (tmp_path / "m.py").write_text(f"class C:\n{methods}\n")
    assert big_classes(tmp_path) == {"m.py:C": CLASS_LIMIT + 1}


def test_the_trainer_reads_in_one_sitting():
    lines = len((SRC / "train" / "trainer.py").read_text().splitlines())
    assert lines <= TRAINER_LINES, f"train/trainer.py has {lines} lines: move a role into its own module"


def test_only_the_engine_registry_and_the_config_read_which_engine_runs():
    """`use_vllm` and `vllm_mode` are TRL's user-facing names; engines/registry.py maps them to an engine,
    and everything else asks the engine (or its EngineKind) what it needs to know."""
    allowed = {"engines/registry.py", "config/schema.py", "config/trl.py", "config/trl_fields.py"}
    readers = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("use_vllm", "vllm_mode")
                and rel not in allowed
            ):
                readers.append(f"{rel}:{node.lineno}")
    assert not readers, readers
