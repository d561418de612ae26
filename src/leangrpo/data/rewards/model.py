"""A reward model as a reward function: a sequence classifier scores prompt + completion, as in TRL."""

from __future__ import annotations

from typing import Any, cast

from leangrpo.data.rewards.builtin import RewardError
from leangrpo.data.rows import render_chat


class RewardModel:
    """TRL's reward-model reward: the first logit of ``AutoModelForSequenceClassification`` (loaded with
    ``num_labels=1``) on each prompt + completion, right-padded, ``batch_size`` at a time under
    inference mode. Chats are rendered with the reward model's own chat template (TRL's rule); text
    prompts are concatenated with their completions."""

    def __init__(self, name_or_path: str, batch_size: int = 16, **from_pretrained: Any):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(name_or_path)
            model = AutoModelForSequenceClassification.from_pretrained(
                name_or_path, num_labels=1, **from_pretrained
            )
        except Exception as exc:  # OSError (not found, offline), ValueError (not a classifier), ...
            first = next(iter(str(exc).strip().splitlines()), "")
            raise RewardError(
                f"cannot load reward model {name_or_path!r}: {type(exc).__name__}: {first}"
            ) from exc
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model = model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
        self.batch_size = batch_size
        self.__name__ = name_or_path

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float]:
        import torch

        texts = [self._text(p, c) for p, c in zip(prompts, completions, strict=True)]
        scores: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(
                    texts[start : start + self.batch_size],
                    return_tensors="pt",
                    padding=True,
                    padding_side="right",
                    add_special_tokens=False,
                ).to(self.model.device)
                scores += self.model(**enc).logits[:, 0].float().tolist()
        return scores

    def _text(self, prompt: str | list[dict], completion: str | list[dict]) -> str:
        if isinstance(prompt, str):
            return prompt + str(completion)
        messages = [*prompt, *completion]
        if getattr(self.tokenizer, "chat_template", None):
            # tokenize=False returns the rendered string; transformers types every return form
            return cast(str, render_chat(self.tokenizer, messages, tokenize=False))
        return "\n".join(str(m["content"]) for m in messages)
