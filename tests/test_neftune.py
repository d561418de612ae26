"""NEFTune (`neftune_noise_alpha`, issue 51): transformers' own noise, on the forwards TRL noises (its
model in train mode: generation, old-policy, LoRA-reference and training passes), not on evaluation's or
the frozen reference copy's; each completion drawn apart; from TRL's Python API and a flat TRL YAML."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from torch import nn
from transformers.integrations.neftune import neftune_post_forward_hook

from leangrpo.models import neftune

ALPHA = 5.0


class Tiny(nn.Module):
    """A model whose input embeddings transformers' hook would take."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed


def test_the_noise_is_transformers_hook_drawn_per_forward_and_per_row():
    torch.manual_seed(0)
    ours, theirs = Tiny(), Tiny()
    theirs.load_state_dict(ours.state_dict())
    theirs.embed.neftune_noise_alpha = ALPHA
    theirs.embed.register_forward_hook(neftune_post_forward_hook)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9]] * 3)  # three completions of one prompt, L = 7, d = 16
    clean = ours.embed.weight[ids]
    neftune.activate(ours.eval(), ALPHA)  # eval mode too: leangrpo's engines generate in eval mode
    for _ in range(2):  # same draws from the same RNG state: the same numbers as transformers' hook
        torch.manual_seed(1)
        noised = ours.embed(ids)
        torch.manual_seed(1)
        assert torch.equal(noised, theirs.train().embed(ids))
    bound = ALPHA / math.sqrt(7 * 16)
    noise = ours.embed(ids) - clean
    assert float(noise.abs().max()) <= bound * (1 + 1e-6) and float(noise.abs().max()) > 0.9 * bound
    assert abs(float(noise.abs().mean()) - bound / 2) < 0.1 * bound  # uniform on ±bound
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise, ours.embed(ids) - clean)
    assert neftune.noised(ours)
    with neftune.quiet(ours):
        assert torch.equal(ours.embed(ids), clean) and not neftune.noised(ours)
    assert not torch.equal(ours.embed(ids), clean)
    neftune.deactivate(ours)
    assert torch.equal(ours.embed(ids), clean) and not ours.embed._forward_hooks


class Forwards:
    """Records, for each forward of an embedding module, its output's shape and whether it was noised."""

    def __init__(self, module: nn.Module) -> None:
        self.seen: list[tuple[tuple[int, ...], bool]] = []
        module.register_forward_hook(self)

    def __call__(self, module, args, output):
        self.seen.append((tuple(output.shape), not torch.equal(output, module.weight[args[0]])))

    def take(self) -> list[tuple[tuple[int, ...], bool]]:
        seen, self.seen = self.seen, []
        return seen


def make_trainer(tmp_path, tiny_model_dir, alpha, lora=False):
    """A Trainer of the tiny model with the CPU levers (the lean decode loop: packed_generation) on."""
    from leangrpo.run.resolve import validate_config
    from leangrpo.train.trainer import Trainer

    data = tmp_path / "train.jsonl"  # prompts of different lengths: micro-batches of different extents
    rows = [{"prompt": "Say " + "very " * 3 * i + str(i), "answer": str(i)} for i in range(4)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    lora_section = {"lora": {"enabled": True, "r": 4}} if lora else {}
    cfg = validate_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), **lora_section},
            "data": {"path": str(data)},
            "rewards": {"functions": [{"name": "int"}]},
            "grpo": {
                "num_generations": 2, "max_completion_length": 4, "beta": 0.1, "neftune_noise_alpha": alpha,
                "steps_per_generation": 2,  # two micro-batches, one optimizer step each: the old-policy pass
            },
            "optim": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 2},
            "eval": {"enabled": True, "path": str(data), "split": "train", "limit": 2, "max_new_tokens": 3},
            "logging": {"progress_bar": False},
            "output_dir": str(tmp_path / "run"),
        }
    )  # fmt: skip
    return Trainer(cfg, overwrite=True)


@pytest.fixture
def closing():
    """Closes the trainers a test built (their engines and run directories)."""
    built = []
    yield built.append
    for trainer in built:
        trainer.source.close()
        trainer.session.close()


