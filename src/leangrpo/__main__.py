"""`python -m leangrpo`. Python puts the current directory first on the import path for `-m`; it is taken
off, so that a file in the directory the command runs in (a downloaded run's `evil.py`, `torch.py`) is
never imported in place of what leangrpo or a config names: here, before leangrpo's own imports. Any other
way it got there (an empty PYTHONPATH entry) `cli.main` takes off, for every entry point."""

import os
import sys

if sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from leangrpo.cli import main  # noqa: E402 - after the import path is fixed

main()
