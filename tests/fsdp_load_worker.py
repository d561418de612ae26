"""Run by test_fsdp under torchrun (2 processes, gloo, FSDP2): a Trainer built for full fine-tuning with a
KL reference; each rank writes how far its peak RSS rose while the Trainer loaded the model and built,
sharded and placed the policy and its reference, beside the model's weight bytes."""

import json
import resource
import sys
from pathlib import Path

from accelerate import Accelerator
from test_memory import make_cfg
from transformers import AutoTokenizer
from transformers.models.llama import modeling_llama  # noqa: F401  # its import is not the weights'

import leangrpo.train.trainer as trainer_mod


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


model_dir, data, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
cfg = make_cfg(
    model={"name_or_path": model_dir, "dtype": "float32"},
    data={"path": data, "limit": 4},
    grpo={"beta": 0.04, "num_generations": 4, "max_completion_length": 8},
    optim={"per_device_train_batch_size": 4, "max_steps": 1},
    logging={"progress_bar": False},
    output_dir=str(out / "run"),
)
Accelerator(cpu=True)  # the process group (the Trainer's Accelerator joins it) and the tokenizer, before
AutoTokenizer.from_pretrained(model_dir)  # the baseline: what remains is the weights' share
before = peak_rss()
trainer = trainer_mod.Trainer(cfg)
rise = peak_rss() - before
weights = sum(p.to_local().nbytes for p in trainer.policy.parameters())  # this rank's shards
rank = trainer.acc.process_index
(out / f"load-{rank}.json").write_text(json.dumps({"rss_rise": rise, "shard_bytes": weights}))
