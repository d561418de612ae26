"""The memory options (8-bit AdamW, activation offload), their refusals, and generation memory."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest
import torch
from memtrack import PeakLargeTensors

from leangrpo.core.errors import DeviceOptionError, UserError
from leangrpo.cpu.allocator import MMAP_THRESHOLD
from leangrpo.run.resolve import validate_config
from leangrpo.train.optim import activation_offload, build_optimizer
from leangrpo.train.preflight import World, preflight

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def make_cfg(**sections):
    data = {
        "model": {"name_or_path": "m"},
        "data": {"path": "d.jsonl"},
        "rewards": {"functions": [{"name": "int"}]},
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values} if isinstance(values, dict) else values
    return validate_config(data)


def test_defaults_need_nothing_special(tmp_path):
    cfg = make_cfg(output_dir=str(tmp_path / "run"))
    assert cfg.optim.optimizer == "adamw" and cfg.model.activation_offload is False
    assert cfg.grpo.ignore_eos is False
    preflight(cfg, World(device="cuda" if CUDA else "cpu"))  # no error anywhere


def test_optimizer_in_backward_refused_on_several_processes(tmp_path):
    cfg = make_cfg(optim={"optimizer_in_backward": True, "max_grad_norm": None}, output_dir=str(tmp_path))
    preflight(cfg, World(num_processes=1))
    with pytest.raises(UserError, match="^optim.optimizer_in_backward runs on one process only: the"):
        preflight(cfg, World(num_processes=2))


def test_unknown_optimizer_is_a_config_error():
    with pytest.raises(UserError, match="optim.optimizer"):
        make_cfg(optim={"optimizer": "sgd"})


@pytest.mark.skipif(CUDA, reason="the CPU refusal")
@pytest.mark.parametrize(
    ("sections", "needle"),
    [
        ({"model": {"activation_offload": True}}, "model.activation_offload=false"),
    ],
)
def test_gpu_options_refused_on_cpu_with_the_fix(tmp_path, sections, needle):
    with pytest.raises(DeviceOptionError, match="needs a CUDA GPU") as err:
        preflight(make_cfg(**sections, output_dir=str(tmp_path / "run")), World(device="cpu"))
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert isinstance(err.value, UserError)


@pytest.mark.parametrize(
    ("sections", "option"),
    [
        ({"optim": {"optimizer": "adamw_8bit"}}, "optim.optimizer=adamw_8bit"),
        ({"model": {"load_in_4bit": True, "lora": {"enabled": True}}}, "model.load_in_4bit"),
    ],
)
def test_bitsandbytes_options_without_bitsandbytes_name_the_install(tmp_path, monkeypatch, sections, option):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: None if n == "bitsandbytes" else real(n))
    with pytest.raises(UserError) as err:
        preflight(make_cfg(**sections, output_dir=str(tmp_path / "run")), World())
    assert str(err.value) == (
        f"{option} needs bitsandbytes: pip install 'leangrpo[qlora]' (or pip install bitsandbytes)"
    )


def test_build_optimizer_adamw_uses_the_config():
    cfg = make_cfg(optim={"learning_rate": 3e-4, "adam_beta2": 0.95, "weight_decay": 0.1})
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(3))], cfg.optim)
    assert type(opt) is torch.optim.AdamW
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (3e-4, (0.9, 0.95), 0.1)


def test_adamw_step_makes_no_parameter_sized_temporaries():
    """The fused kernel updates in place; the plain AdamW step allocates parameter-sized copies."""
    p = torch.nn.Parameter(torch.zeros(4096))
    opt = build_optimizer([p], make_cfg().optim)
    for _ in range(2):  # the first step creates the moment buffers; the second shows the steady state
        p.grad = torch.ones_like(p)
        with PeakLargeTensors(p.numel()) as step:
            opt.step()
    assert step.peak == 0


def test_activation_offload_disabled_is_a_no_op():
    x = torch.ones(3, requires_grad=True)
    with activation_offload(False):
        y = (x * x).sum()
    y.backward()
    assert torch.equal(x.grad, 2 * torch.ones(3))


def test_activation_offload_keeps_the_weights_and_copies_the_activations():
    """The LM head's weight, saved by its matmul for the backward, stays where it is (no [V, H] host copy
    per micro-batch); the hidden states it multiplies are copied off; the gradients are unchanged."""
    torch.manual_seed(0)
    head = torch.nn.Linear(4, 6, bias=False)
    x = torch.randn(3, 4, requires_grad=True)
    grads = []
    for offload in (False, True):
        head.zero_grad(set_to_none=True)
        x.grad = None
        with activation_offload(offload, head.parameters()):
            hidden = torch.tanh(x)
            y = head(hidden)
        if offload:
            fn = y.grad_fn
            saved = {n: getattr(fn, n) for n in dir(fn) if n.startswith("_saved_")}
            tensors = {n: t for n, t in saved.items() if isinstance(t, torch.Tensor)}
            ptr = head.weight.untyped_storage().data_ptr()
            kept = [n for n, t in tensors.items() if t.untyped_storage().data_ptr() == ptr]
            copied = [n for n, t in tensors.items() if torch.equal(t, hidden.detach())]
            assert kept and copied, tensors
            assert all(
                tensors[n].untyped_storage().data_ptr() != hidden.untyped_storage().data_ptr() for n in copied
            )
        y.square().sum().backward()
        grads.append((head.weight.grad.clone(), x.grad.clone()))
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_release_memory_empties_the_cuda_cache_or_asks_the_cpu_levers(monkeypatch):
    """After a phase: on CUDA the allocator's cached blocks go back; on CPU the levers trim glibc's heap."""
    from types import SimpleNamespace

    from leangrpo.train.levers import release_memory

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    release_memory(None)
    assert calls == ["empty"]
    release_memory(SimpleNamespace(release=lambda: calls.append("trim")))
    assert calls == ["empty", "trim"]


def test_generation_leaves_no_garbage_cycles(tiny_model_dir, levers):
    """Everything generation allocates is freed by reference counting when it returns, so no collector
    pass is needed between rollout and update."""
    import gc

    from leangrpo.config.schema import ModelConfig
    from leangrpo.engines.hf import generate
    from leangrpo.engines.types import Sampling
    from leangrpo.models.load import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    gc.collect()
    gc.disable()
    try:
        sampling = Sampling(num_generations=2, max_prompt_length=16, max_completion_length=6)
        generate(model, tok, ["a b c"], sampling, levers=levers)
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_generation_runs_without_grad_and_with_the_kv_cache(tiny_model_dir, levers):
    """Generation holds no autograd graph, and each new token is one position through the model (cache on),
    even when the model is in train mode with gradient checkpointing (which disables the cache there)."""
    from leangrpo.config.schema import ModelConfig
    from leangrpo.engines.hf import generate
    from leangrpo.engines.types import Sampling
    from leangrpo.models.load import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    model.train()
    calls = []

    def record(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        calls.append((ids.shape[1], torch.is_grad_enabled()))

    handle = model.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        sampling = Sampling(num_generations=2, max_prompt_length=32, max_completion_length=5, ignore_eos=True)
        batch = generate(model, tok, ["a b c d e"], sampling, levers=levers)
    finally:
        handle.remove()
    assert batch.completion_ids.shape == (2, 5)
    assert [grad for _, grad in calls] == [False] * len(calls)
    assert calls[0][0] > 1 and [n for n, _ in calls[1:]] == [1] * (len(calls) - 1)
    assert model.training  # train mode restored for the update


def test_adamw_8bit_steps_with_8bit_state(tmp_path):
    """bitsandbytes' 8-bit AdamW, on CPU or CUDA: uint8 moments for a large tensor, and it learns."""
    pytest.importorskip("bitsandbytes")
    cfg = make_cfg(optim={"optimizer": "adamw_8bit", "learning_rate": 1e-2}, output_dir=str(tmp_path / "run"))
    preflight(cfg, World(device="cuda" if CUDA else "cpu"))
    p = torch.nn.Parameter(torch.randn(8192, device="cuda" if CUDA else "cpu"))
    opt = build_optimizer([p], cfg.optim)
    assert type(opt).__name__ == "AdamW8bit"
    before = p.detach().clone()
    for _ in range(3):
        opt.zero_grad()
        (p**2).sum().backward()
        opt.step()
    assert opt.state[p]["state1"].dtype == torch.uint8 and opt.state[p]["state2"].dtype == torch.uint8
    assert p.detach().abs().sum() < before.abs().sum()  # three steps towards 0


