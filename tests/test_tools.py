"""Multi-turn rollouts with tools: the tool loop against TRL 1.16's own `_tool_call_loop`, tool faults,
concurrency of async tools, environments, and the loss seeing only the model's tokens."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from types import SimpleNamespace

import pytest
import torch

from leangrpo.engines.agents import AgentSpec
from leangrpo.engines.tools import Toolbox, ToolError, prepare_tokenizer, run_tool_calls, tool_loop
from leangrpo.engines.types import RolloutBatch


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def broken(x: int) -> str:
    """Always fails.

    Args:
        x: ignored
    """
    raise RuntimeError("out of order")


@pytest.fixture(scope="module")
def tool_tokenizer(real_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_tokenizer_dir)
    prepare_tokenizer(tok)
    return tok


def call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def test_smollm2_gets_the_chatml_tool_format(tool_tokenizer):
    """SmolLM2's template cannot show tools; it gets TRL's ChatML tool format, which parse_response reads."""
    text = tool_tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+3?"}], tools=[add], tokenize=False, add_generation_prompt=True
    )
    assert '"name": "add"' in text and "<tool_call>" in text and text.endswith("<|im_start|>assistant\n")
    turn = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
    ids = tool_tokenizer(turn, add_special_tokens=False).input_ids
    assert tool_tokenizer.parse_response(ids, prefix=text)["tool_calls"] == [call("add", a=2, b=3)]


def test_async_tools_run_concurrently():
    """Four async calls sleeping 0.4 s each take about 0.4 s in all; sync ones run one after another."""

    async def slow(x: int) -> str:
        """Sleeps.

        Args:
            x: echoed
        """
        await asyncio.sleep(0.4)
        return str(x)

    box = Toolbox([slow])
    start = time.perf_counter()
    results = run_tool_calls([(box, call("slow", x=i)) for i in range(4)])
    assert time.perf_counter() - start < 1.0
    assert results == [("slow", str(i), False) for i in range(4)]

    def slow_sync(x: int) -> str:
        """Sleeps.

        Args:
            x: echoed
        """
        time.sleep(0.2)
        return str(x)

    start = time.perf_counter()
    run_tool_calls([(Toolbox([slow_sync]), call("slow_sync", x=i)) for i in range(3)])
    assert time.perf_counter() - start >= 0.6


def test_tool_faults_become_error_messages():
    """A tool that raises or runs too long, an unknown tool, bad arguments, calls of other shapes (sampled
    text parses into anything): the model gets the error as the result, and each is a failure; nothing
    raises. A result that is not text is written with str(), as TRL does."""

    def hang(x: int) -> str:
        """Hangs.

        Args:
            x: ignored
        """
        time.sleep(5)
        return "late"

    def opaque(x: int) -> object:
        """Returns an object.

        Args:
            x: ignored
        """
        return object()

    box = Toolbox([add, broken, hang, opaque], timeout_s=0.3)
    start = time.perf_counter()
    results = run_tool_calls(
        [(box, c) for c in (
            call("add", a=1, b=2), call("broken", x=1), call("hang", x=1), call("opaque", x=1),
            call("missing"), call("add", a=1), {"type": "code", "code": "rm -rf /"},
            {"type": "function", "function": "add"}, {"type": "function", "function": {"name": ["add"]}},
        )]
    )  # fmt: skip
    assert time.perf_counter() - start < 2
    assert results[0] == ("add", "3", False)
    assert [failed for _, _, failed in results[1:]] == [True, True, False] + [True] * 5
    assert [name for name, _, _ in results[-3:]] == ["unknown"] * 3
    assert "out of order" in results[1][1] and "timeout_s=0.3" in results[2][1]
    assert results[3][1].startswith("<object object") and "not found" in results[4][1]  # str(), as TRL


def test_results_are_written_as_trl_writes_them():
    """TRL sends `str(result)`: a tool returning None sends "None" (not a failure), a dict its repr."""

    def nothing(x: int) -> None:
        """Returns nothing.

        Args:
            x: ignored
        """

    def record(x: int) -> dict:
        """Returns a dict.

        Args:
            x: ignored
        """
        return {"x": x, "ok": True, "note": None}

    box = Toolbox([nothing, record])
    results = run_tool_calls([(box, call("nothing", x=1)), (box, call("record", x=2))])
    assert results == [("nothing", "None", False), ("record", "{'x': 2, 'ok': True, 'note': None}", False)]


@pytest.mark.parametrize("body", ['{"arguments": {"a": 1, "b": 2}}', '{"name": 7, "arguments": {}}'])
def test_a_call_without_a_string_name_ends_the_rollout(tool_tokenizer, body):
    """TRL's parse_response refuses a call whose name is missing or not a string: the turn is plain text,
    so the rollout ends; no error message and no further turn."""
    tok = tool_tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "q"}], tools=[add], add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )  # fmt: skip
    turn = tok(f"<tool_call>\n{body}\n</tool_call><|im_end|>", add_special_tokens=False).input_ids
    out = tool_loop(
        tok, [prompt], [turn], None, [Toolbox([add])], lambda s, n: pytest.fail("resumed"), 64, None
    )
    assert out.completion_ids == [turn] and out.use.turns == [1]
    assert [m["role"] for m in out.use.messages[0]] == ["assistant"]
    assert "tool_calls" not in out.use.messages[0][0]


def test_a_malformed_call_is_a_failure_and_ends_the_rollout(tool_tokenizer):
    tok = tool_tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "q"}],
        tools=[add],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    turn = tok('<tool_call>\n{"name": "add", "argu</tool_call><|im_end|>', add_special_tokens=False).input_ids
    out = tool_loop(
        tok, [prompt], [turn], None, [Toolbox([add])], lambda s, n: pytest.fail("resumed"), 64, None
    )
    assert out.completion_ids == [turn] and out.model_mask == [[1] * len(turn)]
    assert out.use.metrics()["tools/failure_frequency"] == 1.0 and out.use.calls[0]["malformed"] == 1


def test_results_that_fill_the_budget_end_the_rollout_without_a_zero_token_turn(tool_tokenizer):
    """Tool results that take the completion exactly to max_completion_length are kept (TRL drops only
    those that pass it), and the rollout ends there: the engine is never asked for a 0-token turn (vLLM
    refuses max_tokens=0), while a rollout with budget left still gets its turn."""
    from leangrpo.engines.tools import tool_suffix_ids

    tok = tool_tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "q"}], tools=[add], add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )  # fmt: skip
    calling = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
    short, long = (tok(calling.replace("3", b), add_special_tokens=False).input_ids for b in ("3", "30"))
    suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "add", "content": "32"}])
    budget = len(long) + len(suffix)  # the long call's result fills it
    answer = tok("5<|im_end|>", add_special_tokens=False).input_ids
    asked = []

    def turns(sequences, max_new):
        asked.append(max_new)
        assert max_new > 0, "asked for a 0-token turn"
        return [answer[:max_new] for _ in sequences], None

    out = tool_loop(tok, [prompt] * 2, [long, short], None, [Toolbox([add])] * 2, turns, budget, None)
    assert len(asked) == 1 and out.use.turns == [1, 2]
    assert out.completion_ids[0] == long + suffix and len(out.completion_ids[0]) == budget
    assert out.model_mask[0] == [1] * len(long) + [0] * len(suffix)
    out = tool_loop(tok, [prompt], [long], None, [Toolbox([add])], turns, budget, None)
    assert len(asked) == 1 and out.use.messages[0][-1]["role"] == "tool"  # kept, and no turn asked for


def test_a_tool_without_a_schema_is_one_line():
    def undocumented(x):
        return x

    with pytest.raises(ToolError, match="undocumented"):
        AgentSpec([undocumented])


# ------------------------------------------------------------------- the loop against TRL's own

TURNS = {  # each row's model turns, in order: what the stub "samples"
    "a": [
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
        "It is 5<|im_end|>",
    ],
    "b": ["No tools needed<|im_end|>"],
    "c": [
        '<tool_call>\n{"name": "broken", "arguments": {"x": 1}}\n</tool_call><|im_end|>',
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call><|im_end|>',
        "never reached<|im_end|>",  # the second result would pass the budget: dropped, the rollout ends
    ],
    "d": [
        '<tool_call>\n{"name": "add", "arguments": {"a": 7, "b": 8}}\n</tool_call><|im_end|>',
        "15" + " two" * 60 + "<|im_end|>",  # cut at the budget
    ],
}


def _stub(tok, prompts: dict[str, list[int]]):
    """A generator that answers each sequence with its row's next scripted turn (found by the prompt it
    starts with and the assistant turns after it)."""
    header = tok("<|im_start|>assistant", add_special_tokens=False).input_ids

    def turns(sequences: list[list[int]], max_new: int) -> list[list[int]]:
        out = []
        for seq in sequences:
            row = next(k for k, p in prompts.items() if seq[: len(p)] == p)
            tail = seq[len(prompts[row]) :]
            done = sum(tail[i : i + len(header)] == header for i in range(len(tail)))
            out.append(tok(TURNS[row][done], add_special_tokens=False).input_ids)
        return out

    return turns


@pytest.mark.parametrize("max_iterations", [None, 1])
def test_the_tool_loop_matches_trls(tool_tokenizer, max_iterations):
    """Same scripted turns on both sides: TRL 1.16's `_tool_call_loop` and leangrpo's `tool_loop` give the
    same completion ids, tool_mask and messages, calls and failures (a failing tool, a result that would
    pass max_completion_length, a turn cut at it)."""
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    from trl.chat_template_utils import parse_response

    tok, max_len = tool_tokenizer, 110
    chats = {k: [{"role": "user", "content": f"question {k}"}] for k in TURNS}
    prompts = {
        k: tok.apply_chat_template(
            m, tools=[add, broken], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for k, m in chats.items()
    }
    stub = _stub(tok, prompts)
    first = stub(list(prompts.values()), max_len)

    box = Toolbox([add, broken])
    ours = tool_loop(
        tok,
        list(prompts.values()),
        first,
        None,
        [box] * 4,
        lambda s, n: (stub(s, n), None),
        max_len,
        max_iterations,
    )

    fake = SimpleNamespace(
        max_tool_calling_iterations=max_iterations or 10**9,
        _sync_tool_dicts=[{"add": add, "broken": broken}] * 4,
        _async_tool_dicts=[{}] * 4,
        processing_class=tok,
        _tokenizer=tok,
        _is_vlm=False,
        chat_template=None,
        chat_template_kwargs={},
        use_vllm=False,
        model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=1024)),
        max_completion_length=max_len,
        environment_factories=None,
        tools=[add, broken],
        _generate_single_turn=lambda ids, *a, **k: (stub(ids, max_len), None),
    )
    fake._get_tool_suffix_ids = lambda m: trl_grpo.GRPOTrainer._get_tool_suffix_ids(fake, m)
    completions = [
        [parse_response(tok, ids, prefix=p, tools=[add, broken])]
        for ids, p in zip(first, prompts.values(), strict=True)
    ]
    mask, messages, ids, _, calls, failures, _ = trl_grpo.GRPOTrainer._tool_call_loop(
        fake, copy.deepcopy(list(chats.values())), list(prompts.values()), copy.deepcopy(first), completions,
        None, None, {},
    )  # fmt: skip

    assert ours.completion_ids == ids
    assert ours.model_mask == mask
    assert ours.use.messages == messages
    assert sum(sum(c.values()) for c in ours.use.calls) == calls
    assert sum(sum(f.values()) for f in ours.use.failures) == failures
    assert 0 in mask[0] and mask[1] == [1] * len(ids[1])  # the test covers tool tokens and a plain turn
    if max_iterations is None:
        assert len(ids[3]) == max_len  # d's second turn was cut at the budget
        assert messages[2][-1]["tool_calls"] and len(ids[2]) < max_len  # c's second result was dropped


# --------------------------------------------------------------------------------------- the loss


def test_environment_tokens_get_no_gradient(tiny_model_dir):
    """A trajectory ending in tool tokens: changing those tokens leaves the update's gradient unchanged
    when they are masked as the environment's, and changes it when they are counted as the model's."""
    from transformers import AutoModelForCausalLM

    from leangrpo.core.grpo import BatchTotals, LossSpec, grpo_loss
    from leangrpo.train.policy import Policy, micro_batch_logprobs

    torch.manual_seed(0)
    policy = Policy(AutoModelForCausalLM.from_pretrained(tiny_model_dir), 1.0, 256, 1)
    n, p, c, tool = 2, 4, 8, 3
    prompt = torch.randint(100, 1000, (n, p))
    completion = torch.randint(100, 1000, (n, c))
    model_mask = torch.ones(n, c, dtype=torch.long)
    model_mask[:, -tool:] = 0

    def grad(completion_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        batch = RolloutBatch(
            prompt, torch.ones(n, p, dtype=torch.long), completion_ids, torch.ones(n, c, dtype=torch.long),
            torch.zeros(n, dtype=torch.bool), ["", ""], None, mask,
        )  # fmt: skip
        policy.zero_grad()
        logp, _, entropy = micro_batch_logprobs(policy, batch, slice(None), with_entropy=True)
        loss, _ = grpo_loss(
            logp, logp.detach(), None, torch.tensor([1.0, -0.5]), batch.loss_mask.float(),
            LossSpec("dapo", 0.2, 0.2, c), BatchTotals(n, float(batch.loss_mask.sum())), entropy=entropy,
        )  # fmt: skip
        loss.backward()
        return torch.cat([q.grad.flatten() for q in policy.parameters() if q.grad is not None])

    perturbed = completion.clone()
    perturbed[:, -tool:] = torch.randint(1000, 2000, (n, tool))
    torch.testing.assert_close(grad(completion, model_mask), grad(perturbed, model_mask), rtol=0, atol=0)
    assert not torch.equal(grad(completion, None), grad(perturbed, None))


def test_lengths_and_the_loss_mask_count_the_models_tokens_only():
    batch = RolloutBatch(
        torch.ones(1, 2, dtype=torch.long),
        torch.ones(1, 2, dtype=torch.long),
        torch.ones(1, 5, dtype=torch.long),
        torch.tensor([[1, 1, 1, 1, 0]]),
        torch.zeros(1, dtype=torch.bool),
        [""],
        None,
        torch.tensor([[1, 0, 0, 1, 1]]),
    )
    assert batch.lengths().tolist() == [2]
    assert batch.loss_mask.tolist() == [[1, 0, 0, 1, 0]]
    cat = RolloutBatch.cat([batch, batch.select(torch.tensor([0]))])
    assert cat.loss_mask.tolist() == [[1, 0, 0, 1, 0]] * 2


# ------------------------------------------------------------------------------ through the Trainer

SEEN: dict = {}


def record_reward(prompts, completions, **kwargs):
    """Scores 1 and keeps what it was given."""
    SEEN.update(kwargs, completions=completions)
    return [1.0] * len(completions)


def _config(tmp_path, tiny_model_dir, gsm8k_dir, **extra):
    from leangrpo.run.resolve import validate_config

    return validate_config({
        "model": {"name_or_path": str(tiny_model_dir), "gradient_checkpointing": False},
        "data": {"path": str(gsm8k_dir / "train.jsonl"), "limit": 4},
        "rewards": {"functions": [{"name": "test_tools:record_reward"}]},
        "grpo": {"num_generations": 2, "max_completion_length": 8, "loss_type": "dapo"},
        "optim": {"per_device_train_batch_size": 4, "max_steps": 1},
        "logging": {"progress_bar": False, "log_completions_steps": 0},
        "output_dir": str(tmp_path / "run"), **extra,
    })  # fmt: skip


def test_a_rollout_funcs_env_mask_reaches_the_loss_and_its_keys_the_rewards(
    tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch
):
    import leangrpo.core.grpo as grpo_mod
    from leangrpo.train.trainer import Trainer

    masks = []
    real_loss = grpo_mod.grpo_loss

    def spy(logp, old, ref, adv, mask, **kwargs):
        masks.append(mask.clone())
        return real_loss(logp, old, ref, adv, mask, **kwargs)

    monkeypatch.setattr(grpo_mod, "grpo_loss", spy)

    def rollout_func(prompts, trainer):
        n = len(prompts)
        return {
            "prompt_ids": [[10, 11, 12]] * n,
            "completion_ids": [[20, 21, 22, 23, 2]] * n,
            "logprobs": [[-1.0] * 5] * n,
            "env_mask": [[1, 0, 0, 1, 1]] * n,
            "turn_count": [2] * n,
        }

    metrics = Trainer(
        _config(tmp_path, tiny_model_dir, gsm8k_dir), agent=AgentSpec(rollout_func=rollout_func)
    ).step(1)
    (mask,) = masks
    assert mask.tolist() == [[1, 0, 0, 1, 1]] * 4
    assert SEEN["turn_count"] == [2] * 4 and SEEN["completions"][0][0]["role"] == "assistant"
    assert metrics["completions/mean_length"] == 3  # the model's tokens only, as TRL counts them


def test_yaml_tools_run_a_step(tmp_path, tiny_model_dir, gsm8k_dir):
    """`tools: {functions: [...]}` from the config: prompts carry the tool schema, the step runs and logs
    TRL's tools/* metrics (the random tiny model calls no tool)."""
    from leangrpo.train.trainer import Trainer

    trainer = Trainer(_config(tmp_path, tiny_model_dir, gsm8k_dir, tools={"functions": ["test_tools:add"]}))
    metrics = trainer.step(1)
    assert metrics["tools/call_frequency"] == 0 and metrics["tools/turns"] == 1
    assert isinstance(SEEN["completions"][0], list)  # messages, as TRL gives them with tools
    assert '"name": "add"' in trainer.tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"}], tools=[add], tokenize=False
    )


