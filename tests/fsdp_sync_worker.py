"""Run by test_fsdp under torchrun (2 processes, gloo): the weights a colocated vLLM engine is sent under
FSDP2 (`Sharded.engine_weights`), full and LoRA, against the same model on one process; and, at every
tensor sent, which shard groups are gathered. Rank 0 writes the comparison as JSON."""

import copy
import json
import os
import sys

import torch
from accelerate import Accelerator
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from leangrpo.cli import _leave_if_one_of_many
from leangrpo.config.schema import LoraConfig
from leangrpo.engines.vllm import applied_weights
from leangrpo.models.load import apply_lora
from leangrpo.train.distributed import Sharded
from leangrpo.train.policy import Policy


def gathered_groups(policy: torch.nn.Module) -> list[int]:
    """The shard groups (by index) whose own parameters are whole now, and not DTensor shards."""
    groups = [m for m in policy.modules() if isinstance(m, FSDPModule)]
    inner = {id(p) for g in groups[1:] for p in g.parameters()}
    own = [[p for p in g.parameters() if g is not groups[0] or id(p) not in inner] for g in groups]
    return [i for i, params in enumerate(own) if any(not isinstance(p, DTensor) for p in params)]


def compare(lm: torch.nn.Module, acc: Accelerator) -> dict:
    """Sync `lm` sharded vs the same model whole: names, largest difference, gathered groups per tensor."""
    whole = {n: t.clone() for n, t in applied_weights(copy.deepcopy(lm))}
    policy = Sharded(acc).wrap(Policy(lm))
    sent, seen_groups, error, gathered_bytes = [], [], 0.0, 0
    for name, tensor in Sharded(acc).engine_weights(policy):
        sent.append(name)
        seen_groups.append(gathered_groups(policy))
        error = max(error, float((tensor - whole[name]).abs().max()))
        whole_now = sum(p.nbytes for p in policy.parameters() if not isinstance(p, DTensor))
        gathered_bytes = max(gathered_bytes, whole_now)
    return {
        "names_equal": sorted(sent) == sorted(whole),  # each once; in shard-group order
        "extra": sorted(set(sent) - set(whole)),
        "missing": sorted(set(whole) - set(sent)),
        "error": error,
        "groups_per_tensor": sorted({len(g) for g in seen_groups}),
        "groups_visited": len({g[0] for g in seen_groups if g}),
        "groups": sum(isinstance(m, FSDPModule) for m in policy.modules()),
        "gathered_after": gathered_groups(policy),
        "max_gathered_bytes": gathered_bytes,
    }


model_dir, out = sys.argv[1], sys.argv[2]
acc = Accelerator(cpu=True)
torch.manual_seed(0)
full = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
lora = apply_lora(
    AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
    LoraConfig(enabled=True, r=4, alpha=8, dropout=0.0),
)
with torch.no_grad():  # B starts at zero: make the merge change every adapted weight
    for name, p in lora.named_parameters():
        if "lora_B" in name:
            p.copy_(torch.randn_like(p) * 0.1)
report = {"full": compare(full, acc), "lora": compare(lora, acc)}
if acc.is_main_process:
    with open(os.path.join(out, "fsdp_sync.json"), "w") as f:
        json.dump(report, f)
acc.wait_for_everyone()
torch.distributed.destroy_process_group()
_leave_if_one_of_many(0)  # FSDP2's gloo threads outlive the group: no interpreter teardown under them
