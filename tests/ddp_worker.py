"""Run by `accelerate launch` in test_e2e: trains through the Trainer, then each rank writes a digest
of its own final weights so the test can compare ranks."""

import hashlib
import os
import sys

from leangrpo.cli import _leave_if_one_of_many
from leangrpo.run.resolve import load_config
from leangrpo.train.trainer import Trainer

trainer = Trainer(load_config(sys.argv[1], sys.argv[2:]))
trainer.train()
digest = hashlib.sha256()
for name, p in sorted(trainer.unwrapped.named_parameters()):
    digest.update(name.encode() + p.detach().cpu().numpy().tobytes())
rank = os.environ.get("RANK", "0")
with open(os.path.join(os.environ["LEANGRPO_TEST_OUT"], f"weights-rank{rank}.sha256"), "w") as f:
    f.write(digest.hexdigest())
_leave_if_one_of_many(0)  # as the CLI ends a process of a multi-process run
