"""One training row's prompt: its shape (chat messages or text), how a logged sample shows it, and the text
generation starts from. Tasks and data sources both use it, so it imports neither."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

from leangrpo.core.errors import UserError

if TYPE_CHECKING:
    from leangrpo.config.schema import DataConfig

# one chat message: {"role": ..., "content": ...}, the content text or (image prompts) TRL's content parts,
# [{"type": "image", "image": <PIL image>}, {"type": "text", "text": ...}]
Message = dict[str, Any]
# What rendering one chat template may take: a model's template comes with the model, so a loop in it
# (nested range(100000)) must end in one line, not hang chat, eval or a run. A real prompt takes milliseconds.
TEMPLATE_SECONDS = 10.0
TEMPLATE_CHARS = 16 * 2**20


class ChatTemplateError(UserError, ValueError):
    """The model's chat template failed (jinja's sandbox refused it, it raised) or ran past its budget."""


class BadRow(Exception):
    """One row is unusable; ``load_rows`` either skips it or turns it into a ``DataError``."""


class PromptTooLong(UserError, ValueError):
    """A prompt cannot fit grpo.max_prompt_length without losing its question."""


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))


def has_chat_template(tokenizer: Any) -> bool:
    """True when the tokenizer defines a chat template (instruct models); base models do not."""
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_text(prompt: str | list[Message]) -> str:
    """What a logged sample shows of a prompt: the text, or the last user message's content (its text
    parts, for content parts)."""
    if isinstance(prompt, str):
        return prompt
    user = [m for m in prompt if m["role"] == "user"] or prompt
    content = user[-1]["content"]
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def column_images(record: Mapping[str, Any]) -> list[Any]:
    """A row's images from TRL's `images` (a list) or `image` (one) column, as PIL images (a path is
    opened); none for a row without them."""
    images = record.get("images") if "images" in record else record.get("image")
    if images is None:
        return []
    return [_pil(image) for image in (images if isinstance(images, list) else [images])]


def _pil(image: Any) -> Any:
    """An image as PIL: a PIL image as it is, a path opened, `datasets`' undecoded {"bytes", "path"} read."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image
    try:
        if isinstance(image, dict) and image.get("bytes") is not None:
            import io

            return Image.open(io.BytesIO(image["bytes"])).convert("RGB")
        path = image.get("path") if isinstance(image, dict) else image
        if isinstance(path, str):
            return Image.open(path).convert("RGB")
    except OSError as e:
        raise BadRow(f"cannot read an image: {e}") from None
    raise BadRow(f"an image is a {type(image).__name__}, not a PIL image, a path or {{'bytes': ...}}")


def with_images(messages: list[Message], images: list[Any]) -> list[Message]:
    """The messages in TRL's multimodal shape (`prepare_multimodal_messages`): every content a list of parts.
    Image parts without their image (placeholders) take `images` in order; without placeholders, the images
    open the first user message of text. Messages without images stay (or become) text messages."""
    parts = any(isinstance(m["content"], list) for m in messages)
    if not images and not parts:
        return messages
    queue = list(images)
    placeholders = sum(
        1
        for m in messages
        if isinstance(m["content"], list)
        for p in m["content"]
        if isinstance(p, dict) and p.get("type") == "image" and p.get("image") is None
    )
    if placeholders and placeholders != len(queue):
        raise BadRow(f"{placeholders} image placeholders in the messages for {len(queue)} images")
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            first = message["role"] == "user" and not placeholders and bool(queue)
            heads = [{"type": "image", "image": queue.pop(0)} for _ in range(len(queue))] if first else []
            content = [*heads, {"type": "text", "text": content}]
        elif isinstance(content, list):
            content = [_part(p, queue) for p in content]
        else:
            raise BadRow(f"a {message['role']} message's content is a {type(content).__name__}")
        out.append({**message, "content": content})
    if queue:
        raise BadRow("the row's images have no user message of text to go in")
    if not prompt_images(out):  # text parts only: plain messages, which any chat template renders
        return [{**m, "content": "".join(p["text"] for p in m["content"])} for m in out]
    return out


def _part(part: Any, queue: list[Any]) -> dict[str, Any]:
    """One content part: text, or an image (its image as PIL; a placeholder takes the next of `queue`)."""
    if not isinstance(part, dict) or part.get("type") not in ("text", "image"):
        raise BadRow(f"a content part must be {{'type': 'text' | 'image', ...}}, got {part!r:.60}")
    if part["type"] == "image":
        image = part.get("image")
        return {"type": "image", "image": _pil(queue.pop(0) if image is None else image)}
    return part


