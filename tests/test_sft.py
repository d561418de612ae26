"""The supervised cold start: targets in the reward format, the batch layout, and that it learns."""

from __future__ import annotations

import pytest
import torch

from leangrpo.data.rewards import correctness_reward, strict_format_reward, xmlcount_reward
from leangrpo.data.rows import PromptFormat
from leangrpo.data.tasks.gsm8k import tagged_solution
from leangrpo.models.load import load_tokenizer
from leangrpo.train.sft import nll_loss, sft_batch

SOLUTION = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 in all.\n#### 72"
ROW = {
    "prompt": [{"role": "user", "content": "How many clips?"}],
    "question": "How many clips?",
    "answer": "72",
    "solution": SOLUTION,
}


@pytest.fixture(scope="module")
def real_tokenizer(real_tokenizer_dir):
    return load_tokenizer(str(real_tokenizer_dir))


def test_tagged_solution_drops_calculator_notes_and_earns_every_reward():
    text = tagged_solution(SOLUTION, "72")
    assert "<<" not in text and "####" not in text
    assert text.startswith("<reasoning>\nNatalia sold 48/2 = 24 clips in May.\n")
    assert strict_format_reward(None, [text]) == [0.5]
    assert correctness_reward(None, [text], answer=["72"]) == [2.0]
    assert xmlcount_reward(None, [text]) == [0.5]


def test_sft_batch_trains_only_what_the_prefix_does_not_prefill(real_tokenizer):
    tok = real_tokenizer
    short = {**ROW, "solution": "1+1=2\n#### 2", "answer": "2"}
    rows = [ROW, short]
    batch = sft_batch(
        tok,
        [r["prompt"] for r in rows],
        [tagged_solution(r["solution"], r["answer"]) for r in rows],
        prompt_format=PromptFormat("<reasoning>\n"),
        max_prompt_length=64,
        max_completion_length=200,
    )
    assert tok.padding_side == "left"  # restored
    assert batch.prompt_mask[:, -1].all()  # prompts left-padded: every prompt ends at the last column
    lengths = batch.completion_mask.sum(dim=1).tolist()
    assert lengths[0] > lengths[1] and not batch.truncated.any()
    text = tok.decode(batch.completion_ids[1, : lengths[1]])
    assert text == "1+1=2\n</reasoning>\n<answer>\n2\n</answer>\n" + tok.eos_token
    assert tok.decode(batch.prompt_ids[1][batch.prompt_mask[1].bool()]).endswith("<reasoning>\n")


def test_sft_batch_flags_targets_longer_than_the_completion_budget(real_tokenizer):
    batch = sft_batch(
        real_tokenizer,
        [ROW["prompt"]],
        [tagged_solution(SOLUTION, "72")],
        prompt_format=PromptFormat(),
        max_prompt_length=64,
        max_completion_length=5,
    )
    assert batch.completion_ids.shape[1] == 5 and batch.truncated.tolist() == [True]


def test_nll_loss_is_the_mean_over_real_tokens():
    logp = torch.tensor([[-1.0, -3.0, -9.0], [-2.0, -9.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert nll_loss(logp, mask).item() == 2.0


def test_cold_start_raises_the_likelihood_of_tagged_solutions(tmp_path, tiny_model_dir, gsm8k_dir):
    from leangrpo.run.resolve import validate_config
    from leangrpo.train.policy import micro_batch_logprobs
    from leangrpo.train.trainer import Trainer

    cfg = validate_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "gradient_checkpointing": False},
            "task": {"name": "gsm8k", "max_solution_steps": 2},
            "data": {"path": str(gsm8k_dir / "train.jsonl"), "limit": 8},
            "rewards": {"functions": [{"name": "correctness"}]},
            "grpo": {"num_generations": 2, "max_completion_length": 64, "max_prompt_length": 128},
            "sft": {"steps": 6, "learning_rate": 3e-3, "batch_size": 4},
            "logging": {"progress_bar": False},
            "output_dir": str(tmp_path / "run"),
        }
    )
    trainer = Trainer(cfg)
    rows = trainer.rows
    batch = sft_batch(
        trainer.tokenizer,
        [r["prompt"] for r in rows],
        [trainer.task.solution(r) for r in rows],
        prompt_format=PromptFormat(),
        max_prompt_length=128,
        max_completion_length=64,
    )

    def nll() -> float:
        with torch.no_grad():
            return float(nll_loss(*micro_batch_logprobs(trainer.policy, batch, slice(None), 1.0)))

    before = nll()
    trainer.cold_start()
    assert nll() < before - 0.5


