"""Run by test_fsdp under torchrun (2 processes, gloo): a sharded reference's pass through
`Updater.reference` leaves none of its weights gathered (FSDP2 keeps a root gathered after its forward, and
the frozen reference never runs the backward that would reshard it). Rank 0 writes the bytes as JSON."""

import copy
import json
import os
import sys
from types import SimpleNamespace

import torch
from accelerate import Accelerator
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from leangrpo.cli import _leave_if_one_of_many
from leangrpo.config.schema import Config
from leangrpo.engines.types import RolloutBatch
from leangrpo.models.load import frozen_copy
from leangrpo.train.distributed import Sharded
from leangrpo.train.policy import Policy
from leangrpo.train.update import Updater


def gathered_bytes(module) -> int:
    """Bytes of the registered parameters that are whole tensors (FSDP2 swaps a gathered group's DTensor
    shards for its unsharded tensors until it reshards)."""
    return sum(p.nbytes for p in module.parameters() if not isinstance(p, DTensor))


model_dir, out = sys.argv[1], sys.argv[2]
acc = Accelerator(cpu=True)
torch.manual_seed(0)
lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
dist = Sharded(acc)
policy, ref = dist.wrap(Policy(copy.deepcopy(lm))), dist.place_frozen(Policy(frozen_copy(lm)))
cfg = Config.model_validate(
    {
        "model": {"name_or_path": model_dir},
        "data": {"path": "unused.jsonl"},
        "grpo": {"beta": 0.1, "padding_free": False},
    }
)
updater = Updater(cfg, acc, dist, SimpleNamespace(policy=policy), ref, None, 1, lambda: None, print)
ids = torch.randint(0, lm.config.vocab_size, (2, 24))
ones = torch.ones_like(ids[:, 16:])
rollout = RolloutBatch(
    ids[:, :16], torch.ones_like(ids[:, :16]), ids[:, 16:], ones, ones[:, 0] == 0, [""] * 2
)
before = gathered_bytes(ref)
ref_logp = updater.reference(rollout).ref_logp
if acc.is_main_process:
    report = {
        "before": before,
        "after": gathered_bytes(ref),
        "root_bytes": sum(p.nbytes for p in lm.parameters())
        - sum(p.nbytes for p in lm.model.layers.parameters()),
        "finite": bool(ref_logp is not None and torch.isfinite(ref_logp).all()),
    }
    with open(os.path.join(out, "fsdp_refpass.json"), "w") as f:
        json.dump(report, f)
acc.wait_for_everyone()
torch.distributed.destroy_process_group()
_leave_if_one_of_many(0)  # FSDP2's gloo threads outlive the group: no interpreter teardown under them