# ------------------------------------------------------------------------------------- evaluation

EVAL_TURNS = {  # each held-out question's scripted turns
    "question a": [
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
        "<answer>5</answer><|im_end|>",
    ],
    "question b": ["<answer>4</answer><|im_end|>"],
    "question c": [
        '<tool_call>\n{"name": "broken", "arguments": {"x": 1}}\n</tool_call><|im_end|>',
        "<answer>1</answer><|im_end|>",
    ],
}


class ScriptedEngine:
    """A RolloutEngine whose model answers each question with its scripted turns, through the real tool
    loop; it keeps the prompt texts it was given."""

    def __init__(self, tok):
        self.tok, self.texts = tok, []

    def turns(self, sequences: list[list[int]], max_new: int = 0) -> list[list[int]]:
        out = []
        for seq in sequences:
            text = self.tok.decode(seq)
            question = next(q for q in EVAL_TURNS if q in text)
            done = text.count("<|im_start|>assistant") - 1
            out.append(self.tok(EVAL_TURNS[question][done], add_special_tokens=False).input_ids)
        return out

    def generate(self, texts, sampling, toolboxes=None):
        from torch.nn.utils.rnn import pad_sequence

        from leangrpo.engines.types import encode_prompts, finish_batch, with_tools

        self.texts += texts
        tok, eos = self.tok, [self.tok.eos_token_id]
        prompt_ids, prompt_mask = encode_prompts(tok, texts, sampling.max_prompt_length, 1)
        prompts = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids, prompt_mask, strict=True)]
        turns = [torch.tensor(ids) for ids in self.turns(prompts)]
        completions = pad_sequence(turns, batch_first=True, padding_value=tok.pad_token_id)
        first = finish_batch(tok, prompt_ids, prompt_mask, completions, eos, sampling)
        if toolboxes is None:
            return first
        return with_tools(first, tok, toolboxes, sampling, lambda s, n: (self.turns(s), None), eos, None)


