"""The repository stands alone: nothing it tracks leans on a directory beside the clone."""

import importlib.resources
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SIBLING = "..".__add__("/shared")  # built, so that this file does not name it


def test_no_tracked_file_names_a_sibling_directory():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode != 0:
        pytest.skip(f"git ls-files failed: {listed.stderr.decode(errors='replace').strip()}")
    names = listed.stdout.decode().split("\0")
    hits = []
    for name in filter(None, names):
        path = ROOT / name
        if not path.is_file():  # deleted in the work tree, or a submodule
            continue
        for number, line in enumerate(path.read_bytes().decode("utf-8", "replace").splitlines(), 1):
            if SIBLING in line:
                hits.append(f"{name}:{number}: {line.strip()}")
    assert not hits, f"{SIBLING} named in tracked files (the repo must run alone):\n" + "\n".join(hits)


def test_accelerate_configs_ship_in_the_package_and_the_command_prints_them():
    from click.testing import CliRunner

    from leangrpo.cli import main

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    shipped = importlib.resources.files("leangrpo.train") / "accelerate"
    names = sorted(p.name for p in shipped.iterdir())
    assert names == ["ddp.yaml", "fsdp2.yaml"]
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    package = ROOT / "src" / "leangrpo"
    in_wheel = {p.relative_to(package) for pattern in package_data["leangrpo"] for p in package.glob(pattern)}
    assert {Path("train/accelerate") / name for name in names} <= in_wheel
    assert (ROOT / "configs" / "accelerate" / "fsdp2.yaml").read_text() == (
        shipped / "fsdp2.yaml"
    ).read_text()
    result = CliRunner().invoke(main, ["accelerate-config", "fsdp2"])
    assert result.exit_code == 0 and result.output == (shipped / "fsdp2.yaml").read_text()
    assert "distributed_type: FSDP" in result.output
    assert CliRunner().invoke(main, ["accelerate-config", "zero3"]).exit_code == 2
