"""Evaluation: scoring through the reward code, batched greedy/pass@k generation, `leangrpo eval` and its
one-line errors, `leangrpo compare`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from leangrpo.cli import main
from leangrpo.commands.compare import compare
from leangrpo.config.schema import TaskConfig
from leangrpo.data.rewards import load_reward
from leangrpo.data.tasks import load_task
from leangrpo.train.evaluation import EvalResult, evaluate, score, summarize

RUN_CONFIG = (
    "model: {name_or_path: m}\ndata: {path: d}\nrewards: {functions: [{name: int}]}\ngrpo: {beta: 0.04}\n"
)
REWARDS = [(n, load_reward(n), 1.0) for n in ("strict_format", "soft_format", "correctness", "math_verify")]
GSM8K = load_task(TaskConfig())


def row(question: str, answer: str) -> dict:
    return {"prompt": [{"role": "user", "content": question}], "question": question, "answer": answer}


def xml(answer: str) -> str:
    return f"<reasoning>\nadd them\n</reasoning>\n<answer>\n{answer}\n</answer>\n"


def test_score_uses_math_verify_for_gsm8k_answers():
    rows = [row("a", "1000"), row("b", "18"), row("c", "7"), row("d", "5"), row("e", "3")]
    completions = [xml("1,000"), "<answer>$18</answer>", xml("8"), "so the total is 5", "<answer>3"]
    records = score(rows, completions, REWARDS, GSM8K, conversational=False)
    assert [r["correct"] for r in records] == [True, True, False, True, False]  # an unclosed tag: no answer
    # lenient: whatever the format, so the unclosed tag's last number counts
    assert [r["correct_lenient"] for r in records] == [True, True, False, True, True]
    assert [r["extracted"] for r in records] == ["1,000", "$18", "8", "", ""]
    assert records[0]["rewards"] == {
        "strict_format": 0.5,
        "soft_format": 0.5,
        "correctness": 0.0,
        "math_verify": 2.0,
    }

    metrics = summarize(records, REWARDS, num_samples=0)
    assert metrics["n"] == 5 and metrics["accuracy"] == pytest.approx(3 / 5)
    assert metrics["accuracy/lenient"] == pytest.approx(4 / 5)
    assert metrics["format/strict_format"] == pytest.approx(2 / 5)  # rows a and c (REWARDS' names)
    assert metrics["format/soft_format"] == pytest.approx(2 / 5)
    assert "format/math_verify" not in metrics
    assert metrics["rewards/math_verify/mean"] == pytest.approx(3 * 2.0 / 5)
    assert metrics["reward"] == pytest.approx((3.0 + 2.0 + 1.0 + 2.0 + 0.0) / 5)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from leangrpo.run.trained import load_trained

    model, tokenizer, _ = load_trained(str(tiny_model_dir))
    return model, tokenizer


@pytest.fixture(scope="module")
def test_rows(gsm8k_dir):
    from leangrpo.config.schema import DataConfig
    from leangrpo.train.evaluation import load_eval_rows

    return load_eval_rows(DataConfig(path="unused"), GSM8K, str(gsm8k_dir), "test", 4)


def test_evaluate_batched_greedy_and_pass_at_k(tiny, test_rows):
    import torch

    model, tok = tiny
    rng = torch.get_rng_state()
    from leangrpo.engines.types import Sampling

    kwargs = dict(progress=False)
    sampling = Sampling(num_generations=1, max_prompt_length=256, max_completion_length=6)
    res = evaluate(
        model, tok, test_rows, REWARDS, GSM8K, sampling, batch_size=2, num_samples=3, seed=1, **kwargs
    )
    assert torch.equal(torch.get_rng_state(), rng)  # sampling ran on its own RNG stream
    assert tok.padding_side == "left"
    assert [r["question"] for r in res.records] == [r["question"] for r in test_rows]
    assert res.metrics["n"] == 4
    assert {
        "accuracy",
        "pass@3",
        "pass@1/sampled",
        "completions/mean_length",
        "format/strict_format",
    } <= set(res.metrics)
    assert all(0 <= r["samples_correct"] <= 3 and 1 <= r["length"] <= 6 for r in res.records)

    # Left padding: a prompt's greedy completion does not depend on what it is batched with.
    alone = evaluate(model, tok, test_rows, REWARDS, GSM8K, sampling, batch_size=1, **kwargs)
    assert [r["completion"] for r in alone.records] == [r["completion"] for r in res.records]
    again = evaluate(
        model, tok, test_rows, REWARDS, GSM8K, sampling, batch_size=2, num_samples=3, seed=1, **kwargs
    )
    assert [r["samples_correct"] for r in again.records] == [r["samples_correct"] for r in res.records]


def test_eval_cli_writes_metrics_and_records(tmp_path, tiny_model_dir, gsm8k_dir):
    out = tmp_path / "e" / "base.json"
    result = CliRunner().invoke(main, [
        "eval", "--model", str(tiny_model_dir), "--data", str(gsm8k_dir), "--split", "test", "--limit", "3",
        "--max-new-tokens", "5", "--pass-k", "2", "--out", str(out),
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert (
        doc["split"] == "test" and doc["data"].endswith("test.jsonl") and doc["records_file"] == "base.jsonl"
    )
    assert (
        doc["metrics"]["n"] == 3
        and "pass@2" in doc["metrics"]
        and "format/strict_format_reward" in doc["metrics"]
    )
    records = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    assert len(records) == 3
    assert {"question", "completion", "extracted", "gold", "correct", "rewards"} <= records[0].keys()
    assert "accuracy" in result.output and str(out) in result.output


def one_line_error(result, needle: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    # transformers' own "Loading weights" progress bar may come first; the error is one line.
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0] and result.output.endswith(errors[0] + "\n"), (
        result.output
    )


def test_eval_bad_input_is_one_line(tmp_path, tiny_model_dir, gsm8k_dir, real_tokenizer_dir):
    runner = CliRunner()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(RUN_CONFIG)
    (run / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n')
    one_line_error(
        runner.invoke(main, ["eval", "--model", str(run), "--data", str(gsm8k_dir)]),
        "has neither a final model nor a complete checkpoint",
    )

    empty = tmp_path / "data"
    empty.mkdir()
    (empty / "test.jsonl").write_text("")
    args = ["eval", "--model", str(tiny_model_dir), "--data"]
    one_line_error(runner.invoke(main, [*args, str(empty)]), "no usable rows")
    one_line_error(runner.invoke(main, [*args, str(empty), "--split", "dev"]), "has no 'dev' split")

    # An adapter trained on a model of another shape.
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    other = LlamaForCausalLM(
        LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1)
    )  # fmt: skip
    get_peft_model(other, LoraConfig(r=2, target_modules="all-linear")).save_pretrained(tmp_path / "adapter")
    result = runner.invoke(
        main, [*args, str(gsm8k_dir), "--adapter", str(tmp_path / "adapter"), "--limit", "1"]
    )
    one_line_error(result, "does not fit model")
    result = runner.invoke(main, [*args, str(gsm8k_dir), "--adapter", str(empty)])
    one_line_error(result, "not a peft adapter")


def write_eval(path: Path, correct: list[bool], accuracy: float) -> Path:
    records = [
        {"question": f"q{i}", "gold": str(i), "completion": f"answer {i if c else -1}",
         "extracted": str(i if c else -1), "correct": c, "rewards": {}}
        for i, c in enumerate(correct)
    ]  # fmt: skip
    return EvalResult({"n": len(correct), "accuracy": accuracy}, records).save(path, model="m")


def test_compare_eval_files_and_run_dir_with_torn_metrics(tmp_path):
    a = write_eval(tmp_path / "a.json", [False, True, False], 1 / 3)
    b = write_eval(tmp_path / "b.json", [True, False, True], 2 / 3)
    text = compare(str(a), str(b))
    assert "+0.3333" in text
    assert "wrong → right: 2 question(s)" in text and "right → wrong: 1 question(s)" in text
    assert "answer 0" in text and "answer -1" in text  # both completions of a flipped question

    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "config.yaml").write_text(RUN_CONFIG)
    write_eval(run / "eval" / "step-3.json", [True, True, True], 1.0)
    (run / "metrics.jsonl").write_text(
        '{"step": 1, "reward": 0.25}\n{"step": 2, "reward": 0.75}\n{"step": 3, "rew'
    )
    result = CliRunner().invoke(main, ["compare", str(a), str(run)])
    assert result.exit_code == 0, result.output
    assert "skipped the truncated last line 3" in result.output
    assert "train/reward (last step)" in result.output and "0.75" in result.output
    assert "wrong → right: 2 question(s)" in result.output

    (run / "metrics.jsonl").write_text('{"step": 1, "rew\n{"step": 2, "reward": 0.75}\n')
    one_line_error(
        CliRunner().invoke(main, ["compare", str(a), str(run)]), "metrics.jsonl:1 is not valid JSON"
    )
    one_line_error(CliRunner().invoke(main, ["compare", str(a), str(tmp_path / "nope")]), "neither")


@pytest.mark.parametrize("progress_bar", [True, False])
def test_in_training_evaluation_shows_a_progress_bar_when_logging_asks(
    tmp_path, tiny_model_dir, capsys, progress_bar
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from leangrpo.data.rewards.registry import load_rewards
    from leangrpo.run.resolve import validate_config
    from leangrpo.train.evaluation import TrainingEvaluator

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row(f"What is {n} + 1?", f"#### {n + 1}")) + "\n" for n in range(3)))
    cfg = validate_config({
        "task": "gsm8k", "model": {"name_or_path": str(tiny_model_dir)}, "data": {"path": str(data)},
        "eval": {"enabled": True, "path": str(data), "split": "train", "max_new_tokens": 2},
        "logging": {"progress_bar": progress_bar}, "output_dir": str(tmp_path / "run"),
    })  # fmt: skip
    task = load_task(cfg.task)
    evaluator = TrainingEvaluator(cfg, tmp_path / "run", load_rewards(cfg.rewards.functions, task), task)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    evaluator(model, AutoTokenizer.from_pretrained(tiny_model_dir), step=0)
    err = capsys.readouterr().err
    # the bar clears itself once done (leave=False), so what shows depends on the refresh timing: its label
    assert ("eval:" in err and "/3" in err) == progress_bar, err


def test_eval_builds_vllm_in_the_evaluated_models_dtype(monkeypatch):
    """`leangrpo eval --engine vllm` without a dtype from the run or --dtype: vLLM in the evaluated
    model's dtype (bf16 weights: a bf16 engine), not an fp32 build; a run's share or TRL's 0.3 (issue 53,
    item 12)."""
    from types import SimpleNamespace

    import torch

    from leangrpo.commands import evaluate as evaluate_mod

    built: dict = {}

    class Engine:
        def __init__(self, path, tokenizer, eos, **kwargs):
            built.update(kwargs)

        def sync_weights(self, lm):
            pass

    monkeypatch.setattr(evaluate_mod, "VLLMEngine", Engine)
    monkeypatch.setattr(evaluate_mod, "eos_token_ids", lambda tokenizer, lm: [0])
    lm = SimpleNamespace(name_or_path="m", dtype=torch.bfloat16)
    evaluate_mod._vllm_engine(lm, None, None, None, None, 0, False)  # type: ignore[arg-type]
    assert built["dtype"] == "bfloat16" and built["gpu_memory_utilization"] == 0.3
    evaluate_mod._vllm_engine(lm, None, None, None, "float32", 0, False)  # type: ignore[arg-type]
    assert built["dtype"] == "float32"