def test_evaluation_rolls_out_with_the_tools(tool_tokenizer):
    """With the run's tools, held-out questions go through the tool loop: prompts show the tools, rewards
    get the turns as messages, correctness reads the final answer, and each record and the metrics count
    tool calls and failures."""
    from leangrpo.config.schema import TaskConfig
    from leangrpo.data.tasks import load_task
    from leangrpo.engines.types import Sampling
    from leangrpo.train.evaluation import evaluate

    rows = [
        {"prompt": [{"role": "user", "content": q}], "answer": a}
        for q, a in zip(EVAL_TURNS, "571", strict=True)
    ]
    engine = ScriptedEngine(tool_tokenizer)
    result = evaluate(
        SimpleNamespace(device=torch.device("cpu")), tool_tokenizer, rows,
        [("record", record_reward, 1.0)], load_task(TaskConfig()), Sampling(1, 512, 128), progress=False,
        engine=engine, agent=AgentSpec([add, broken]),
    )  # fmt: skip
    assert all('"name": "add"' in text and '"name": "broken"' in text for text in engine.texts)
    records = result.records
    assert [(r["tool_calls"], r["tool_failures"], r["turns"]) for r in records] == [
        (1, 0, 2),
        (0, 0, 1),
        (1, 1, 2),
    ]
    assert [r["correct"] for r in records] == [True, False, True]
    assert SEEN["completions"][0][1] == {"role": "tool", "name": "add", "content": "5"}
    assert result.metrics["tools/call_frequency"] == pytest.approx(2 / 3)
    assert result.metrics["tools/failure_frequency"] == pytest.approx(1 / 2)
    assert result.metrics["accuracy"] == pytest.approx(2 / 3)