@gpu
@needs_cuda
def test_activation_offload_gives_the_same_gradients_on_gpu(tiny_model_dir):
    from leangrpo.config.schema import ModelConfig
    from leangrpo.models.load import load_model_and_tokenizer
    from leangrpo.train.policy import Policy

    model, _ = load_model_and_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    policy = Policy(model.cuda().train())
    ids = torch.randint(0, 1000, (2, 12), device="cuda")
    mask = torch.ones_like(ids)
    grads = []
    for offload in (False, True):
        model.zero_grad(set_to_none=True)
        with activation_offload(offload):
            policy(ids, mask, 5).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_trainer_releases_freed_memory_after_generation_and_update(
    tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch
):
    """Order inside a step: generate (grpo.ignore_eos, cpu.packed_generation and cpu.packed_lm_head
    passed through) → release → update → release, and nothing else: at beta=0 and num_iterations=1
    neither reference nor old log-probs are computed."""
    import leangrpo.engines.hf as hf_mod
    import leangrpo.train.trainer as trainer_mod
    import leangrpo.train.update as update_mod
    from leangrpo.cpu.levers import CPULevers

    events, real_generate, real_logprobs = [], hf_mod.generate, update_mod.micro_batch_logprobs

    def generate(model, tokenizer, prompts, sampling, **kwargs):
        levers = kwargs["levers"].cfg
        events.append(("generate", sampling.ignore_eos, levers.packed_generation, levers.packed_lm_head))
        return real_generate(model, tokenizer, prompts, sampling, **kwargs)

    def logprobs(policy, *args, **kwargs):
        events.append(("update", torch.is_grad_enabled()))
        return real_logprobs(policy, *args, **kwargs)

    monkeypatch.setattr(hf_mod, "generate", generate)  # what the default HF engine calls
    monkeypatch.setattr(CPULevers, "release", lambda self: events.append(("release", None)))
    monkeypatch.setattr(update_mod, "micro_batch_logprobs", logprobs)
    cfg = make_cfg(
        model={"name_or_path": str(tiny_model_dir)},
        data={"path": str(gsm8k_dir / "train.jsonl"), "limit": 4},
        grpo={
            "num_generations": 2,
            "max_completion_length": 4,
            "ignore_eos": True,
        },
        cpu={"packed_generation": False, "packed_lm_head": False},
        optim={"per_device_train_batch_size": 2, "max_steps": 1},
        logging={"progress_bar": False, "log_completions_steps": 0},
        output_dir=str(tmp_path / "run"),
    )
    metrics = trainer_mod.Trainer(cfg).step(1)
    assert events == [
        ("generate", True, False, False),
        ("release", None),
        ("update", True),
        ("release", None),
    ]
    assert metrics["completions/mean_length"] == 4.0


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="the CPU refusal")
def test_cli_refuses_gpu_options_on_cpu_in_one_line(tmp_path, tiny_model_dir, gsm8k_dir):
    from test_e2e import run_cli, write_config

    cfg = write_config(tmp_path / "run.yaml", tiny_model_dir, gsm8k_dir / "train.jsonl", tmp_path / "r")
    proc = run_cli("train", "-c", str(cfg), "model.activation_offload=true")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "error: model.activation_offload needs a CUDA GPU (on CPU the activations already live in CPU "
        "memory); set model.activation_offload=false"
    ]


GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
# After a 16 MiB block is freed, glibc's default mmap threshold is 16 MiB, so a later 8 MiB tensor comes from
# the heap and stays in RSS when freed; prints how much RSS freeing it gave back.
FREED_8MIB = """
import sys, psutil, torch
from leangrpo.cpu.allocator import return_freed_memory
rss = lambda: psutil.Process().memory_info().rss
torch.ones(4 * 2**20)  # 16 MiB, mmapped and freed at once: glibc's dynamic threshold rises to 16 MiB
applied = return_freed_memory() if sys.argv[1] == "tuned" else None
x = torch.ones(2 * 2**20)  # 8 MiB, written
before = rss()
del x
print(applied, (before - rss()) // 2**20)
"""


FREED_SMALL = """
import psutil, torch
from leangrpo.cpu.allocator import release_freed_memory, return_freed_memory
rss = lambda: psutil.Process().memory_info().rss
return_freed_memory()
blocks = [torch.ones(2**19) for _ in range(100)]  # 200 MiB in 2 MiB blocks: under the threshold, on the heap
keep = torch.ones(2**18)  # 1 MiB above them that stays: the heap's top cannot shrink
del blocks
before = rss()
release_freed_memory()
print((before - rss()) // 2**20)
"""


@pytest.mark.skipif(not GLIBC, reason="glibc's allocator only")
def test_release_freed_memory_returns_freed_heap_blocks_with_glibc():
    """Blocks under the mmap threshold (a packed Linear weight, a small activation) stay resident when
    freed in the middle of the heap; release_freed_memory hands their pages back (malloc_trim)."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    proc = subprocess.run(
        [sys.executable, "-c", FREED_SMALL], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout) >= 150


@pytest.mark.skipif(not GLIBC, reason="glibc's allocator only")
@pytest.mark.parametrize("mode", ["default", "tuned", "user_env"])
def test_freed_activations_leave_rss_with_glibc(mode):
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    if mode == "user_env":  # the user's own setting wins: leangrpo leaves it alone
        env["MALLOC_MMAP_THRESHOLD_"] = str(32 * 2**20)
    args = [sys.executable, "-c", FREED_8MIB, "tuned" if mode != "default" else "default"]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    applied, returned_mib = proc.stdout.split()
    if mode == "tuned":
        assert (applied, int(returned_mib) >= 7) == (str(MMAP_THRESHOLD), True)
    else:
        assert (applied, int(returned_mib) < 2) == ("None", True)


def test_trainer_sets_the_allocator_before_loading_anything(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch):
    import leangrpo.train.trainer as trainer_mod
    from leangrpo.cpu.levers import CPULevers

    events = []
    monkeypatch.setattr(CPULevers, "before_loading", lambda self: events.append("allocator"))
    real_load = trainer_mod.load_model_and_tokenizer
    monkeypatch.setattr(
        trainer_mod,
        "load_model_and_tokenizer",
        lambda cfg, *given, **kw: events.append("load") or real_load(cfg, *given, **kw),
    )
    cfg = make_cfg(
        model={"name_or_path": str(tiny_model_dir)},
        data={"path": str(gsm8k_dir / "train.jsonl"), "limit": 4},
        grpo={"num_generations": 2},
        optim={"per_device_train_batch_size": 2},
        logging={"progress_bar": False},
        output_dir=str(tmp_path / "run"),
    )
    trainer_mod.Trainer(cfg)
    assert events == ["allocator", "load"]


def test_bf16_reference_copy_keeps_fp32_logprobs_and_a_small_kl(tmp_path, tiny_model_dir, gsm8k_dir):
    """grpo.reference_dtype: bfloat16 makes the full-fine-tuning reference's parameters bf16 (tied
    embeddings still tied, rotary buffers still fp32) while the policy trains in fp32, and its log-probs
    come back in fp32 within a stated bound of the fp32 reference's: at the start, the policy is the
    reference, so the per-token k3 KL against the bf16 copy is the error it introduces."""
    import leangrpo.train.trainer as trainer_mod
    from leangrpo.core.grpo import kl_k3
    from leangrpo.train.policy import batch_logprobs

    cfg = make_cfg(
        model={"name_or_path": str(tiny_model_dir)},
        data={"path": str(gsm8k_dir / "train.jsonl"), "limit": 4},
        grpo={"num_generations": 4, "max_completion_length": 16, "beta": 0.04, "reference_dtype": "bfloat16"},
        optim={"per_device_train_batch_size": 4},
        logging={"progress_bar": False},
        output_dir=str(tmp_path / "run"),
    )
    trainer = trainer_mod.Trainer(cfg)
    ref = trainer.ref_policy.lm
    assert {p.dtype for p in ref.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in trainer.unwrapped.parameters()} == {torch.float32}
    assert ref.get_output_embeddings().weight is ref.get_input_embeddings().weight
    assert ref.model.rotary_emb.inv_freq.dtype == torch.float32
    rollout = trainer.source.rollout(1).batch
    ref_logp = trainer.updater.reference(rollout).ref_logp
    with torch.no_grad():
        logp = batch_logprobs(trainer.unwrapped, rollout, 4, trainer.group)
    mask = rollout.completion_mask.bool()
    assert ref_logp.dtype == torch.float32
    diff = (ref_logp - logp).abs()[mask]
    # bf16 rounding shows, within the bounds measured on the real SmolLM2-135M (docs/memory.md)
    assert 0 < float(diff.max()) < 0.25
    assert float(kl_k3(logp, ref_logp)[mask].max()) < 0.02


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS from /proc, madvise")
def test_disk_tensors_leave_memory_after_a_pass_and_keep_their_values(tmp_path):
    """DiskTensors: the copies hold the values (in their dtype), count in the process's memory only
    between a read and drop_pages, read the same after it, and leave no file behind."""
    import psutil

    from leangrpo.cpu.disk import DiskTensors

    rss = lambda: psutil.Process().memory_info().rss / 2**20  # noqa: E731
    disk = DiskTensors(tmp_path)
    source = torch.randn(16 * 2**20 // 4, 4)  # 64 MiB
    tied = disk.copy(source, torch.float32)
    small = disk.copy(torch.arange(3.0), torch.bfloat16)  # not a whole page
    assert torch.equal(tied, source) and small.dtype == torch.bfloat16 and small.tolist() == [0, 1, 2]
    assert list(tmp_path.iterdir()) == []  # the file has no name
    before = rss()
    disk.drop_pages()
    dropped = rss()
    assert before - dropped > 56  # the 64 MiB copy's pages left the process
    assert torch.equal(tied, source)  # read back from the file
    assert rss() - dropped > 56


def test_disk_tensors_on_a_full_disk_is_one_error(tmp_path, monkeypatch):
    """No room for the copy: a UserError naming the option and the folder, before any page is written
    (a write to a mapped page without disk blocks would kill the process with SIGBUS)."""
    import errno

    from leangrpo.cpu.disk import DiskTensors

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    disk = DiskTensors(tmp_path)
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(UserError, match=rf"no room for the reference copy in {tmp_path} \(No space left"):
        disk.copy(torch.ones(10), torch.float32)
    with pytest.raises(UserError, match="cannot write in /nonexistent"):
        DiskTensors(Path("/nonexistent"))


def test_reference_on_disk_gives_the_same_logprobs(tmp_path, tiny_model_dir, gsm8k_dir):
    """grpo.reference_on_disk: the full-fine-tuning reference's parameters live in the file (tied
    embeddings still tied), its log-probs equal the in-memory copy's exactly, a step trains, and the run
    directory holds nothing of it."""
    import leangrpo.train.trainer as trainer_mod
    from leangrpo.cpu.disk import DiskTensors

    def trainer(name, on_disk):
        return trainer_mod.Trainer(make_cfg(
            model={"name_or_path": str(tiny_model_dir)},
            data={"path": str(gsm8k_dir / "train.jsonl"), "limit": 4},
            grpo={"num_generations": 4, "max_completion_length": 16, "beta": 0.04},
            cpu={"reference_on_disk": on_disk},
            optim={"per_device_train_batch_size": 4, "max_steps": 1},
            logging={"progress_bar": False, "log_completions_steps": 0},
            output_dir=str(tmp_path / name),
        ))  # fmt: skip

    mapped, plain = trainer("disk", True), trainer("memory", False)
    assert isinstance(mapped.updater.ref_pages, DiskTensors) and plain.updater.ref_pages is None
    ref = mapped.ref_policy.lm
    addresses = {p.data_ptr() for p in ref.parameters()}
    assert len(mapped.updater.ref_pages.maps) == len(addresses)  # every parameter in a region of the file
    assert ref.get_output_embeddings().weight is ref.get_input_embeddings().weight
    rollout = mapped.source.rollout(1).batch
    logp_disk = mapped.updater.reference(rollout).ref_logp
    logp_memory = plain.updater.reference(rollout).ref_logp
    assert torch.equal(logp_disk, logp_memory)
    metrics = mapped.step(1)
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    plain.step(1)
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == sorted(
        p.name for p in (tmp_path / "memory").iterdir()
    )


def test_reference_on_disk_is_the_default_on_cpu_and_falls_back_to_memory(
    tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch
):
    """cpu.reference_on_disk unset: on disk on CPU; where the disk has no room, in memory with a note
    (asked for, the same is an error)."""
    import leangrpo.train.trainer as trainer_mod
    from leangrpo.core.errors import DeviceOptionError
    from leangrpo.cpu.disk import DiskTensors

    def trainer(name, on_disk=None):
        return trainer_mod.Trainer(make_cfg(
            model={"name_or_path": str(tiny_model_dir)},
            data={"path": str(gsm8k_dir / "train.jsonl"), "limit": 4},
            grpo={"num_generations": 4, "beta": 0.04},
            cpu={} if on_disk is None else {"reference_on_disk": on_disk},
            optim={"per_device_train_batch_size": 4, "max_steps": 1},
            logging={"progress_bar": False, "log_completions_steps": 0},
            output_dir=str(tmp_path / name),
        ))  # fmt: skip

    assert isinstance(trainer("default").updater.ref_pages, DiskTensors)
    assert trainer("off", False).updater.ref_pages is None

    def full(self, t, dtype):
        raise DeviceOptionError("grpo.reference_on_disk: no room for the reference copy")

    monkeypatch.setattr(DiskTensors, "copy", full)
    notes = []
    monkeypatch.setattr(trainer_mod.Trainer, "_write", lambda self, line: notes.append(line))
    fallback = trainer("full")
    assert fallback.updater.ref_pages is None and fallback.ref_policy is not None
    assert [note for note in notes if not note.startswith("cpu.matmul auto:")] == [
        "grpo.reference_on_disk: no room for the reference copy; the reference copy stays in memory"
    ]
    with pytest.raises(DeviceOptionError, match="no room"):
        trainer("asked", True)


def test_reference_on_disk_is_refused_under_fsdp(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch):
    """Sharding the reference would copy it out of the file: one line, before any step."""
    import leangrpo.train.trainer as trainer_mod
    from leangrpo.train import distributed

    monkeypatch.setattr(trainer_mod.distributed, "setup", distributed.Sharded)
    cfg = make_cfg(
        model={"name_or_path": str(tiny_model_dir)},
        data={"path": str(gsm8k_dir / "train.jsonl"), "limit": 4},
        grpo={"num_generations": 4, "beta": 0.04},
        cpu={"reference_on_disk": True},
        optim={"per_device_train_batch_size": 4},
        output_dir=str(tmp_path / "run"),
    )
    with pytest.raises(trainer_mod.TrainingError, match="reference_on_disk is for CPU runs without FSDP"):
        trainer_mod.Trainer(cfg)


def in_backward_cfg(tmp_path, tiny_model_dir, gsm8k_dir, name, in_backward, optimizer="adamw"):
    return make_cfg(
        model={"name_or_path": str(tiny_model_dir)},  # full fine-tuning, tied embeddings
        data={"path": str(gsm8k_dir / "train.jsonl"), "limit": 8},
        grpo={"num_generations": 4, "max_completion_length": 8, "ignore_eos": True},
        optim={"per_device_train_batch_size": 4, "max_steps": 2, "learning_rate": 1e-3,
               "optimizer": optimizer, "max_grad_norm": None, "optimizer_in_backward": in_backward},
        logging={"progress_bar": False, "log_completions_steps": 0},
        output_dir=str(tmp_path / name),
    )  # fmt: skip


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit"])
def test_optimizer_in_backward_trains_as_stepping_after_it(tmp_path, tiny_model_dir, gsm8k_dir, optimizer):
    """optim.optimizer_in_backward: two steps give the weights and gradient norms of the usual step
    (no clipping in either), every trainable tensor stepped once per step (the tied embedding once,
    after both its uses), and each step seeing no gradient but its own parameter's."""
    import leangrpo.train.trainer as trainer_mod

    runs = {}
    for in_backward in (False, True):
        cfg = in_backward_cfg(tmp_path, tiny_model_dir, gsm8k_dir, f"ib{in_backward}", in_backward, optimizer)
        trainer = trainer_mod.Trainer(cfg)
        params = [p for p in trainer.unwrapped.parameters() if p.requires_grad]
        with_grad: list[int] = []
        step = trainer.optimizer.step

        def counting_step(*args, step=step, params=params, with_grad=with_grad, **kwargs):
            with_grad.append(sum(p.grad is not None for p in params))
            return step(*args, **kwargs)

        trainer.optimizer.step = counting_step
        norms = [trainer.step(s)["grad_norm"] for s in (1, 2)]
        assert all(p.grad is None for p in params)
        runs[in_backward] = (norms, [p.detach().clone() for p in params], with_grad, len(params))
    (norms, weights, with_grad, n), (ib_norms, ib_weights, ib_with_grad, _) = runs[False], runs[True]
    assert with_grad == [n, n]  # the usual step: every gradient at once
    assert ib_with_grad == [1] * (2 * n)  # in the backward: one parameter at a time, each once a step
    assert ib_norms == pytest.approx(norms, rel=1e-4)
    for a, b in zip(weights, ib_weights, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_optimizer_in_backward_leaves_the_cold_start_alone(tmp_path, tiny_model_dir, gsm8k_dir):
    """The hooks step only inside the update's backward: another backward through the same weights
    (the cold start's, with its own optimizer) leaves the gradients to that optimizer."""
    import leangrpo.train.trainer as trainer_mod

    trainer = trainer_mod.Trainer(in_backward_cfg(tmp_path, tiny_model_dir, gsm8k_dir, "run", True))
    params = [p for p in trainer.unwrapped.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    rollout = trainer.source.rollout(1).batch
    from leangrpo.train.policy import micro_batch_logprobs

    logp, _ = micro_batch_logprobs(trainer.policy, rollout, slice(None), group=trainer.group)
    logp.sum().backward()
    assert all(p.grad is not None for p in params)
    assert all(torch.equal(a, p) for a, p in zip(before, params, strict=True))


@pytest.mark.parametrize(
    ("optim", "needle"),
    [
        ({"optimizer_in_backward": True}, "set max_grad_norm: null"),
        ({"optimizer_in_backward": True, "max_grad_norm": None, "gradient_accumulation_steps": 2},
         "set gradient_accumulation_steps: 1"),
    ],
)  # fmt: skip
def test_optimizer_in_backward_refuses_clipping_and_accumulation(optim, needle):
    with pytest.raises(UserError, match=needle) as e:
        make_cfg(optim=optim)
    assert "\n" not in str(e.value) and "optim" in str(e.value)


def test_max_grad_norm_zero_turns_clipping_off_as_in_trl():
    assert make_cfg(optim={"max_grad_norm": 0}).optim.max_grad_norm is None
    assert make_cfg().optim.max_grad_norm == 1.0


@pytest.mark.parametrize(
    "kind, kwargs",
    [
        ("linear", None),
        ("cosine", None),
        ("cosine", {"num_cycles": 1.0}),
        ("constant", None),
        ("cosine_with_min_lr", {"min_lr_rate": 0.1}),
        ("cosine_with_min_lr", {"min_lr": 0.02}),
        ("cosine_with_restarts", {"num_cycles": 2}),
        ("polynomial", {"lr_end": 0.01, "power": 2.0}),
        ("constant_with_warmup", None),
        ("inverse_sqrt", {"timescale": 2}),
        ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.1, "warmup_lr_rate": 0.2}),
        ("warmup_stable_decay", {"num_decay_steps": 4, "decay_type": "linear"}),
    ],
)
@pytest.mark.parametrize("warmup", [0, 3])
def test_build_scheduler_follows_transformers_get_scheduler(kind, kwargs, warmup):
    """Our schedules give transformers' learning rates step for step (TRL users' configs keep their
    schedule), without importing transformers.optimization (which pulls in peft and bitsandbytes)."""
    from transformers import get_scheduler

    from leangrpo.train.optim import build_scheduler

    def rates(make):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        scheduler = make(optimizer)
        out = []
        for _ in range(12):
            out.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
        return out

    from leangrpo.config.schema import OptimConfig

    cfg = OptimConfig(
        learning_rate=0.1, lr_scheduler_type=kind, lr_scheduler_kwargs=kwargs, warmup_steps=warmup
    )
    ours = rates(lambda opt: build_scheduler(opt, cfg, 10))
    theirs = rates(
        lambda opt: get_scheduler(
            kind, opt, num_warmup_steps=warmup, num_training_steps=10, scheduler_specific_kwargs=kwargs
        )
    )
    assert ours == pytest.approx(theirs, abs=1e-12)
    assert len(set(ours)) > 1 or kind == "constant" or kind == "constant_with_warmup" and not warmup


