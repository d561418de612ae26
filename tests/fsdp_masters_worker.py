"""Run by test_fsdp under torchrun (2 processes, gloo): a bf16 policy sharded with master weights keeps
fp32 shards, computes in bf16 and moves at lr 1e-6; the frozen reference stays bf16; what is saved and
sent to a vLLM engine is bf16. Rank 0 writes what it saw as JSON."""

import copy
import json
import os
import sys

import torch
from accelerate import Accelerator
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from leangrpo.cli import _leave_if_one_of_many
from leangrpo.models.load import frozen_copy
from leangrpo.train.distributed import Sharded
from leangrpo.train.policy import Policy


def dtypes(tensors) -> list[str]:
    return sorted({str(t.dtype).removeprefix("torch.") for t in tensors})


model_dir, out = sys.argv[1], sys.argv[2]
acc = Accelerator(cpu=True)
torch.manual_seed(0)
lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
dist = Sharded(acc, master_weights=True)
policy, ref = dist.wrap(Policy(copy.deepcopy(lm))), dist.place_frozen(Policy(frozen_copy(lm)))
activations: list[torch.dtype] = []  # each decoder layer's output dtype in the policy's forward
for layer in policy.base.model.layers:
    layer.register_forward_hook(
        lambda m, i, o: activations.append((o[0] if isinstance(o, tuple) else o).dtype)
    )
ids = torch.randint(0, lm.config.vocab_size, (2, 24))
logp = policy(ids, torch.ones_like(ids), 8)
logp.mean().neg().backward()
params = [p for p in policy.parameters()]
before = [p.to_local().detach().clone() for p in params]
torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0).step()
changed = sum(int((p.to_local() != b).sum()) for p, b in zip(params, before, strict=True))
with torch.no_grad():
    ref_logp = ref(ids, torch.ones_like(ids), 8)
dist.release_frozen(ref)
sent = dtypes(t for _, t in dist.engine_weights(policy))
saved = dist.saveable(policy)
if acc.is_main_process:
    report = {
        "shards": dtypes(p.to_local() for p in params),
        "all_dtensors": all(isinstance(p, DTensor) for p in params),
        "grads": dtypes(p.grad.to_local() for p in params),
        "activations": dtypes(torch.empty(0, dtype=d) for d in activations),
        "logp": dtypes([logp]),
        "reference": dtypes(t.to_local() for t in ref.parameters()),
        "reference_logp": dtypes([ref_logp]),
        "changed_share": changed / sum(b.numel() for b in before),
        "sent": sent,
        "saved": dtypes(saved.parameters()),
    }
    with open(os.path.join(out, "fsdp_masters.json"), "w") as f:
        json.dump(report, f)
acc.wait_for_everyone()
torch.distributed.destroy_process_group()
_leave_if_one_of_many(0)  # FSDP2's gloo threads outlive the group: no interpreter teardown under them
