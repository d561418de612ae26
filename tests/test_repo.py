"""The repository stands alone: nothing it tracks leans on a directory beside the clone."""

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