def prompt_images(prompt: str | list[Message]) -> list[Any]:
    """The images of a prompt's content parts, in order (none for a text prompt)."""
    if isinstance(prompt, str):
        return []
    return [
        p["image"]
        for m in prompt
        if isinstance(m["content"], list)
        for p in m["content"]
        if p.get("type") == "image"
    ]


def render_chat(tokenizer: Any, messages: list[Any], **kwargs: Any) -> Any:
    """`tokenizer.apply_chat_template(messages, **kwargs)` within `TEMPLATE_SECONDS` and `TEMPLATE_CHARS`
    (jinja's sandbox stays as transformers sets it up); a template that fails or runs past the budget is
    one ChatTemplateError line, never a traceback or a hang."""
    from jinja2 import TemplateError

    try:
        with _template_budget():
            return tokenizer.apply_chat_template(messages, **kwargs)
    except TemplateError as e:
        raise ChatTemplateError(f"the model's chat template failed: {type(e).__name__}: {e}") from None


@contextmanager
def _template_budget() -> Iterator[None]:
    """Trace the code jinja compiled the template into (only that: other frames run untraced), counting
    its lines against the clock and what it yields against the size budget. The hook raises only in the
    template's ordinary flow, never while a generator closes (Python would print "Exception ignored" with
    a traceback and drop the exception): Ctrl-C is held meanwhile (`_held_ctrl_c`)."""
    deadline, left, lines = time.monotonic() + TEMPLATE_SECONDS, [TEMPLATE_CHARS], [0]

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        lines[0] += 1
        # a line run while no exception is handled: not a generator's close (GeneratorExit) nor a finally
        if event == "line" and (held[0] or lines[0] % 1024 == 0) and sys.exc_info()[1] is None:
            if held[0]:
                held[0] = False
                raise KeyboardInterrupt
            if time.monotonic() > deadline:
                raise ChatTemplateError(
                    f"the model's chat template ran past {TEMPLATE_SECONDS:g} s rendering one prompt (a loop "
                    "too long for a prompt?); fix or replace the tokenizer's chat_template"
                )
        if event == "return" and isinstance(arg, str):  # a yield of the render or a macro's result
            left[0] -= len(arg)
            if left[0] < 0:
                raise ChatTemplateError(
                    f"the model's chat template rendered more than {TEMPLATE_CHARS // 2**20} MiB of text for "
                    "one prompt; fix or replace the tokenizer's chat_template"
                )
        return local

    def calls(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename == "<template>" else None

    with _held_ctrl_c() as held:
        previous = sys.gettrace()
        sys.settrace(calls)
        try:
            yield
        finally:
            sys.settrace(previous)


@contextmanager
def _held_ctrl_c() -> Iterator[list[bool]]:
    """While a template renders, Ctrl-C (SIGINT under Python's own handler, which raises KeyboardInterrupt
    wherever the interpreter is) only sets the flag yielded; the budget's hook raises KeyboardInterrupt at
    the template's next ordinary line, or the end of rendering does. Other handlers (a run's StopSignals)
    never raise, and other threads never see the signal: those stay as they are."""
    held = [False]
    python_own = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if not python_own or threading.current_thread() is not threading.main_thread():
        yield held
        return

    def hold(signum: int, frame: FrameType | None) -> None:
        held[0] = True

    signal.signal(signal.SIGINT, hold)
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if held[0]:  # Ctrl-C came while rendering: it wins over whatever the render raised
            raise KeyboardInterrupt


@dataclass(frozen=True)
class PromptFormat:
    """How a row's prompt becomes the text generation continues: the chat template (or the plain-text form
    of a base model), `data.chat_template_kwargs`, the rollout's tool schemas and `data.assistant_prefix`.
    The row's system prompt is already in its messages (`load_rows`). Every path that renders a prompt
    (rollouts, evaluation, the cold start, the long-prompt check, rollout_func, chat) calls `render`, so
    none can leave an option out."""

    assistant_prefix: str = ""
    chat_template_kwargs: Mapping[str, Any] | None = None
    max_tokens: int | None = None  # grpo.max_prompt_length: longer prompts are cut (`fit`)

    @classmethod
    def from_config(cls, data: DataConfig, max_prompt_length: int | None = None) -> PromptFormat:
        return cls(data.assistant_prefix, data.chat_template_kwargs, max_prompt_length)

    def render(self, tokenizer: Any, prompt: str | list[Message], tools: list[Any] | None = None) -> str:
        """Prompt text for generation, ending where the assistant's answer begins.

        A text prompt (TRL's standard format) is used verbatim, followed by the assistant prefix. With a
        chat template: the template with the generation prompt, given the chat template kwargs and, with
        `tools`, the tool schemas. Without one (base models): ``"{system}\\n\\n"`` (if any), then
        ``"Question: {user}\\nAnswer:"`` per user turn, with earlier assistant turns as
        ``" {answer}\\n\\n"``, so few-shot messages read naturally. The assistant prefix (e.g.
        ``"<reasoning>\\n"``) prefills the assistant turn; in the plain-text form it is separated from
        ``"Answer:"`` by one space. Past `max_tokens`, the text is cut by `fit`."""
        text = self._render(tokenizer, prompt, tools, opened=True)
        return text if self.max_tokens is None else self.fit(tokenizer, prompt, tools, text)

    def _render(
        self, tokenizer: Any, prompt: str | list[Message], tools: list[Any] | None, opened: bool
    ) -> str:
        """`render`'s text, uncut; `opened` False: the messages alone, without the generation prompt."""
        prefix = self.assistant_prefix if opened else ""
        if isinstance(prompt, str):
            return prompt + prefix
        if has_chat_template(tokenizer):
            kwargs = {**(self.chat_template_kwargs or {}), **({} if tools is None else {"tools": tools})}
            text = render_chat(tokenizer, prompt, tokenize=False, add_generation_prompt=opened, **kwargs)
            return str(text) + prefix
        text = "".join(_plain_turn(m) for m in prompt)
        return f"{text} {prefix}" if prefix else text

    def fit(self, tokenizer: Any, prompt: str | list[Message], tools: list[Any] | None, text: str) -> str:
        """`text` (the prompt rendered) within `max_tokens` tokens. A longer one keeps its tail whole: the
        last user message and all after it (the generation header, the assistant prefix); what comes
        before (the system prompt, the tool schemas, earlier turns) loses its middle tokens, keeping its
        first and last ones, half the room left each. A tail longer than the limit alone raises
        `PromptTooLong`, as does any text prompt (TRL's standard format: all of it is the question)."""
        limit = self.max_tokens
        if limit is None or len(_ids(tokenizer, text)) <= limit:
            return text
        tail = self.tail(tokenizer, prompt, tools, text)
        head, tail_ids = _ids(tokenizer, text[: len(text) - len(tail)]), _ids(tokenizer, tail)
        for keep in range(limit - len(tail_ids), limit - len(tail_ids) - 8, -1):  # re-tokenizing may merge
            if keep < 0 or not head:
                break
            first, last = head[: keep - keep // 2], head[len(head) - keep // 2 :]
            cut = _decode(tokenizer, first) + _decode(tokenizer, last) + tail
            if len(_ids(tokenizer, cut)) <= limit:
                return cut
        raise PromptTooLong(
            f"a prompt's last user message and what follows it take {len(tail_ids)} tokens, over "
            f"grpo.max_prompt_length={limit}: raise it (or remove it, for no limit) or shorten the question"
        )

    def tail(self, tokenizer: Any, prompt: str | list[Message], tools: list[Any] | None, text: str) -> str:
        """The end of `text` (`prompt` rendered) that a cut keeps: from the last user message on."""
        if isinstance(prompt, str):
            return text
        last = max((i for i, m in enumerate(prompt) if m["role"] == "user"), default=None)
        if last is None:
            return text
        if last:
            before = self._render(tokenizer, prompt[:last], tools, opened=False)
            if text.startswith(before):
                return text[len(before) :]
        at = text.rfind(str(prompt[last]["content"]))  # a template that renders a turn differently alone
        return text[at:] if at >= 0 else text

    def generation_header(self, tokenizer: Any) -> str | None:
        """The text the chat template puts before an assistant's turn (ChatML: "<|im_start|>assistant\n";
        with Qwen3's enable_thinking false, its empty think block too); None without a chat template."""
        if not has_chat_template(tokenizer):
            return None
        chat, kwargs = [{"role": "user", "content": "x"}], dict(self.chat_template_kwargs or {})
        bare = str(render_chat(tokenizer, chat, tokenize=False, **kwargs))
        opened = str(render_chat(tokenizer, chat, tokenize=False, add_generation_prompt=True, **kwargs))
        return opened.removeprefix(bare) or None


def _plain_turn(message: Message) -> str:
    """One message in the plain-text prompt format of ``PromptFormat.render``."""
    role, content = message["role"], message["content"]
    if role == "system":
        return f"{content}\n\n"
    if role == "user":
        return f"Question: {content}\nAnswer:"
    return f" {content}\n\n"
