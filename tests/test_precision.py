"""bf16 full fine-tuning steps fp32 master copies (`optim.master_weights`), and fp16 is refused in one
line (issue 53, item 4)."""

from __future__ import annotations

import pytest
import torch
from test_memory import make_cfg

from leangrpo.core.errors import UserError
from leangrpo.train.optim import build_optimizer
from leangrpo.train.precision import STATE_KEY, MasterWeights
from leangrpo.train.preflight import World, preflight


def test_bf16_weights_move_by_steps_below_half_their_rounding_step():
    """100 AdamW steps of lr 1e-4 on bf16 weights of 1.0 (a bf16 step there is 2^-7, about 78 of them):
    stepped directly each update rounds away and the weights stay 1.0; through fp32 masters they move
    by the 100 updates' 0.01, to within one bf16 rounding, and the masters survive a state-dict trip."""
    cfg = make_cfg(optim={"learning_rate": 1e-4, "weight_decay": 0.0}).optim

    def train(masters: bool) -> tuple[torch.Tensor, torch.optim.Optimizer]:
        weight = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
        if masters:
            mw = MasterWeights([weight])
            optimizer = mw.attach(build_optimizer(mw.masters, cfg))
        else:
            optimizer = build_optimizer([weight], cfg)
        for _ in range(100):
            weight.grad = torch.ones_like(weight)
            optimizer.step()
            weight.grad = None
        return weight, optimizer

    direct, _ = train(False)
    assert torch.equal(direct, torch.ones_like(direct))  # the problem: every update rounded away
    weight, optimizer = train(True)
    assert weight.dtype == torch.bfloat16
    assert (weight.float() - (1 - 100 * 1e-4)).abs().max() <= 2**-7
    state = optimizer.state_dict()
    master = state[STATE_KEY][0]
    assert master.dtype == torch.float32 and torch.equal(weight, master.to(torch.bfloat16))

    fresh = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    mw = MasterWeights([fresh])
    mw.attach(build_optimizer(mw.masters, cfg)).load_state_dict(state)
    assert torch.equal(mw.masters[0], master) and torch.equal(fresh, weight)


def test_bf16_full_fine_tuning_steps_fp32_masters_at_lr_1e_6(tmp_path, tiny_model_dir, gsm8k_dir, capsys):
    """A bf16 full fine-tuning run with optim.master_weights: its optimizer steps fp32 copies, which
    move at the default lr 1e-6, and the bf16 weights are those copies rounded; the start-up line says
    so. Without it (the CPU default) a line says what is lost."""
    import leangrpo.train.trainer as trainer_mod

    def trainer(name, master_weights):
        return trainer_mod.Trainer(make_cfg(
            model={"name_or_path": str(tiny_model_dir), "dtype": "bfloat16"},
            data={"path": str(gsm8k_dir / "train.jsonl"), "limit": 4},
            grpo={"num_generations": 4, "max_completion_length": 8, "ignore_eos": True},
            optim={"per_device_train_batch_size": 4, "master_weights": master_weights},
            logging={"progress_bar": False, "log_completions_steps": 0},
            output_dir=str(tmp_path / name),
        ))  # fmt: skip

    plain = trainer("plain", None)
    assert "weights are stepped in bfloat16 (the default on CPU)" in capsys.readouterr().out
    plain._announce()  # the run's start-up line says the (resolved) model.dtype
    assert "training on 1 process, device cpu (bfloat16)" in capsys.readouterr().out
    assert {p.dtype for g in plain.optimizer.param_groups for p in g["params"]} == {torch.bfloat16}

    run = trainer("masters", True)
    assert "bfloat16 weights stepped through fp32 master copies" in capsys.readouterr().out
    weights = [p for p in run.unwrapped.parameters() if p.requires_grad]
    masters = [p for g in run.optimizer.param_groups for p in g["params"]]
    assert {p.dtype for p in weights} == {torch.bfloat16} and {p.dtype for p in masters} == {torch.float32}
    before = [m.detach().clone() for m in masters]
    rollout = run.source.rollout(1).batch
    update = run.updater.update(rollout, torch.linspace(-1, 1, len(rollout)), run.updater.reference(rollout))
    assert update.grad_norm > 0 and run.updater.skipped_steps == 0
    moved = max(float((m - b).abs().max()) for m, b in zip(masters, before, strict=True))
    assert 1e-7 < moved < 1e-5  # AdamW's first step: about lr per element
    assert all(torch.equal(w, m.to(torch.bfloat16)) for w, m in zip(weights, masters, strict=True))
    assert all(w.grad is None for w in weights) and all(m.grad is None for m in masters)


def test_fp16_training_is_refused_in_one_line(tmp_path):
    cfg = make_cfg(model={"dtype": "fp16"}, output_dir=str(tmp_path / "run"))
    with pytest.raises(UserError, match=r"^model.dtype float16 cannot train: nothing scales the loss") as e:
        preflight(cfg, World(1, "cpu", False))
    assert "\n" not in str(e.value)