# ------------------------------------------------------------------- the HF engine's turns, resumed


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory, real_tokenizer_dir):
    from conftest import make_tool_model

    return make_tool_model(tmp_path_factory.mktemp("tool-model"), real_tokenizer_dir)


def test_resumed_turns_give_the_tokens_of_re_encoded_ones(tool_model_dir, levers, monkeypatch):
    """Greedy rollouts of a model trained to call the calculator (up to 3 turns): turns resumed from the KV
    cache give the tokens of turns that re-encode their whole sequence, with and without the CPU levers
    (the lean decode loop), and run fewer positions through the model."""
    from conftest import TOOL_TRACES, tool_prompt, tool_trajectory
    from transformers import AutoModelForCausalLM

    import leangrpo.engines.hf as hf
    from leangrpo.data.tasks.calculator import calculator
    from leangrpo.engines.hf import generate
    from leangrpo.engines.types import Sampling
    from leangrpo.models.load import load_tokenizer

    tok = load_tokenizer(str(tool_model_dir))
    prepare_tokenizer(tok)
    model = AutoModelForCausalLM.from_pretrained(tool_model_dir, dtype=torch.float32)
    turns = []

    class Spy(hf.ResumedTurns):
        def __init__(self, *args):
            super().__init__(*args)
            turns.append(self)

    monkeypatch.setattr(hf, "ResumedTurns", Spy)
    # the questions twice, in another order: rows of one batch differ in length and turn count
    questions = [*TOOL_TRACES, *reversed(TOOL_TRACES)]
    texts = [tool_prompt(tok, q) for q in questions]
    sampling = Sampling(num_generations=1, do_sample=False, max_prompt_length=512, max_completion_length=160)
    out = {
        reuse: generate(
            model,
            tok,
            texts,
            sampling,
            levers=levers,
            toolboxes=[Toolbox([calculator])] * len(texts),
            reuse_cache=reuse,
        )  # fmt: skip
        for reuse in (True, False)
    }
    resumed, encoded = out[True], out[False]
    for name in ("completion_ids", "completion_mask", "model_mask", "truncated"):
        torch.testing.assert_close(getattr(resumed, name), getattr(encoded, name), msg=name)
    for row, question in enumerate(questions):  # and they are the traces the model learnt
        _, completion, mask = tool_trajectory(tok, question)
        assert resumed.completion_ids[row, : len(completion)].tolist() == completion
        assert resumed.model_mask[row, : len(mask)].tolist() == mask
    assert resumed.tool_use.turns == encoded.tool_use.turns == [2, 3, 2, 1, 1, 2, 3, 2]
    assert turns[0].reuse and not turns[1].reuse
    assert turns[0].encoded < 0.7 * turns[1].encoded, (turns[0].encoded, turns[1].encoded)


