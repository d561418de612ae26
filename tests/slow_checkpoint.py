"""Run by test_resume as `python tests/slow_checkpoint.py SECONDS train ...`: the leangrpo CLI, with each
checkpoint write held open for SECONDS after its weights, optimizer and config are written and before its
state file and rename, so that the test can kill the process in the middle of a checkpoint write."""

import sys
import time
from pathlib import Path

from leangrpo.cli import main
from leangrpo.run import checkpoint

seconds = float(sys.argv[1])
real_file_hashes = checkpoint.file_hashes


def slow_file_hashes(directory: Path) -> dict[str, str]:
    if directory.name.startswith(".checkpoint-"):  # a checkpoint being written, not the final model
        time.sleep(seconds)
    return real_file_hashes(directory)


checkpoint.file_hashes = slow_file_hashes
main(sys.argv[2:], prog_name="leangrpo")