def test_optimizer_in_backward_steps_fp32_masters_at_lr_1e_6(tmp_path, tiny_model_dir, gsm8k_dir, capsys):
    """optim.master_weights with optim.optimizer_in_backward: each parameter's hook steps its own fp32
    master (the optimizer shown that one master), so at lr 1e-6 the masters move, the bf16 weights are
    them rounded, and no gradient is left behind; the start-up line says masters are stepped."""
    import leangrpo.train.trainer as trainer_mod

    run = trainer_mod.Trainer(make_cfg(
        model={"name_or_path": str(tiny_model_dir), "dtype": "bfloat16"},
        data={"path": str(gsm8k_dir / "train.jsonl"), "limit": 4},
        grpo={"num_generations": 4, "max_completion_length": 8, "ignore_eos": True},
        optim={"per_device_train_batch_size": 4, "master_weights": True, "optimizer_in_backward": True,
               "max_grad_norm": None},
        logging={"progress_bar": False, "log_completions_steps": 0},
        output_dir=str(tmp_path / "run"),
    ))  # fmt: skip
    assert "bfloat16 weights stepped through fp32 master copies" in capsys.readouterr().out
    weights = [p for p in run.unwrapped.parameters() if p.requires_grad]
    masters = [p for g in run.optimizer.param_groups for p in g["params"]]
    assert {p.dtype for p in masters} == {torch.float32} and len(masters) == len(weights)
    before = [m.detach().clone() for m in masters]
    rollout = run.source.rollout(1).batch
    update = run.updater.update(rollout, torch.linspace(-1, 1, len(rollout)), run.updater.reference(rollout))
    assert update.grad_norm > 0 and run.updater.skipped_steps == 0
    moved = [float((m - b).abs().max()) for m, b in zip(masters, before, strict=True)]
    assert all(1e-7 < d < 1e-5 for d in moved)  # every master took AdamW's first step, about lr
    assert all(torch.equal(w, m.to(torch.bfloat16)) for w, m in zip(weights, masters, strict=True))
    assert all(w.grad is None for w in weights) and all(m.grad is None for m in masters)
    groups = run.optimizer.param_groups  # restored after each one-master step
    assert len(groups) == 1 and len(groups[0]["params"]) == len(masters)


@pytest.fixture
def tf32_flags():
    """torch's TF32 flags, off for the test and restored after it."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_tf32_is_on_for_fp32_weights_on_a_gpu_and_said(tf32_flags):
    """A deliberate difference from TRL (which leaves torch's TF32 off): on a GPU, fp32 weights' matmuls
    run in TF32 unless model.tf32 is false, in one start-up line; nothing changes on CPU."""
    from leangrpo.train.precision import set_tf32

    lines: list[str] = []
    set_tf32(make_cfg(), torch.device("cpu"), lines.append)
    assert lines == [] and not torch.backends.cuda.matmul.allow_tf32
    set_tf32(make_cfg(), torch.device("cuda"), lines.append)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert lines == ["precision: fp32 matmuls in TF32 on the GPU (model.tf32)"]
    set_tf32(make_cfg(model={"dtype": "bfloat16"}), torch.device("cuda"), lines.append)
    assert not torch.backends.cuda.matmul.allow_tf32  # bf16 weights: no fp32 matmul asked for it
    set_tf32(make_cfg(model={"tf32": False}), torch.device("cuda"), lines.append)
    assert not torch.backends.cuda.matmul.allow_tf32 and lines[-1].endswith(
        "in full fp32 on the GPU (model.tf32)"
    )


@pytest.mark.parametrize(
    "cuda, bf16, want", [(False, False, "float32"), (True, True, "bfloat16"), (True, False, "float32")]
)
def test_model_dtype_auto_is_bf16_on_a_bf16_gpu_only(monkeypatch, tmp_path, cuda, bf16, want):
    """model.dtype's default (auto) is resolved once when the config is read: bfloat16 on a CUDA device
    that runs bf16, float32 on CPU (CPU runs unchanged) or an older GPU. A set dtype is kept, the vLLM
    engine is built in the resolved one (never vLLM's own "auto"), and a TRL config that leaves bf16 unset
    stays float32 as docs/trl.md says (leangrpo computes in model.dtype without TRL's autocast)."""
    from leangrpo.config.trl import from_trl
    from leangrpo.engines import vllm
    from leangrpo.run.resolve import validate_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    cfg = make_cfg(model={"name_or_path": str(tmp_path)})
    assert cfg.model.dtype == want
    assert make_cfg(model={"dtype": "float32"}).model.dtype == "float32"
    built: dict = {}
    monkeypatch.setattr(vllm, "build_llm", lambda *a, **k: built.update(k))
    vllm.VLLMEngine.from_config(cfg, None, [0])  # type: ignore[arg-type]
    assert built["dtype"] == want
    trl = from_trl({"model_name_or_path": "m", "dataset_name": "d.jsonl"}, "trl.yaml")
    assert validate_config({**trl, "rewards": {"functions": [{"name": "int"}]}}).model.dtype == "float32"


def test_fsdp2_master_weights_default_like_one_process_and_say_so():
    """Under FSDP2 optim.master_weights keeps fp32 shards (no longer refused): null is on for a GPU and
    off on CPU, as without FSDP2; with fp32 shards the optimizer steps them as they are, in one line."""
    from types import SimpleNamespace

    from leangrpo.train.distributed import Sharded
    from leangrpo.train.precision import precise_optimizer

    def sharded(device: str, asked: bool | None) -> Sharded:
        return Sharded(SimpleNamespace(device=torch.device(device)), asked)  # type: ignore[arg-type]

    assert sharded("cuda", None).master_weights and not sharded("cpu", None).master_weights
    assert sharded("cpu", True).master_weights and not sharded("cuda", False).master_weights
    dist, lines = sharded("cpu", True), []
    dist.compute_dtype = torch.bfloat16  # as `wrap` leaves it for a bf16 policy
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer, masters = precise_optimizer(
        [weight], make_cfg(optim={"master_weights": True}), dist, lines.append
    )
    assert masters is None and optimizer.param_groups[0]["params"] == [weight]
    assert lines == [
        "precision: bfloat16 compute, fp32 sharded weights stepped by the optimizer (FSDP2 "
        "MixedPrecisionPolicy, gradients reduced in fp32; optim.master_weights)"
    ]