def test_a_rollout_func_run_is_evaluated_through_its_rollout_func(tmp_path, tiny_model_dir, gsm8k_dir):
    """As in TRL, evaluation generates with the run's rollout_func: it gets the held-out prompts (and the
    trainer), each record holds what it returned, and its extra keys reach the rewards."""
    from leangrpo.train.trainer import Trainer

    calls = []

    def rollout_func(prompts, trainer):
        calls.append((prompts, trainer))
        tok = trainer.tokenizer
        ids = tok("<answer>72</answer><|im_end|>", add_special_tokens=False).input_ids
        return {"prompt_ids": [[10, 11]] * len(prompts), "completion_ids": [ids] * len(prompts),
                "logprobs": [[-1.0] * len(ids)] * len(prompts), "judge_note": "seen"}  # fmt: skip

    cfg = _config(
        tmp_path, tiny_model_dir, gsm8k_dir, eval={"enabled": True, "path": str(gsm8k_dir), "limit": 2}
    )
    trainer = Trainer(cfg, agent=AgentSpec(rollout_func=rollout_func))
    trainer.maybe_evaluate(0)
    (prompts, given), *_ = calls
    assert given is trainer and sorted(p[-1]["content"] for p in prompts) == sorted(
        r["prompt"][-1]["content"] for r in trainer.evaluator.rows
    )  # shortest prompts first
    records = [
        json.loads(line) for line in (tmp_path / "run" / "eval" / "step-0.jsonl").read_text().splitlines()
    ]
    assert len(records) == 2 and all("<answer>72</answer>" in r["completion"] for r in records)
    assert SEEN["judge_note"] == ["seen"] * 2 and "tool_calls" not in records[0]


