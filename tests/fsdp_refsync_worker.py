"""Run by test_fsdp under torchrun (2 processes, gloo): grpo.sync_ref_model's mix of a sharded reference
toward a sharded policy that took an AdamW step, against the mix of the gathered whole tensors and against
one process doing the same unsharded; then the reference's checkpoint state read back into its shards.
Rank 0 writes the comparison as JSON."""

import copy
import json
import os
import sys

import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM

from leangrpo.cli import _leave_if_one_of_many
from leangrpo.models.load import frozen_copy
from leangrpo.train.distributed import Replicated, Sharded
from leangrpo.train.policy import Policy


def adamw_step(policy, ids, mask, completion):
    (-policy(ids, mask, completion).mean()).backward()
    torch.optim.AdamW(policy.parameters(), lr=1e-2).step()


def max_error(a, b):
    return max(float((a[n] - b[n]).abs().max()) for n in b)


model_dir, out = sys.argv[1], sys.argv[2]
acc = Accelerator(cpu=True)
rank, world = acc.process_index, acc.num_processes
torch.manual_seed(0)
lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
ids = torch.randint(0, lm.config.vocab_size, (2 * world, 24))
mask, completion, alpha, mine = torch.ones_like(ids), 8, 0.25, slice(2 * rank, 2 * rank + 2)

one, one_policy, one_ref = Replicated(acc), Policy(copy.deepcopy(lm)), Policy(frozen_copy(lm))
dist = Sharded(acc)
policy, ref = dist.wrap(Policy(copy.deepcopy(lm))), dist.place_frozen(Policy(frozen_copy(lm)))
start = {n: t.clone() for n, t in one.frozen_state(one_ref).items()}
adamw_step(policy, ids[mine], mask[mine], completion)
adamw_step(one_policy, ids, mask, completion)
with torch.no_grad():
    ref(ids[mine], mask[mine], completion)  # leaves the root's weights gathered, as a reference pass does
dist.mix_into(ref, policy, alpha)
one.mix_into(one_ref, one_policy, alpha)
mixed, moved_policy = dist.frozen_state(ref), dist.frozen_state(policy)
with torch.no_grad():  # the next reference pass computes with the mixed weights
    logp, one_logp = ref(ids[mine], mask[mine], completion), one_ref(ids[mine], mask[mine], completion)
logp_errors = [torch.zeros(()) for _ in range(world)]
torch.distributed.all_gather(logp_errors, (logp - one_logp).abs().max())
dist.load_frozen_state(ref, start)  # a resume: every process reads the whole tensors, keeps its shards
restored = dist.frozen_state(ref)
if rank == 0:
    report = {
        "same_names": sorted(mixed) == sorted(start),
        "moved": max_error(moved_policy, start),
        "mix_error": max_error(mixed, {n: alpha * moved_policy[n] + (1 - alpha) * start[n] for n in start}),
        "one_process_error": max_error(mixed, one.frozen_state(one_ref)),
        "logp_error": float(max(logp_errors)),
        "restore_error": max_error(restored, start),
    }
    with open(os.path.join(out, "fsdp_refsync.json"), "w") as f:
        json.dump(report, f)
acc.wait_for_everyone()
torch.distributed.destroy_process_group()
_leave_if_one_of_many(0)  # FSDP2's gloo threads outlive the group: no interpreter teardown under them