def test_scheduler_names_and_kwargs_are_transformers():
    """The config's schedule names are transformers' SchedulerType, and what each reads from
    lr_scheduler_kwargs is its function's signature (less the optimizer, step counts and last_epoch)."""
    import inspect

    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION, SchedulerType

    from leangrpo.config.schema import METRIC_SCHEDULERS, SCHEDULER_KWARGS, ScheduleName

    assert set(get_args(ScheduleName)) == {t.value for t in SchedulerType}
    fixed = {"optimizer", "num_warmup_steps", "num_training_steps", "last_epoch"}
    for kind, takes in SCHEDULER_KWARGS.items():
        params = inspect.signature(TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(kind)]).parameters
        assert set(takes) == set(params) - fixed, kind
    assert set(SCHEDULER_KWARGS) | set(METRIC_SCHEDULERS) == set(get_args(ScheduleName))


@pytest.mark.parametrize(
    "kind, kwargs, message",
    [
        (
            "polynomial",
            {"num_cycles": 2},
            "lr_scheduler_kwargs num_cycles: not read by polynomial (it reads lr_end, power)",
        ),
        (
            "constant_with_warmup",
            {"power": 2},
            "lr_scheduler_kwargs power: not read by constant_with_warmup (it reads none)",
        ),
        (
            "warmup_stable_decay",
            None,
            "warmup_stable_decay needs lr_scheduler_kwargs with one of: num_decay_steps",
        ),
        (
            "cosine_with_min_lr",
            {"min_lr": 0.1, "min_lr_rate": 0.1},
            "needs lr_scheduler_kwargs with one of: min_lr, min_lr_rate",
        ),
        (
            "reduce_lr_on_plateau",
            None,
            "lr_scheduler_type reduce_lr_on_plateau steps on an evaluation metric",
        ),
        ("greedy", None, "lr_scheduler_type greedy steps on an evaluation metric"),
    ],
)
def test_scheduler_kwargs_are_refused_in_one_line(kind, kwargs, message):
    """A schedule's wrong or missing kwargs, and the metric-stepped schedules, are one config error."""
    from leangrpo.config.schema import OptimConfig

    with pytest.raises(ValueError, match=re.escape(message)):
        OptimConfig(lr_scheduler_type=kind, lr_scheduler_kwargs=kwargs)


