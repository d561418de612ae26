"""`leangrpo chat`: ask a trained model questions by hand, prompted exactly as in training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .checkpoint import STATE_FILE
from .config import DEFAULT_SYSTEM_PROMPT, ModelConfig
from .data import render_prompt
from .export import EXPORT_INFO, load_trained, locate
from .rundir import is_run_dir


def _training_config(source: str) -> tuple[Any, Any, dict[str, Any] | None]:
    """Model, tokenizer and (when known) the training config of a run, checkpoint or model."""
    path = Path(source)
    if is_run_dir(path) or (path / STATE_FILE).is_file():
        trained = locate(path)
        return *load_trained(trained), trained.config
    from .models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(
        ModelConfig(name_or_path=source, gradient_checkpointing=False)
    )
    info = path / EXPORT_INFO
    config = json.loads(info.read_text())["config"] if info.is_file() else None
    return model.eval(), tokenizer, config


class Chat:
    """A model with the system prompt and assistant prefix it was trained with (the defaults otherwise)."""

    def __init__(
        self, source: str, system_prompt: str | None, max_new_tokens: int = 256, temperature: float = 0.0
    ):
        self.model, self.tokenizer, config = _training_config(source)
        data = (config or {}).get("data", {})
        trained_prompt = data.get("system_prompt", DEFAULT_SYSTEM_PROMPT) if config else DEFAULT_SYSTEM_PROMPT
        self.system_prompt = system_prompt if system_prompt is not None else trained_prompt
        self.assistant_prefix = data.get("assistant_prefix", "")
        self.max_new_tokens, self.temperature = max_new_tokens, temperature

    def prompt(self, question: str) -> str:
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": question})
        return render_prompt(self.tokenizer, messages, self.assistant_prefix)

    def ask(self, question: str) -> str:
        """The model's answer (with the assistant prefix it was prefilled with)."""
        from .rollout import generate

        batch = generate(
            self.model,
            self.tokenizer,
            [self.prompt(question)],
            num_generations=1,
            max_prompt_length=getattr(self.model.config, "max_position_embeddings", 4096),
            max_completion_length=self.max_new_tokens,
            temperature=self.temperature or 1.0,
            do_sample=self.temperature > 0,
            assistant_prefix=self.assistant_prefix,
        )
        return batch.completion_texts[0]
