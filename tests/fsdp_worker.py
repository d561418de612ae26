"""Run by test_fsdp under torchrun (2 processes, gloo): one sharded forward/backward/AdamW step against the
same step on one process, and the bytes each rank holds. Rank 0 writes the comparison as JSON."""

import copy
import json
import os
import sys

import torch
from accelerate import Accelerator
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from leangrpo.cli import _leave_if_one_of_many
from leangrpo.train.distributed import Sharded
from leangrpo.train.policy import Policy


def local_bytes(tensors) -> int:
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def step(policy, params, ids, mask, completion):
    """Mean completion log-prob as the loss (equal token counts per rank, so FSDP's gradient average is
    the global mean), one AdamW step; returns the loss and the gathered gradients."""
    logp = policy(ids, mask, completion)
    loss = -logp.mean()
    loss.backward()
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone() for n, p in params}
    opt = torch.optim.AdamW([p for _, p in params], lr=1e-3)
    opt.step()
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    return loss.detach(), grads, local_bytes(p for _, p in params), local_bytes(state)


model_dir, out = sys.argv[1], sys.argv[2]
acc = Accelerator(cpu=True)
rank, world = acc.process_index, acc.num_processes
torch.manual_seed(0)
lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
single = Policy(copy.deepcopy(lm))
ids = torch.randint(0, lm.config.vocab_size, (2 * world, 24))
mask = torch.ones_like(ids)
completion = 8

full_bytes = local_bytes(lm.parameters())
moved: dict[int, int] = {}  # bytes of each tensor `Tensor.to` is asked to put on a device during wrap
real_to = torch.Tensor.to


def counting_to(self, *args, **kwargs):
    if any(isinstance(a, (torch.device, str)) for a in (*args, *kwargs.values())):
        moved[id(self)] = local_bytes([self])  # by tensor: a tied weight is visited once per module
    return real_to(self, *args, **kwargs)


torch.Tensor.to = counting_to
sharded = Sharded(acc).wrap(Policy(lm))
torch.Tensor.to = real_to
mine = slice(2 * rank, 2 * rank + 2)
loss, grads, param_bytes, optim_bytes = step(
    sharded, list(sharded.named_parameters()), ids[mine], mask[mine], completion
)
losses = [torch.zeros(()) for _ in range(world)]
torch.distributed.all_gather(losses, loss)
if rank == 0:
    ref_loss, ref_grads, ref_param_bytes, ref_optim_bytes = step(
        single, list(single.named_parameters()), ids, mask, completion
    )
    report = {
        "loss_error": abs(float(sum(losses) / world) - float(ref_loss)),
        "grad_error": max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items()),
        "grad_scale": max(float(g.abs().max()) for g in ref_grads.values()),
        "param_ratio": param_bytes / ref_param_bytes,
        "optim_ratio": optim_bytes / ref_optim_bytes,
        "rank0_param_bytes": param_bytes,
        "rank0_optim_bytes": optim_bytes,
        "same_names": sorted(grads) == sorted(ref_grads),
        "moved_ratio": sum(moved.values()) / full_bytes,
    }
    with open(os.path.join(out, "fsdp_step.json"), "w") as f:
        json.dump(report, f)
acc.wait_for_everyone()
torch.distributed.destroy_process_group()
_leave_if_one_of_many(0)  # FSDP2's gloo threads outlive the group: no interpreter teardown under them
