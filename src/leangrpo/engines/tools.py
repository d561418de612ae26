"""Tool calls inside a rollout, TRL 1.16's contract: the model's turns and the tools' results in one token
sequence, with a mask of the tokens the model wrote.

A `Toolbox` holds one rollout's tools (plain functions, or an environment's public methods); `tool_loop`
parses each turn's tool calls (transformers' `parse_response`), runs them, appends their results as tool
messages and resumes generation, as TRL's `_tool_call_loop` does. Nothing here runs code from the model's
output: a tool call only names one of the user's own functions and its arguments."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import re
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from leangrpo.core.errors import UserError
from leangrpo.data.rows import render_chat

logger = logging.getLogger("leangrpo.engines.tools")

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]


class ToolError(UserError, ValueError):
    """Tools that cannot be used as given (no schema, a chat template that cannot show them...)."""


# The ChatML tool format TRL gives ChatML models (its qwen2_5 template and qwen3 response template).
CHATML_TOOL_TEMPLATE = Path(__file__).with_name("chatml_tools.jinja").read_text(encoding="utf-8")
CHATML_RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
TOOL_CALL_OPENER = "<tool_call>"
MAX_CALL_DEPTH = 64
"""How deep a turn's brackets may nest before it is parsed: deeper is a malformed call (JSON this deep
would raise RecursionError in the parser; no tool takes arguments nested past a few levels)."""


def prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    """Make `tokenizer` render tools and tool messages and parse tool calls: its own template and response
    template where it has them; a ChatML model without them (SmolLM2) gets TRL's ChatML tool format. A
    template that is not prefix-preserving (Qwen3's drops the think block of a turn once a tool result
    follows) is swapped for TRL's training version of it, as TRL does for multi-turn rollouts."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    chatml = "<|im_start|>" in template
    if not renders_tool_calls(tokenizer):
        if not chatml:
            raise ToolError(
                "tools need a chat template that renders tool calls and tool results; this tokenizer's does "
                "not, and it is not ChatML (set one with tokenizer.chat_template)"
            )
        tokenizer.chat_template = CHATML_TOOL_TEMPLATE
    if not prefix_preserving(tokenizer):
        tokenizer.chat_template = _training_template(tokenizer)
        logger.warning(
            "tools: the chat template is not prefix-preserving; rollouts use TRL's training one, which the "
            "run's checkpoints and final model keep (TRL saves the original)"
        )
    if getattr(tokenizer, "response_template", None) is None:
        if not chatml:
            raise ToolError(
                "tools need the tokenizer's response_template to parse tool calls (transformers' "
                "parse_response); this tokenizer has none and is not ChatML"
            )
        tokenizer.response_template = CHATML_RESPONSE_TEMPLATE