@pytest.mark.parametrize("kind, kwargs", [("polynomial", {"power": 2.0}), ("cosine", None)])
def test_scheduler_state_resumes(kind, kwargs):
    """A schedule's state_dict (what a checkpoint keeps) continues the same learning rates in a new one."""
    from leangrpo.config.schema import OptimConfig
    from leangrpo.train.optim import build_scheduler

    cfg = OptimConfig(learning_rate=0.1, lr_scheduler_type=kind, lr_scheduler_kwargs=kwargs, warmup_steps=2)

    def fresh():
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        return optimizer, build_scheduler(optimizer, cfg, 10)

    opt, whole = fresh()
    rates = []
    for step in range(8):
        if step == 4:
            saved = (opt.state_dict(), whole.state_dict())
        rates.append(whole.get_last_lr()[0])
        opt.step()
        whole.step()
    opt, resumed = fresh()
    opt.load_state_dict(saved[0])
    resumed.load_state_dict(saved[1])
    later = []
    for _ in range(4):
        later.append(resumed.get_last_lr()[0])
        opt.step()
        resumed.step()
    assert later == pytest.approx(rates[4:], abs=1e-12) and len(set(rates)) > 2


def test_trainer_does_not_import_peft_for_full_fine_tuning(tmp_path, tiny_model_dir, gsm8k_dir):
    """A full fine-tuning Trainer, schedule included, does not pull in peft and bitsandbytes (69 MiB of
    RSS and 1.5 s through transformers.optimization)."""
    cfg = {
        "model": {"name_or_path": str(tiny_model_dir)},
        "data": {"path": str(gsm8k_dir / "train.jsonl"), "limit": 4},
        "rewards": {"functions": [{"name": "int"}]},
        "optim": {"lr_scheduler_type": "cosine", "warmup_steps": 2},
        "output_dir": str(tmp_path / "run"),
    }
    code = (
        "import sys; from leangrpo.run.resolve import validate_config\n"
        "from leangrpo.train.trainer import Trainer\n"
        f"t = Trainer(validate_config({cfg!r})); "
        "print('peft' in sys.modules, 'bitsandbytes' in sys.modules, t.scheduler.get_last_lr()[0])"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.stdout.splitlines()[-1].split() == ["False", "False", "0.0"], proc.stderr[-2000:]


def test_the_trainer_ignores_accelerates_mixed_precision(tmp_path, tiny_model_dir, gsm8k_dir):
    """`accelerate launch` configured with bf16 or fp16 must not wrap leangrpo's step in autocast or scale
    its loss (the optimizer is leangrpo's own, so the scale would never be undone): model.dtype decides."""
    cfg = {
        "model": {"name_or_path": str(tiny_model_dir)},
        "data": {"path": str(gsm8k_dir / "train.jsonl"), "limit": 4},
        "rewards": {"functions": [{"name": "int"}]},
        "output_dir": str(tmp_path / "run"),
    }
    code = (
        "from leangrpo.run.resolve import validate_config\n"
        "from leangrpo.train.trainer import Trainer\n"
        f"print(Trainer(validate_config({cfg!r})).acc.mixed_precision)"
    )
    env = {**os.environ, "ACCELERATE_MIXED_PRECISION": "bf16"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.stdout.splitlines()[-1].split() == ["no"], proc.stderr[-2000:]
