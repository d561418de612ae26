"""`leangrpo chat`: ask a trained model questions by hand, prompted exactly as in training."""

from __future__ import annotations

import logging
from typing import Any

from leangrpo.config.schema import CPUConfig, TaskConfig
from leangrpo.data.rows import PromptFormat
from leangrpo.data.tasks import load_task
from leangrpo.engines.hf import generate
from leangrpo.engines.types import Sampling
from leangrpo.engines.vision import image_processor, text_tokenizer
from leangrpo.run.trained import load_trained
from leangrpo.train.levers import cpu_levers

log = logging.getLogger(__name__)


class Chat:
    """A model with the system prompt and assistant prefix it was trained with (its task's otherwise)."""

    def __init__(
        self,
        source: str,
        system_prompt: str | None,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        trust_remote_code: bool = False,
    ):
        self.model, processing, trained = load_trained(source, trust_remote_code=trust_remote_code)
        self.tokenizer = text_tokenizer(processing)
        if image_processor(processing) is not None:  # a question is a line of text: no way to give an image
            log.warning(
                "note: chat asks a vision-language model text only; image prompts: leangrpo eval --data"
            )
        data: dict[str, Any] = (
            trained.config["data"] if trained else {"system_prompt": load_task(TaskConfig()).system_prompt}
        )
        self.system_prompt = system_prompt if system_prompt is not None else data.get("system_prompt")
        # as the run rendered its prompts (chat_template_kwargs such as Qwen3's enable_thinking included)
        kwargs = data.get("chat_template_kwargs")
        self.prompt_format = PromptFormat(
            data.get("assistant_prefix", ""), kwargs if isinstance(kwargs, dict) else None
        )
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.levers = cpu_levers(self.model.device, CPUConfig())

    def prompt(self, question: str) -> str:
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": question})
        return self.prompt_format.render(self.tokenizer, messages)

    def ask(self, question: str) -> str:
        """The model's answer (with the assistant prefix it was prefilled with)."""
        sampling = Sampling(
            num_generations=1,
            max_prompt_length=getattr(self.model.config, "max_position_embeddings", 4096),
            max_completion_length=self.max_new_tokens,
            temperature=self.temperature or 1.0,
            do_sample=self.temperature > 0,
            assistant_prefix=self.prompt_format.assistant_prefix,
        )
        batch = generate(self.model, self.tokenizer, [self.prompt(question)], sampling, levers=self.levers)
        return batch.completion_texts[0]
