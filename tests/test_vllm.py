"""vLLM rollouts, the parts that need no vLLM: its one-line refusal when missing. The real engine is tested
in tests/real_vllm/ (run in .venv-vllm by scripts/test.sh, see docs/vllm.md)."""

from __future__ import annotations

import sys

import pytest
from test_memory import make_cfg

from leangrpo.engines.vllm import INSTALL, VLLMError
from leangrpo.train.trainer import Trainer


def test_missing_vllm_stops_in_one_line_with_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails, whether installed or not
    cfg = make_cfg(grpo={"use_vllm": True}, output_dir=str(tmp_path / "run"))
    with pytest.raises(VLLMError) as info:
        Trainer(cfg)  # before the model (here a name that does not exist) would load
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("grpo.use_vllm needs vLLM") and INSTALL in msg


def test_hf_top_k_one_samples_the_greedy_completion(tiny_model_dir):
    """top_k (TRL's name, passed to both engines) reaches HF sampling: k = 1 leaves only the argmax."""
    import torch
    from transformers import AutoModelForCausalLM

    from leangrpo.engines.hf import generate
    from leangrpo.engines.types import Sampling
    from leangrpo.models.load import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tok = load_tokenizer(str(tiny_model_dir))
    kw = dict(num_generations=3, max_prompt_length=16, max_completion_length=6)
    greedy = generate(model, tok, ["a b c"], Sampling(do_sample=False, **kw))
    torch.manual_seed(0)
    top1 = generate(model, tok, ["a b c"], Sampling(temperature=2.0, top_k=1, **kw))
    torch.manual_seed(0)
    sampled = generate(model, tok, ["a b c"], Sampling(temperature=2.0, **kw))
    assert torch.equal(top1.completion_ids, greedy.completion_ids)
    assert not torch.equal(sampled.completion_ids, greedy.completion_ids)  # at T=2 sampling differs


def test_eval_with_the_vllm_engine_but_no_vllm_is_one_line(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch):
    from click.testing import CliRunner

    from leangrpo.cli import main

    monkeypatch.setitem(sys.modules, "vllm", None)
    args = ["eval", "--model", str(tiny_model_dir), "--data", str(gsm8k_dir), "--limit", "1"]
    result = CliRunner().invoke(main, [*args, "--engine", "vllm", "--out", str(tmp_path / "e.json")])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert INSTALL in result.output


def test_vllm_is_built_with_prefix_caching(monkeypatch):
    """A prefix every prompt shares (system prompt, tool schemas) is prefilled once by vLLM too: the engine
    asks for its prefix cache rather than counting on the default."""
    import types

    import leangrpo.engines.vllm as engine

    built = {}
    fake = types.SimpleNamespace(LLM=lambda **kwargs: built.update(kwargs))
    monkeypatch.setattr(engine, "import_vllm", lambda: fake)
    engine.build_llm("some/model", max_model_len=64)
    assert built["enable_prefix_caching"] is True