def test_generation_noises_each_completions_prompt_and_each_token(tmp_path, tiny_model_dir, closing):
    """TRL's transformers generation in train mode: every row's prompt prefilled (and noised) apart, at
    the prompts' padded width, then each new token (L = 1); the CPU levers' lean decode loop, which
    prefills a group's prompt once, gives way to generate()."""
    trainer = make_trainer(tmp_path, tiny_model_dir, ALPHA)
    closing(trainer)
    policy = Forwards(neftune.embeddings(trainer.unwrapped.lm))
    batch = trainer.source.rollout(1).batch
    seen = policy.take()
    assert seen[0] == ((4, batch.prompt_ids.shape[1], 64), True)  # two prompts × num_generations
    assert {shape[:2] for shape, _ in seen[1:]} == {(4, 1)} and all(noised for _, noised in seen)


def test_generate_gives_up_its_once_a_group_prefill(tiny_model_dir):
    """generate() with a KV cache prefills a group's prompt once (engines/hf.py, `prefill`): not under
    NEFTune, whose draw is each completion's own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from leangrpo.engines.hf import generate
    from leangrpo.engines.types import Sampling

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    neftune.activate(model, ALPHA)
    policy = Forwards(neftune.embeddings(model))
    sampling = Sampling(num_generations=2, max_prompt_length=None, max_completion_length=3, seed=0)
    batch = generate(model, tokenizer, ["Say hi", "Say hello there"], sampling)
    seen = policy.take()
    assert seen[0] == ((4, batch.prompt_ids.shape[1], 64), True) and all(noised for _, noised in seen)


def test_tool_turns_are_re_encoded_not_resumed_from_the_cache(tiny_model_dir, monkeypatch):
    """TRL prefills each tool-calling turn anew (prompt, completion so far and tool results), noising it
    all again; a KV cache kept from the turns before would hold their old draws: not kept."""
    from transformers import AutoModelForCausalLM

    import leangrpo.engines.hf as hf
    from leangrpo.data.tasks.calculator import calculator
    from leangrpo.engines.tools import Toolbox, prepare_tokenizer
    from leangrpo.engines.types import Sampling
    from leangrpo.models.load import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    prepare_tokenizer(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    turns = []

    class Spy(hf.ResumedTurns):
        def __init__(self, *args):
            super().__init__(*args)
            turns.append(self)

    monkeypatch.setattr(hf, "ResumedTurns", Spy)
    sampling = Sampling(num_generations=1, max_prompt_length=None, max_completion_length=3, seed=0)
    for alpha in (None, ALPHA):
        if alpha is not None:
            neftune.activate(model, alpha)
        hf.generate(model, tokenizer, ["Add 2 and 3"], sampling, toolboxes=[Toolbox([calculator])])
    assert [t.reuse for t in turns] == [True, False]


@pytest.mark.parametrize("lora", [False, True])
def test_the_passes_trl_runs_in_train_mode_are_noised_and_evaluation_is_not(
    tmp_path, tiny_model_dir, closing, lora
):
    """TRL: the old-policy pass, the LoRA reference (adapter off, same embeddings) and the update, each as
    wide as the generation batch's longest prompt and completion; not evaluation (eval mode), not the
    frozen reference copy (another module)."""
    trainer = make_trainer(tmp_path, tiny_model_dir, ALPHA, lora=lora)
    closing(trainer)
    policy = Forwards(neftune.embeddings(trainer.unwrapped.lm))
    rollout = trainer.source.rollout(1)
    policy.take()
    batch = rollout.batch
    width = int(batch.prompt_mask.sum(1).max()) + int(batch.completion_mask.sum(1).max())  # TRL's L
    reference = None if lora else Forwards(neftune.embeddings(trainer.ref_policy.lm))
    ref = trainer.updater.reference(batch)
    assert ref.old_logp is not None  # the policy moves within the generation: the old-policy pass ran
    seen = policy.take()
    assert len(seen) == (4 if lora else 2)  # two micro-batches: old policy (and LoRA reference)
    assert all(shape[1] == width and noised for shape, noised in seen), (seen, width)
    if reference is not None:
        seen = reference.take()
        assert len(seen) == 2 and not any(noised for _, noised in seen)
    scores = trainer.scorer.score(1, rollout, lambda: False)
    advantages, _ = trainer.scorer.advantages(scores)
    trainer.updater.update(batch, advantages, ref)
    seen = policy.take()
    assert len(seen) == 2 and all(shape[1] == width and noised for shape, noised in seen)
    trainer.maybe_evaluate(0)
    seen = policy.take()
    assert seen and not any(noised for _, noised in seen)
    assert neftune.noised(trainer.unwrapped.lm)  # evaluation leaves it on for the steps after


def test_async_rollouts_copy_of_the_policy_noises_too(tiny_model_dir):
    """Async rollouts generate on a copy of the policy (SnapshotEngine), made after NEFTune is on: its
    generation is noised as the policy's (TRL has no async GRPOTrainer; this is its generation's rule)."""
    from transformers import AutoModelForCausalLM

    from leangrpo.engines.hf import SnapshotEngine
    from leangrpo.engines.types import Sampling
    from leangrpo.models.load import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    neftune.activate(model, ALPHA)
    engine = SnapshotEngine(model, load_tokenizer(str(tiny_model_dir)))
    assert engine.model is not model
    copy = Forwards(neftune.embeddings(engine.model))
    engine.generate(["Say hi"], Sampling(num_generations=2, max_prompt_length=None, max_completion_length=3))
    seen = copy.take()
    assert seen[0][0][0] == 2 and all(noised for _, noised in seen)


def test_without_alpha_nothing_is_noised_and_the_layouts_stay(tmp_path, tiny_model_dir, closing):
    trainer = make_trainer(tmp_path, tiny_model_dir, None)
    closing(trainer)
    policy = Forwards(neftune.embeddings(trainer.unwrapped.lm))
    trainer.source.rollout(1)
    seen = policy.take()
    assert seen and not any(noised for _, noised in seen)
    assert trainer.group == 2 and trainer.updater.packed


def test_alpha_turns_the_shared_prompt_layouts_off_and_says_so(tmp_path, tiny_model_dir, closing, capsys):
    closing(trainer := make_trainer(tmp_path, tiny_model_dir, ALPHA))
    assert trainer.group == 1 and not trainer.updater.packed
    out = capsys.readouterr()
    assert "grpo.share_prompt: off, neftune_noise_alpha noises each completion's own prompt copy" in out.out


def test_python_api_trains_with_neftune_and_ends_it(tmp_path, tiny_model_dir):
    from leangrpo import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=4, report_to="none", neftune_noise_alpha=ALPHA,
    )  # fmt: skip
    on: list[bool] = []

    def noting(completions, **kwargs):
        """A reward that notes whether the policy's forwards are being noised meanwhile."""
        on.append(neftune.noised(model))
        return [0.0] * len(completions)

    trainer = GRPOTrainer(str(tiny_model_dir), noting, args, [{"prompt": "Hi"}, {"prompt": "Yo"}])
    model = trainer.model  # loaded now, then trained in place
    output = trainer.train()
    assert output.global_step == 2 and math.isfinite(trainer.state.log_history[0]["loss"])
    assert trainer.model is model and on == [True, True]
    forwards = Forwards(neftune.embeddings(model))
    model(input_ids=torch.tensor([[1, 2, 3]]))
    assert forwards.take() == [((1, 3, 64), False)]  # off after training, as transformers' Trainer


def test_flat_trl_yaml_trains_with_neftune(tmp_path, tiny_model_dir):
    from test_e2e import run_cli

    data = tmp_path / "train.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}]} for i in range(4)]  # think_format's shape
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    doc = {
        "model_name_or_path": str(tiny_model_dir), "dataset_name": str(data),
        "reward_funcs": ["think_format_reward"], "neftune_noise_alpha": ALPHA, "num_generations": 2,
        "max_completion_length": 4, "per_device_train_batch_size": 2, "max_steps": 2,
        "output_dir": str(tmp_path / "run"), "report_to": "none", "logging_steps": 1,
    }  # fmt: skip
    path = tmp_path / "trl.yaml"
    path.write_text(yaml.safe_dump(doc))
    proc = run_cli("train", "-c", str(path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "neftune_noise_alpha noises each completion's own prompt copy" in proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