def test_a_call_nested_1000_deep_is_a_malformed_call(tool_tokenizer):
    """About 500 tokens of `[` (a model can sample them) do not raise RecursionError out of the parse: the
    call is malformed, a failure like any call that does not parse (issue 50, case 17)."""
    tok = tool_tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "q"}], tools=[add], add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )  # fmt: skip
    deep = "[" * 1000 + "]" * 1000
    text = f'<tool_call>\n{{"name": "add", "arguments": {{"a": {deep}}}}}\n</tool_call><|im_end|>'
    turn = tok(text, add_special_tokens=False).input_ids
    out = tool_loop(
        tok, [prompt], [turn], None, [Toolbox([add])], lambda s, n: pytest.fail("resumed"), 4096, None
    )
    assert out.completion_ids == [turn] and out.use.calls[0]["malformed"] == 1


def test_a_tool_raising_systemexit_or_keyboardinterrupt_is_a_failed_call():
    """A tool's SystemExit or KeyboardInterrupt, sync or async, is its error result, not the end of the
    run (issue 50, case 18)."""

    def leave(x: int) -> str:
        """Exits.

        Args:
            x: the exit code
        """
        raise SystemExit(x)

    def interrupt(x: int) -> str:
        """Interrupts.

        Args:
            x: ignored
        """
        raise KeyboardInterrupt

    async def leave_async(x: int) -> str:
        """Exits.

        Args:
            x: the exit code
        """
        raise SystemExit(x)

    box = Toolbox([leave, interrupt, leave_async, add])
    names = ("leave", "interrupt", "leave_async")
    results = run_tool_calls([(box, call(name, x=3)) for name in names] + [(box, call("add", a=1, b=2))])
    assert [(name, failed) for name, _, failed in results] == [(n, True) for n in names] + [("add", False)]
    assert all("error" in text for _, text, _ in results[:3])