def test_the_cold_start_says_when_it_cuts_worked_solutions(tmp_path, tiny_model_dir, gsm8k_dir):
    """A worked solution longer than grpo.max_completion_length is cut there (its answer not trained
    on): said in one line with the count, not silently."""
    from leangrpo.run.resolve import validate_config
    from leangrpo.train.trainer import Trainer

    cfg = validate_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "gradient_checkpointing": False},
            "task": {"name": "gsm8k", "max_solution_steps": 2},
            "data": {"path": str(gsm8k_dir / "train.jsonl"), "limit": 8},
            "rewards": {"functions": [{"name": "correctness"}]},
            "grpo": {"num_generations": 2, "max_completion_length": 8, "max_prompt_length": 128},
            "sft": {"steps": 2, "batch_size": 4},
            "logging": {"progress_bar": False},
            "output_dir": str(tmp_path / "run"),
        }
    )
    trainer = Trainer(cfg)
    lines: list[str] = []
    trainer._write = lines.append
    trainer.cold_start()
    said = [line for line in lines if "worked solutions ran past" in line]
    assert said == [
        "sft: 8 of 8 worked solutions ran past grpo.max_completion_length=8 tokens and were cut there; "
        "raise it to train on their ends"
    ]


def test_a_tool_traces_results_are_out_of_the_cold_start_loss(
    real_tokenizer, monkeypatch, tmp_path, gsm8k_dir
):
    """A calculator trace: the model's call and answer are trained on; the tool's result and the next
    assistant header (what the tool loop appends, TRL's tool_mask 0) are not, in sft_batch and in the
    Trainer's cold start."""
    from leangrpo.data.tasks.calculator import tool_trace
    from leangrpo.engines.tools import prepare_tokenizer

    tok = real_tokenizer
    prepare_tokenizer(tok)
    trace = tool_trace("1234 + 5678", "6912")
    batch = sft_batch(
        tok, [ROW["prompt"], ROW["prompt"]], [trace, "no tools"], prompt_format=PromptFormat(),
        max_prompt_length=64,
        max_completion_length=200,
    )  # fmt: skip
    ids, mask = batch.completion_ids[0], batch.completion_mask[0].bool()
    model, tool = ids[mask & batch.loss_mask[0].bool()], ids[mask & ~batch.loss_mask[0].bool()]
    assert (
        tok.decode(tool)
        == "\n<|im_start|>user\n<tool_response>\n6912\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        tok.decode(model).startswith('<tool_call>\n{"name": "calculator"')
        and "6912" not in tok.decode(model)[:80]
    )
    assert tok.decode(model).endswith("<answer>\n6912\n</answer>\n<|im_end|>")
    assert tok.decode(ids[mask]) == trace + tok.eos_token  # the trace whole, nothing lost
    assert batch.loss_mask[1].tolist() == batch.completion_mask[1].tolist()  # no tools: every token trained


def test_the_trainers_cold_start_trains_on_the_models_turns_only(
    tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch
):
    """The cold start's loss gets the batch's loss_mask: with tools, a trace's tool results are out of it."""
    import leangrpo.train.sft as sft_mod
    from leangrpo.data.tasks.calculator import tool_trace
    from leangrpo.run.resolve import validate_config
    from leangrpo.train.trainer import Trainer

    cfg = validate_config({
        "model": {"name_or_path": str(tiny_model_dir), "gradient_checkpointing": False},
        "data": {"path": str(gsm8k_dir / "train.jsonl"), "limit": 2},
        "rewards": {"functions": [{"name": "correctness"}]},
        "tools": {"functions": ["leangrpo.data.tasks.calculator:calculator"]},
        "grpo": {"num_generations": 2, "max_completion_length": 128, "max_prompt_length": 512},
        "sft": {"steps": 1, "batch_size": 2},
        "logging": {"progress_bar": False},
        "output_dir": str(tmp_path / "run"),
    })  # fmt: skip
    trainer = Trainer(cfg)
    monkeypatch.setattr(trainer.sft_task, "solution", lambda row: tool_trace("1234 + 5678", "6912"))
    seen, real = [], sft_mod.nll_loss
    monkeypatch.setattr(sft_mod, "nll_loss", lambda logp, mask: seen.append(mask) or real(logp, mask))
    trainer.cold_start()
    tok = trainer.tokenizer
    _, written = sft_mod.target_ids(
        tok, tool_trace("1234 + 5678", "6912") + tok.eos_token, "<|im_start|>assistant\n"
    )
    (mask,) = seen
    assert 0 in written and mask.tolist() == [written, written]  # the tool result is out (0), the rest in