def prefix_preserving(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether a conversation's start renders the same when a tool result follows, which `tool_suffix_ids`
    relies on (TRL's `is_chat_template_prefix_preserving`, on the same messages)."""
    call = {"type": "function", "function": {"name": "dummy", "arguments": {}}}
    start: list[Any] = [
        {"role": "user", "content": "dummy"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    first = list(tokenizer.apply_chat_template(start, tokenize=True, return_dict=False))
    result = {"role": "tool", "name": "dummy", "content": "dummy"}
    ids = tokenizer.apply_chat_template(
        [*start, result], tokenize=True, return_dict=False, add_generation_prompt=True
    )
    return list(ids[: len(first)]) == first


def _training_template(tokenizer: PreTrainedTokenizerBase) -> str:
    """TRL's prefix-preserving training version of the tokenizer's template (`trl.chat_template_utils`,
    which knows the common templates: Qwen3, Llama 3, Gemma, ...)."""
    problem = "the chat template renders a conversation's start differently once a tool result follows"
    try:
        from trl.chat_template_utils import get_training_chat_template
    except ImportError:
        raise ToolError(f"{problem}; TRL's training version of it needs trl installed") from None
    try:
        template = get_training_chat_template(tokenizer)
    except ValueError:
        template = None
    if template is None:
        raise ToolError(f"{problem}, and TRL has no training version of it: set tokenizer.chat_template")
    return template


def renders_tool_calls(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template shows an assistant's tool call and the tool's result (TRL's check)."""
    call = {"type": "function", "function": {"name": "tool_name_a8f3", "arguments": {"arg_b9d4": "val_d6e7"}}}
    messages: list[Any] = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "tool_name_a8f3", "content": "result_c4f9"},
    ]
    try:
        text = str(render_chat(tokenizer, messages, tokenize=False))
    except Exception:  # a template that rejects these roles
        return False
    return all(s in text for s in ("tool_name_a8f3", "arg_b9d4", "val_d6e7", "result_c4f9"))


class Toolbox:
    """One rollout's tools by name: functions with type hints and Google-style docstrings (sync or async),
    each call bounded by `timeout_s`."""

    def __init__(self, tools: Sequence[Callable[..., Any]], timeout_s: float | None = None):
        self.functions = {tool.__name__: tool for tool in tools}
        self.timeout_s = timeout_s

    @cached_property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas (transformers' get_json_schema), as chat templates take them."""
        from transformers.utils import get_json_schema

        schemas = []
        for name, tool in self.functions.items():
            try:
                schemas.append(get_json_schema(tool))
            except Exception as e:  # transformers' DocstringParsingException, TypeHintParsingException
                raise ToolError(f"tool {name!r}: {str(e).splitlines()[0]}") from None
        return schemas

    async def call(self, tool_call: Any) -> tuple[str, str, bool]:
        """Run one parsed tool call: (tool name, the tool message's text, whether it failed). A tool that
        raises (SystemExit and KeyboardInterrupt too: the run's own signals reach StopSignals) or runs past
        `timeout_s` fails, and its result is the error, as TRL writes one; what it returns is written as
        `str()` does, as TRL does."""
        name = "unknown"
        try:
            called = called_function(tool_call)
            if called is None:
                raise ValueError(f"Unsupported tool call: {tool_call!r:.100}")
            name, arguments = called
            if name not in self.functions:
                raise ValueError(f"Tool {name} not found.")
            if not isinstance(arguments, dict):
                raise ValueError(f"arguments must be a JSON object, not {arguments!r:.100}")
            tool = self.functions[name]
            run = tool(**arguments) if inspect.iscoroutinefunction(tool) else _in_thread(tool, arguments)
            result = await asyncio.wait_for(run, self.timeout_s)
            return name, as_text(result), False
        except asyncio.TimeoutError:
            return name, str({"error": f"did not return within tools.timeout_s={self.timeout_s:g}s"}), True
        except (Exception, SystemExit, KeyboardInterrupt) as e:  # a tool's own exit: its failed result
            return name, str({"error": str(e) or type(e).__name__}), True


def called_function(tool_call: Any) -> tuple[str, Any] | None:
    """(name, arguments) of a well-formed tool call, TRL's `{"type": "function", "function": {"name": ...,
    "arguments": ...}}`; None for anything else the model's text parsed into."""
    if not isinstance(tool_call, dict) or tool_call.get("type") != "function":
        return None
    function = tool_call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return None
    return function["name"], function.get("arguments", {})


def check_tool_calls(calls: Any) -> None:
    """TRL's `_validate_tool_calls`: a ValueError unless every parsed call is a dict whose name (in its
    `function`, or flat) is a string; missing or null arguments become `{}`. A turn that fails it is read
    as plain text, so its rollout ends (TRL's `parse_response`)."""
    if calls is None:
        return
    if not isinstance(calls, list):
        raise ValueError("tool_calls must be a list")
    for tool_call in calls:
        if not isinstance(tool_call, dict):
            raise ValueError("a tool call must be a dict")
        function = tool_call.get("function", tool_call)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError("a tool call's name must be a string")
        if function.get("arguments") is None:
            function["arguments"] = {}


def as_text(result: Any) -> str:
    """A tool's result as the tool message's text, as TRL writes it: `str(result)` (a `None` is "None", a
    dict its Python repr). TRL passes a list on as content parts (images); leangrpo, without images, writes
    it as text too, which a template that prints the content renders the same."""
    return result if isinstance(result, str) else str(result)


async def _in_thread(tool: Callable[..., Any], arguments: dict[str, Any]) -> Any:
    """A sync tool's result, computed in a daemon thread so that a timeout can leave a stuck tool behind
    (asyncio's own executor would be joined when the loop closes)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = tool(**arguments)
        except BaseException as e:  # handed to the awaiting coroutine
            error = e
        with contextlib.suppress(RuntimeError):  # the loop is closed: the call timed out long ago
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, daemon=True, name="leangrpo-tool").start()
    return await future


def run_tool_calls(calls: list[tuple[Toolbox, Any]]) -> list[tuple[str, str, bool]]:
    """Every (toolbox, tool call) of a tool-calling turn: sync tools one after another in order (an
    environment's methods may depend on the order), async tools concurrently beside them."""

    async def run_all() -> list[tuple[str, str, bool]]:
        results: list[tuple[str, str, bool] | None] = [None] * len(calls)

        async def one(i: int) -> None:
            box, tool_call = calls[i]
            results[i] = await box.call(tool_call)

        def is_async(box: Toolbox, tool_call: Any) -> bool:
            called = called_function(tool_call)
            return called is not None and inspect.iscoroutinefunction(box.functions.get(called[0]))

        async def sync_in_order() -> None:
            for i, (box, tool_call) in enumerate(calls):
                if not is_async(box, tool_call):
                    await one(i)

        asynchronous = [one(i) for i, (box, call) in enumerate(calls) if is_async(box, call)]
        await asyncio.gather(sync_in_order(), *asynchronous)
        return [r for r in results if r is not None]

    with ThreadPoolExecutor(1) as pool:  # its own loop, also under a caller's running one
        return pool.submit(asyncio.run, run_all()).result()


@dataclass
class ToolUse:
    """What each rollout did with its tools: its messages (the assistant's turns, tool calls included,
    and the tool results, as TRL gives rewards `completions`), model turns, and calls and failures by
    tool name."""

    messages: list[list[Message]]
    turns: list[int]
    calls: list[Counter[str]]
    failures: list[Counter[str]]
    columns: dict[str, list[Any]] = field(default_factory=dict)  # more reward inputs, one value each

    def select(self, rows: list[int]) -> ToolUse:
        def pick(column: list[Any]) -> list[Any]:
            return [column[i] for i in rows]

        columns = {key: pick(values) for key, values in self.columns.items()}
        return ToolUse(pick(self.messages), pick(self.turns), pick(self.calls), pick(self.failures), columns)

    @staticmethod
    def cat(uses: list[ToolUse]) -> ToolUse:
        def joined(column: Callable[[ToolUse], list[Any]]) -> list[Any]:
            return [x for use in uses for x in column(use)]

        keys = dict.fromkeys(key for use in uses for key in use.columns)
        return ToolUse(
            joined(lambda u: u.messages), joined(lambda u: u.turns), joined(lambda u: u.calls),
            joined(lambda u: u.failures),
            {key: [x for u in uses for x in u.columns.get(key, [None] * len(u.turns))] for key in keys},
        )  # fmt: skip

    def metrics(self) -> dict[str, float]:
        """TRL's tools/call_frequency (calls per rollout) and tools/failure_frequency (failures per call),
        tools/turns (model turns per rollout), and each tool's calls and failures."""
        calls, failures = sum(self.calls, Counter()), sum(self.failures, Counter())
        total = sum(calls.values())
        return {
            "tools/call_frequency": total / len(self.turns),
            "tools/failure_frequency": sum(failures.values()) / total if total else 0.0,
            "tools/turns": sum(self.turns) / len(self.turns),
            **{f"tools/{name}/calls": float(n) for name, n in sorted(calls.items())},
            **{f"tools/{name}/failures": float(failures[name]) for name in sorted(calls)},
        }


TurnGenerator = Callable[[list[list[int]], int], tuple[list[list[int]], list[list[float]] | None]]
"""Continues each token sequence by at most the given number of tokens: the new tokens (up to and
including the first EOS) and the sampler's log-probs of them (None where the engine has none)."""


@dataclass
class Trajectories:
    """The tool loop's output, one list per rollout: the completion (model and tool tokens), which of its
    tokens the model wrote (1) or a tool (0), the sampler's log-probs (0 on tool tokens) and what the
    rollout did with its tools."""

    completion_ids: list[list[int]]
    model_mask: list[list[int]]
    logprobs: list[list[float]] | None
    use: ToolUse = field(repr=False)


def tool_loop(
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    logprobs: list[list[float]] | None,
    toolboxes: list[Toolbox],
    generate_turns: TurnGenerator,
    max_completion_length: int,
    max_iterations: int | None,
    max_model_len: int | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> Trajectories:
    """TRL 1.16's `_tool_call_loop` on first turns already sampled: while some rollouts called tools (at
    most `max_iterations` rounds), run the calls, append the tool messages' tokens (`tool_suffix_ids`) and
    generate the next turn. The tool results count toward `max_completion_length`, as in TRL: a result that
    would pass it (or `max_model_len` in all) is dropped, ending its rollout; a later turn is cut to fit."""
    completion_ids, logprobs = [list(c) for c in completion_ids], logprobs and [list(lp) for lp in logprobs]
    model_mask = [[1] * len(ids) for ids in completion_ids]
    n = len(completion_ids)
    use = ToolUse(
        [[] for _ in range(n)], [1] * n, [Counter() for _ in range(n)], [Counter() for _ in range(n)]
    )
    pending: dict[int, list[Any]] = {}
    for i, ids in enumerate(completion_ids):
        message, calls = parse_turn(tokenizer, ids, prompt_ids[i], toolboxes[i], use, i)
        use.messages[i].append(message)
        if calls:
            pending[i] = calls
    iteration = 0
    while pending and (max_iterations is None or iteration < max_iterations):
        results = run_tool_calls([(toolboxes[i], call) for i in pending for call in pending[i]])
        sequences, budgets = {}, {}
        for i, calls in pending.items():
            mine, results = results[: len(calls)], results[len(calls) :]
            tool_messages = [_tool_message(use, i, *result) for result in mine]
            suffix = tool_suffix_ids(tokenizer, tool_messages, chat_template_kwargs)
            sequence = prompt_ids[i] + completion_ids[i] + suffix
            used = len(sequence) - len(prompt_ids[i])
            if used > max_completion_length or (max_model_len is not None and len(sequence) >= max_model_len):
                continue  # TRL drops the results and ends the rollout with its completion as it is
            use.messages[i] += tool_messages
            sequences[i], budgets[i] = sequence, max_completion_length - used
        pending = {}
        if not sequences:
            break
        turns = _next_turns(generate_turns, sequences, budgets)
        for i, (turn, turn_logprobs) in turns.items():
            tool_length = len(sequences[i]) - len(prompt_ids[i]) - len(completion_ids[i])
            model_mask[i] += [0] * tool_length + [1] * len(turn)
            if logprobs is not None and turn_logprobs is not None:
                logprobs[i] += [0.0] * tool_length + turn_logprobs
            completion_ids[i] = sequences[i][len(prompt_ids[i]) :] + turn
            if turn:
                message, calls = parse_turn(tokenizer, turn, sequences[i], toolboxes[i], use, i)
                use.messages[i].append(message)
                use.turns[i] += 1
                if calls:
                    pending[i] = calls
        iteration += 1
    return Trajectories(completion_ids, model_mask, logprobs, use)


def _next_turns(
    generate_turns: TurnGenerator, sequences: dict[int, list[int]], budgets: dict[int, int]
) -> dict[int, tuple[list[int], list[float] | None]]:
    """Each rollout's next turn (ids and sampler log-probs) cut at its budget. A rollout whose tool
    results filled the budget exactly gets an empty turn without asking the engine for zero tokens."""
    turns: dict[int, tuple[list[int], list[float] | None]] = {i: ([], []) for i in sequences}
    live = [i for i in sequences if budgets[i] > 0]
    if live:
        new_ids, new_logprobs = generate_turns([sequences[i] for i in live], max(budgets[i] for i in live))
        for k, i in enumerate(live):
            turn = new_ids[k][: budgets[i]]
            turns[i] = (turn, None if new_logprobs is None else new_logprobs[k][: len(turn)])
    return turns


def _tool_message(use: ToolUse, row: int, name: str, content: str, failed: bool) -> Message:
    """A tool's result as the message the model reads next, counted in `use` for rollout `row`."""
    use.calls[row][name] += 1
    use.failures[row][name] += failed
    return {"role": "tool", "name": name, "content": content}


def turn_message(tokenizer: PreTrainedTokenizerBase, ids: list[int], prefix: list[int]) -> Message:
    """One assistant turn as a message, tool calls parsed where the tokenizer can (TRL's completions)."""
    if getattr(tokenizer, "response_template", None) is None:
        return {"role": "assistant", "content": str(tokenizer.decode(ids, skip_special_tokens=True))}
    use = ToolUse([[]], [1], [Counter()], [Counter()])
    return parse_turn(tokenizer, ids, prefix, Toolbox([]), use, 0)[0]


def parse_turn(
    tokenizer: PreTrainedTokenizerBase,
    ids: list[int],
    prefix: list[int],
    toolbox: Toolbox,
    use: ToolUse,
    row: int,
) -> tuple[Message, list[Any]]:
    """One assistant turn as a message (transformers' parse_response, TRL's fallback to the decoded text)
    and its tool calls. A call that does not parse in a finished turn counts as a call and a failure of
    tool "malformed" (TRL counts neither)."""
    text = str(tokenizer.decode(ids, skip_special_tokens=True))
    try:
        if nesting_depth(text) > MAX_CALL_DEPTH:
            raise ValueError(f"nested deeper than {MAX_CALL_DEPTH}")
        tools: list[Any] = list(toolbox.schemas)
        message = tokenizer.parse_response(ids, prefix=prefix, tools=tools)
        if message is None:
            raise ValueError("nothing parsed")
        check_tool_calls(message.get("tool_calls"))  # a call without a name: plain text, as TRL
    except (ValueError, TypeError, RecursionError):
        if TOOL_CALL_OPENER in text and ids and ids[-1] == tokenizer.eos_token_id:  # not cut at the budget
            use.calls[row]["malformed"] += 1
            use.failures[row]["malformed"] += 1
        return {"role": "assistant", "content": text}, []
    message = dict(message)
    content = message.get("content") or ""
    message["content"] = (
        content.removesuffix(tokenizer.eos_token or "") if isinstance(content, str) else content
    )
    calls = message.get("tool_calls") or []
    return message, list(calls)


def nesting_depth(text: str) -> int:
    """How deep the brackets of `text` nest ({ and [, strings not told apart: an upper bound)."""
    depth = deepest = 0
    for c in re.sub(r"[^\[\]{}]", "", text):
        depth = depth + 1 if c in "[{" else max(depth - 1, 0)
        deepest = max(deepest, depth)
    return deepest


def tool_suffix_ids(
    tokenizer: PreTrainedTokenizerBase,
    tool_messages: list[Message],
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The tokens that follow an assistant's tool-calling turn (ended at its EOS): the tool messages and the
    next assistant header, from the chat template with the run's `chat_template_kwargs`, as every render
    (TRL's `_get_tool_suffix_ids`)."""
    call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
    dummy: list[Any] = [
        {"role": "user", "content": "dummy"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    kwargs = chat_template_kwargs or {}
    prefix = list(render_chat(tokenizer, dummy, tokenize=True, return_dict=False, **kwargs))
    rendered = render_chat(
        tokenizer,
        dummy + tool_messages,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **kwargs,
    )
    full = list(rendered)
    ends = [k for k, token in enumerate(prefix) if token == tokenizer.eos_token_id]
    if ends:
        prefix = prefix[: ends[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ToolError(
            "the chat template does not render a conversation's start the same way when it goes on"
        )
    return full[len(prefix) :]