def test_the_runs_own_signal_still_stops_it_while_a_tool_runs():
    """A SIGTERM that arrives while a tool runs reaches StopSignals (the run stops after the step), though
    the tool's own KeyboardInterrupt is only its failed result."""
    import os
    import signal

    from leangrpo.run.signals import StopSignals

    def signalled(x: int) -> str:
        """Sends SIGTERM to the run, then interrupts itself.

        Args:
            x: ignored
        """
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        raise KeyboardInterrupt

    with StopSignals() as signals:
        results = run_tool_calls([(Toolbox([signalled]), call("signalled", x=1))])
        time.sleep(0.1)
    assert results[0][0] == "signalled" and results[0][2] and signals.requested


def test_tool_metrics_are_global_over_processes(monkeypatch):
    """With 2 processes, tools/* count every process's rollouts, as TRL's gathered counts do, not rank 0's."""
    from collections import Counter
    from types import SimpleNamespace

    from leangrpo.engines.tools import ToolUse
    from leangrpo.train import metrics

    mine = ToolUse([[], []], [2, 1], [Counter(add=2), Counter()], [Counter(add=1), Counter()])
    other = ToolUse([[], []], [3, 3], [Counter(add=1, look=3), Counter(look=2)], [Counter(), Counter(look=2)])
    monkeypatch.setattr(
        metrics,
        "gather_objects",
        lambda acc, items: [*items, ToolUse([[], []], other.turns, other.calls, other.failures)],
    )
    recorder = metrics.StepRecorder.__new__(metrics.StepRecorder)
    recorder.uses_tools, recorder.acc = True, SimpleNamespace(num_processes=2)
    rollout = SimpleNamespace(batch=SimpleNamespace(tool_use=mine))
    got = recorder._tool_metrics(rollout)  # type: ignore[arg-type]
    assert got == ToolUse.cat([mine, other]).metrics()
    assert got["tools/call_frequency"] == 8 / 4 and got["tools/failure_frequency"] == 3 / 8
    assert got["tools/turns"] == 9 / 4 and got["tools/look/calls"] == 5.0


def test_the_long_prompt_warning_counts_the_tool_schemas(tool_tokenizer):
    """Rollouts render each prompt with its tools' schemas: the warning measures that text, so a short
    question whose tool block passes max_prompt_length is counted."""
    from leangrpo.engines.agents import AgentSpec
    from leangrpo.run.resolve import validate_config
    from leangrpo.train.rollout_source import long_prompts

    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 3?"}]}]
    text = tool_tokenizer.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=False)
    bare = len(tool_tokenizer(text, add_special_tokens=False).input_ids)
    cfg = validate_config(
        {"model": {"name_or_path": "m"}, "data": {"path": "d"}, "grpo": {"max_prompt_length": bare + 8}}, "t"
    )
    assert long_prompts(tool_tokenizer, rows, cfg) is None
    warning = long_prompts(tool_tokenizer, rows, cfg, AgentSpec([add, broken]))
    assert warning is not None and "1 of 1 prompts" in warning


LONG_SYSTEM = "You answer arithmetic questions carefully, checking every step twice. " * 60
QUESTION = "What is 2 + 3?"


