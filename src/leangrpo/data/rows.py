"""One training row's prompt: its shape (chat messages or text), how a logged sample shows it, and the text
generation starts from. Tasks and data sources both use it, so it imports neither."""

from __future__ import annotations

from typing import Any

Message = dict[str, str]  # one chat message: {"role": ..., "content": ...}


class BadRow(Exception):
    """One row is unusable; ``load_rows`` either skips it or turns it into a ``DataError``."""


def has_chat_template(tokenizer: Any) -> bool:
    """True when the tokenizer defines a chat template (instruct models); base models do not."""
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_text(prompt: str | list[Message]) -> str:
    """What a logged sample shows of a prompt: the text, or the last user message's content."""
    if isinstance(prompt, str):
        return prompt
    user = [m for m in prompt if m["role"] == "user"] or prompt
    return str(user[-1]["content"])


def render_prompt(
    tokenizer: Any,
    messages: str | list[Message],
    assistant_prefix: str = "",
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """Prompt text for generation, ending where the assistant's answer begins.

    A text prompt (TRL's standard format) is used verbatim, followed by ``assistant_prefix``.
    With a chat template: the template with the generation prompt. Without one (base models):
    ``"{system}\\n\\n"`` (if any), then ``"Question: {user}\\nAnswer:"`` per user turn, with
    earlier assistant turns as ``" {answer}\\n\\n"``, so few-shot messages read naturally.
    ``assistant_prefix`` (e.g. ``"<reasoning>\\n"``) prefills the assistant turn; in the
    plain-text form it is separated from ``"Answer:"`` by one space.
    """
    if isinstance(messages, str):
        return messages + assistant_prefix
    if has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **(chat_template_kwargs or {})
        )
        return text + assistant_prefix
    text = "".join(_plain_turn(m) for m in messages)
    return f"{text} {assistant_prefix}" if assistant_prefix else text


def _plain_turn(message: Message) -> str:
    """One message in the plain-text prompt format of ``render_prompt``."""
    role, content = message["role"], message["content"]
    if role == "system":
        return f"{content}\n\n"
    if role == "user":
        return f"Question: {content}\nAnswer:"
    return f" {content}\n\n"
