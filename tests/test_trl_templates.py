"""Chat templates in multi-turn rollouts as TRL has them (issue 49, item 4): a template that is not
prefix-preserving (Qwen3's stock one) gets TRL's training version, and `chat_template_kwargs` reach the
tool results rendered between turns, as they reach the prompt."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

trl = pytest.importorskip("trl")
TEMPLATES = Path(trl.__file__).parent / "chat_templates"


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


@pytest.fixture
def qwen3_tokenizer(real_tokenizer_dir):
    """SmolLM2's tokenizer (ChatML tokens) with Qwen3's stock chat template, as TRL ships a copy of it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_tokenizer_dir)
    tok.chat_template = (TEMPLATES / "qwen3.jinja").read_text()
    return tok


def test_qwen3s_template_gets_trls_training_template(qwen3_tokenizer, caplog):
    """Qwen3's template drops a turn's think block once a tool result follows: TRL swaps in its training
    template, and so does leangrpo, before any rollout (it raised ToolError mid-rollout before)."""
    from leangrpo.engines.tools import prefix_preserving, prepare_tokenizer, tool_suffix_ids

    assert not prefix_preserving(qwen3_tokenizer)
    with caplog.at_level(logging.WARNING, logger="leangrpo.engines.tools"):
        prepare_tokenizer(qwen3_tokenizer)
    assert qwen3_tokenizer.chat_template == (TEMPLATES / "qwen3_training.jinja").read_text()
    assert "rollouts use TRL's training one, which the run's checkpoints and final model keep" in caplog.text
    assert prefix_preserving(qwen3_tokenizer)
    suffix = tool_suffix_ids(qwen3_tokenizer, [{"role": "tool", "name": "add", "content": "5"}])
    assert qwen3_tokenizer.decode(suffix).endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_kwargs_reach_the_tool_results(qwen3_tokenizer, gsm8k_dir):
    """With `enable_thinking: false` the prompt ends in an empty think block; so must the assistant header
    after each tool result (the turn the model writes next), as TRL renders every part with the kwargs."""
    from leangrpo.config.schema import DataConfig, GRPOSection
    from leangrpo.engines.tools import Toolbox, prepare_tokenizer, tool_loop
    from leangrpo.engines.types import Sampling
    from leangrpo.train.evaluation import eval_sampling

    tok = qwen3_tokenizer
    prepare_tokenizer(tok)
    kwargs = {"enable_thinking": False}
    data = DataConfig(path=str(gsm8k_dir / "train.jsonl"), chat_template_kwargs=kwargs)
    assert Sampling.from_config(GRPOSection(), data).chat_template_kwargs == kwargs
    assert eval_sampling(GRPOSection(), data).chat_template_kwargs == kwargs
    assert eval_sampling(None, data).chat_template_kwargs == kwargs
    question = [{"role": "user", "content": "2+3?"}]
    prompt = tok.apply_chat_template(
        question, tools=[add], add_generation_prompt=True, tokenize=False, **kwargs
    )
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    turn = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
    prompt_ids = tok(prompt, add_special_tokens=False).input_ids
    turn_ids = tok(turn, add_special_tokens=False).input_ids
    seen = []

    def next_turns(sequences, max_new):
        seen.extend(sequences)
        return [tok("5<|im_end|>", add_special_tokens=False).input_ids for _ in sequences], None

    tool_loop(tok, [prompt_ids], [turn_ids], None, [Toolbox([add])], next_turns, 256, None, None, kwargs)
    (sequence,) = seen
    assert tok.decode(sequence).endswith(
        "<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