def long_tool_prompt() -> list[dict[str, str]]:
    """A prompt far past 512 tokens once its tool schemas and long system prompt are rendered."""
    return [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": QUESTION}]


def test_a_cut_prompt_keeps_its_question_and_generation_header(tool_tokenizer):
    """Past max_prompt_length, the rendered prompt (tools and system prompt included) keeps its last
    user message and the generation header whole and its first and last tokens before them; a question
    that cannot fit, or a plain-text prompt (all question), is refused in one line; no limit: whole."""
    from leangrpo.data.rows import PromptFormat, PromptTooLong

    schemas = AgentSpec([add, broken]).schemas({})
    full = PromptFormat().render(tool_tokenizer, long_tool_prompt(), schemas)
    ids = tool_tokenizer(full, add_special_tokens=False).input_ids
    assert len(ids) > 600 and '"name": "add"' in full
    cut = PromptFormat(max_tokens=128).render(tool_tokenizer, long_tool_prompt(), schemas)
    assert len(tool_tokenizer(cut, add_special_tokens=False).input_ids) <= 128
    tail = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    assert full.endswith(tail) and cut.endswith(tail)
    head = full[: -len(tail)]  # the system prompt and the tools: its first and last tokens stay
    assert cut.startswith(tool_tokenizer.decode(ids[:40])) and cut[: -len(tail)].endswith(head[-30:])
    with pytest.raises(PromptTooLong, match="take .* tokens, over grpo.max_prompt_length=8"):
        PromptFormat(max_tokens=8).render(tool_tokenizer, long_tool_prompt(), schemas)
    with pytest.raises(PromptTooLong):
        PromptFormat(max_tokens=16).render(tool_tokenizer, LONG_SYSTEM + QUESTION)
    assert PromptFormat(max_tokens=len(ids)).render(tool_tokenizer, long_tool_prompt(), schemas) == full


def spy_on_prompts(monkeypatch) -> list[tuple[list[str], int | None]]:
    """What the HF engine tokenizes for each rollout batch (through `encode_rollout_prompts`): its prompt
    texts and its limit."""
    import leangrpo.engines.types as types

    seen: list[tuple[list[str], int | None]] = []
    real = types.encode_prompts

    def spy(tokenizer, texts, limit, repeat):
        seen.append((list(texts), limit))
        return real(tokenizer, texts, limit, repeat)

    monkeypatch.setattr(types, "encode_prompts", spy)
    return seen


def test_a_long_tool_prompt_is_kept_whole_through_the_python_api(tmp_path, tiny_model_dir, monkeypatch):
    """TRL has no max_prompt_length: through GRPOTrainer, a prompt of 600+ tokens with its tool schemas
    reaches generation whole (it kept only its first or last 512 tokens before)."""
    from transformers import AutoTokenizer

    from leangrpo import GRPOConfig, GRPOTrainer
    from leangrpo.data.rows import PromptFormat

    seen = spy_on_prompts(monkeypatch)
    args = GRPOConfig(
        output_dir=str(tmp_path / "api"), num_generations=2, max_completion_length=4, max_steps=1,
        per_device_train_batch_size=2, report_to="none", max_tool_calling_iterations=1,
    )  # fmt: skip
    rows = [{"prompt": long_tool_prompt()}]
    trainer = GRPOTrainer(
        str(tiny_model_dir), lambda completions, **_: [0.0] * len(completions), args, rows, tools=[add]
    )
    trainer.train()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prepare_tokenizer(tok)
    full = PromptFormat().render(tok, long_tool_prompt(), AgentSpec([add]).schemas({}))
    texts, limit = seen[0]
    assert limit is None and texts == [full] and len(tok(full, add_special_tokens=False).input_ids) > 600


def test_a_yaml_limit_cuts_long_tool_prompts_and_says_how_much(tmp_path, tiny_model_dir, monkeypatch):
    """A leangrpo YAML's grpo.max_prompt_length: the start-up warning counts the prompts and tokens cut,
    measured with the tool schemas, and the rollouts see the cut prompt ending in the question and the
    generation header; a limit below the question is refused in one line."""
    from leangrpo.run.resolve import validate_config
    from leangrpo.train.trainer import Trainer

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": long_tool_prompt()}) + "\n")
    seen = spy_on_prompts(monkeypatch)

    def config(limit: int, out: str):
        return validate_config({
            "model": {"name_or_path": str(tiny_model_dir)}, "data": {"path": str(data)},
            "rewards": {"functions": [{"name": "int"}]}, "tools": {"functions": ["test_tools:add"]},
            "grpo": {"num_generations": 2, "max_completion_length": 4, "max_prompt_length": limit,
                     "max_tool_calling_iterations": 1},
            "optim": {"max_steps": 1, "per_device_train_batch_size": 2}, "output_dir": str(tmp_path / out),
        })  # fmt: skip

    written: list[str] = []
    monkeypatch.setattr(Trainer, "_write", lambda self, text: written.append(text))
    Trainer(config(128, "cut")).train()
    (warning,) = [w for w in written if "longer than grpo.max_prompt_length" in w]
    assert "1 of 1 prompts are longer than grpo.max_prompt_length=128 tokens" in warning
    cut = int(warning.split("); ")[1].split(" tokens cut")[0])
    assert cut > 450  # 600+ tokens down to at most 128
    (text,), limit = seen[0]
    assert limit == 128 and text.endswith(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    from leangrpo.data.rows import PromptTooLong

    with pytest.raises(PromptTooLong, match="over grpo.max_prompt_length=8"):
        Trainer(config(8, "refused"))
