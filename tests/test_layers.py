"""The package's folders are its layers (docs/development.md): imports point down the list only, every
import counts (inside functions and under TYPE_CHECKING too), and the import graph has no circles."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "leangrpo"
LAYERS = ("core", "config", "data", "models", "engines", "cpu", "run", "train", "commands", "cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` names."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def leangrpo_imports() -> list[tuple[str, str, list[str]]]:
    """(module, imported module, names) for every leangrpo import in the package."""
    modules = {module_name(p): p for p in SRC.rglob("*.py")}
    found = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(name, a.name, []) for a in node.names if a.name.startswith("leangrpo")]
            elif isinstance(node, ast.ImportFrom):
                target = resolve(name, path.name == "__init__.py", node)
                if target.split(".")[0] == "leangrpo":
                    found.append((name, target, [a.name for a in node.names]))
    return found


def test_every_import_names_a_module_that_exists():
    """A lazy import left pointing at an old place fails only when its function runs: find it here."""
    modules = {module_name(p) for p in SRC.rglob("*.py")}
    missing = [f"{source}: {target}" for source, target, _ in leangrpo_imports() if target not in modules]
    assert not missing, missing


def import_graph() -> dict[str, set[str]]:
    """Every leangrpo module -> the leangrpo modules it imports (a name that is a submodule counts as it)."""
    modules = {module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.startswith("leangrpo")}
            elif isinstance(node, ast.ImportFrom):
                target = resolve(name, path.name == "__init__.py", node)
                if target.split(".")[0] != "leangrpo":
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    targets.add(sub if sub in modules else target)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def layer(module: str) -> int | None:
    """The layer's index in LAYERS; None for the package's own __init__ and __main__."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_every_module_sits_in_a_layer():
    loose = [m for m in import_graph() if layer(m) is None and m not in ("leangrpo", "leangrpo.__main__")]
    assert not loose, f"modules outside the layers {LAYERS}: {loose}"


def test_imports_point_down_the_layers():
    upward = [
        f"{source} -> {target}"
        for source, targets in import_graph().items()
        for target in targets
        if layer(source) is not None and (layer(target) or 0) > (layer(source) or 0)
    ]
    assert not upward, "imports pointing up the layers:\n" + "\n".join(sorted(upward))


def test_core_imports_nothing_of_leangrpo_but_core():
    outside = {
        f"{s} -> {t}" for s, ts in import_graph().items() if layer(s) == 0 for t in ts if layer(t) != 0
    }
    assert not outside, outside


def test_the_import_graph_has_no_circles():
    graph, done, path, circles = import_graph(), set(), [], []

    def visit(node: str) -> None:
        if node in path:
            circles.append(" -> ".join([*path[path.index(node) :], node]))
            return
        if node in done:
            return
        path.append(node)
        for target in sorted(graph[node]):
            visit(target)
        path.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)
    assert not circles, "import circles:\n" + "\n".join(circles)


@pytest.mark.parametrize("package", LAYERS[:-1])
def test_each_layer_says_what_lives_there(package):
    """Every subpackage's __init__ docstring says what lives there and what it may import."""
    doc = ast.get_docstring(ast.parse((SRC / package / "__init__.py").read_text()))
    assert doc and "import" in doc.lower(), f"leangrpo/{package}/__init__.py: a docstring naming its imports"


def test_only_the_cpu_hook_imports_the_cpu_layer():
    """leangrpo.cpu is reached through one hook, train/levers.cpu_levers, which imports it for a model on
    CPU only; no other module outside cpu/ names it in an import."""
    importers = {
        source
        for source, target, _ in leangrpo_imports()
        if target.startswith("leangrpo.cpu") and not source.startswith("leangrpo.cpu")
    }
    assert importers == {"leangrpo.train.levers"}, importers


def test_the_vllm_engines_do_not_import_the_hf_engine():
    """vLLM's engines (and OpenEnv's adapter) build on engines/types.py and engines/tools.py, never on the HF
    engine (engines/hf.py)."""
    importers = {
        source
        for source, target, names in leangrpo_imports()
        if source.startswith(("leangrpo.engines.vllm", "leangrpo.engines.openenv"))
        and (target == "leangrpo.engines.hf" or (target == "leangrpo.engines" and "hf" in names))
    }
    assert not importers, importers


def test_on_cuda_nothing_from_the_cpu_layer_is_imported():
    """What a CUDA run imports (the CLI, the trainer, eval, chat, the Python API) pulls in no module of
    leangrpo.cpu, and the hook gives a CUDA device no levers (checked by module name, in a fresh process)."""
    code = (
        "import sys, torch\n"
        "import leangrpo.cli, leangrpo.train.trainer, leangrpo.commands.evaluate, leangrpo.commands.chat\n"
        "import leangrpo.commands.trl_api, leangrpo.commands.demo, leangrpo.commands.export\n"
        "from leangrpo.config.schema import CPUConfig\n"
        "from leangrpo.train.levers import cpu_levers\n"
        "assert cpu_levers(torch.device('cuda'), CPUConfig()) is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('leangrpo.cpu')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
