"""Tests for leangrpo.data.rewards: built-in rewards, registry, and safe batch scoring."""

import math
import random
import re
import subprocess
import sys
import threading
import time

import pytest
import torch

from leangrpo.core.grpo import group_advantages
from leangrpo.data.rewards import (
    BUILTIN_REWARDS,
    RewardError,
    answers_match,
    correctness_reward,
    extract_xml_answer,
    int_reward,
    load_reward,
    math_verify_reward,
    score_completions,
    soft_format_reward,
    strict_format_reward,
    xmlcount_reward,
)
from leangrpo.data.rewards.builtin import has_soft_format, has_strict_format

WELL = "<reasoning>\nSix dozen is 6 * 12.\n</reasoning>\n<answer>\n72\n</answer>\n"
FORMAT_REWARDS = {
    "xmlcount": xmlcount_reward,
    "soft": soft_format_reward,
    "strict": strict_format_reward,
    "int": int_reward,
    "correctness": correctness_reward,
}
# Expected scores against gold "72", computed by hand from the recipe's rules:
# (text, xmlcount, soft, strict, int, correctness).
CASES = {
    "well_formatted": (WELL, 0.5, 0.5, 0.5, 0.5, 2.0),
    # No "\n</answer>\n", so the recipe subtracts the whole length (67 characters), while the
    # bare "\n</answer>" at the very end earns +0.001: 0.5 - 0.067 + 0.001.
    "no_final_newline": (WELL[:-1], 0.434, 0.5, 0.5, 0.5, 2.0),
    "multiline": (
        "<reasoning>\nStep 1: 6 * 12.\nStep 2: check.\n</reasoning>\n<answer>\n72\n\n</answer>\n",
        0.5,
        0.5,
        0.5,
        0.5,
        2.0,
    ),
    "multiline_answer_text": (
        "<reasoning>\na\nb\n</reasoning>\n<answer>\nTotal:\n72\n</answer>\n",
        0.5,
        0.5,
        0.5,
        0.0,
        0.0,
    ),
    "empty": ("", 0.0, 0.0, 0.0, 0.0, 0.0),
    # Each "</answer>" split leaves 10 trailing characters: 0.5 - 0.010 - 0.010.
    "trailing_text": (WELL + "0123456789", 0.48, 0.5, 0.0, 0.5, 2.0),
    # 38 characters, no closing tag: 3 * 0.125 - 0.038; the unclosed answer is not credited.
    "unclosed_answer": ("<reasoning>\nr\n</reasoning>\n<answer>\n72", 0.337, 0.0, 0.0, 0.0, 0.0),
    # No "\n" before "<answer>"; 28 characters follow "\n</answer>": 0.375 - 0.027.
    "wrong_order": (
        "<answer>\n72\n</answer>\n<reasoning>\nr\n</reasoning>\n",
        0.348,
        0.0,
        0.0,
        0.5,
        2.0,
    ),
    # Every tag twice: no xmlcount credit; DOTALL lets the format regexes span the copies.
    "duplicated": (WELL + WELL, 0.0, 0.5, 0.5, 0.5, 2.0),
    # str.count does not overlap matches, so "\n</reasoning>\n</reasoning>\n" holds one
    # "\n</reasoning>\n" and "\n</reasoning>\n<answer>\n<answer>\n" one "\n<answer>\n": 0.25.
    "nested": (
        "<reasoning>\n<reasoning>\nx\n</reasoning>\n</reasoning>\n"
        "<answer>\n<answer>\n7\n</answer>\n</answer>\n",
        0.25,
        0.5,
        0.5,
        0.5,
        0.0,
    ),
    "answer_only": ("The answer is 72.", 0.0, 0.0, 0.0, 0.0, 0.0),
    # str.isdigit accepts Arabic-Indic digits (recipe behaviour); they are not the string "72".
    "unicode": ("<reasoning>\n数学 🙂\n</reasoning>\n<answer>\n٧٢\n</answer>\n", 0.5, 0.5, 0.5, 0.5, 0.0),
}


def as_chat(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def score(func, texts: list, answers: list[str] | None = None) -> list[float]:
    answers = answers or ["72"] * len(texts)
    return func(prompts=["q"] * len(texts), completions=texts, answer=answers, extra=[0] * len(texts))


@pytest.mark.parametrize("chat", [False, True], ids=["str", "chat"])
@pytest.mark.parametrize("case", CASES)
def test_format_rewards_match_hand_computed_scores(case: str, chat: bool) -> None:
    text, *expected = CASES[case]
    completion = as_chat(text) if chat else text
    got = [score(func, [completion])[0] for func in FORMAT_REWARDS.values()]
    assert got == pytest.approx(expected), dict(zip(FORMAT_REWARDS, got, strict=True))


def test_recipe_regexes_missed_multiline_reasoning_ours_do_not() -> None:
    text = CASES["multiline"][0]
    recipe_strict = r"^<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n$"
    assert re.match(recipe_strict, text) is None
    assert has_strict_format(text) and has_soft_format(text)


def recipe_count_xml(text: str) -> float:
    """count_xml from willccbb's grpo_demo.py, verbatim."""
    count = 0.0
    if text.count("<reasoning>\n") == 1:
        count += 0.125
    if text.count("\n</reasoning>\n") == 1:
        count += 0.125
    if text.count("\n<answer>\n") == 1:
        count += 0.125
        count -= len(text.split("\n</answer>\n")[-1]) * 0.001
    if text.count("\n</answer>") == 1:
        count += 0.125
        count -= (len(text.split("\n</answer>")[-1]) - 1) * 0.001
    return count


def test_rewards_equal_reference_implementations_on_random_tag_soup() -> None:
    strict = re.compile(r"<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n?", re.DOTALL)
    soft = re.compile(r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>", re.DOTALL)
    parts = ["<reasoning>", "</reasoning>", "<answer>", "</answer>", "\n", " ", "x"]
    rng = random.Random(0)
    texts = [WELL, WELL + "x", "x" + WELL] + [
        "".join(rng.choices(parts, k=rng.randint(0, 12))) for _ in range(5000)
    ]
    texts += ["<reasoning>\n" + t + "\n</answer>" for t in texts[:2000]]
    for text in texts:
        assert has_strict_format(text) == bool(strict.fullmatch(text)), repr(text)
        assert has_soft_format(text) == bool(soft.search(text)), repr(text)
    assert xmlcount_reward([], texts) == [recipe_count_xml(text) for text in texts]


@pytest.mark.parametrize(
    "text",
    [
        "<reasoning>\n" + "x" * 1_000_000 + "\n</reasoning>\n<answer>\n72\n</answer>\n",
        "<reasoning>" * 100_000,
        "<reasoning>\n" + "\n</reasoning>\n<answer>\n" * 50_000 + "junk",
        "</reasoning> <answer>" * 50_000,
        "<answer>" * 125_000,
        "7" * 1_000_000,
    ],
    ids=["well_formatted", "reasoning_tags", "middles", "soft_middles", "answer_tags", "digits"],
)
def test_huge_adversarial_completions_are_fast(text: str) -> None:
    start = time.perf_counter()
    for func in [*FORMAT_REWARDS.values(), math_verify_reward]:
        score(func, [text])
    assert time.perf_counter() - start < 3.0


def test_huge_well_formatted_completion_gets_full_marks() -> None:
    text = "<reasoning>\n" + "x" * 1_000_000 + "\n</reasoning>\n<answer>\n72\n</answer>\n"
    got = [score(func, [text])[0] for func in FORMAT_REWARDS.values()]
    assert got == [0.5, 0.5, 0.5, 0.5, 2.0]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer> 72 </answer>", "72"),
        ("<answer>1</answer> then <answer>\n2\n</answer>", "2"),
        ("<answer>1</answer> then <answer>2", ""),
        ("no tags, 72", ""),
        ("</answer>72<answer>", ""),
    ],
)
def test_extract_xml_answer(text: str, expected: str) -> None:
    assert extract_xml_answer(text) == expected


@pytest.mark.parametrize(
    ("predicted", "gold", "expected"),
    [
        ("1,000", "1000", True),
        ("1000", "1,000", True),
        ("0.5", "1/2", True),
        ("1/2", "0.5", True),
        ("$18", "18", True),
        ("$\\frac{1}{2}$", "0.5", True),
        ("71", "72", False),
        ("-72", "72", False),
        ("", "72", False),
        ("no number here", "72", False),
    ],
)
def test_answers_match(predicted: str, gold: str, expected: bool) -> None:
    assert answers_match(predicted, gold) is expected


def test_math_verify_reward_uses_answer_tag_else_whole_completion() -> None:
    completions = [
        "<reasoning>\nr\n</reasoning>\n<answer>\n1,000\n</answer>\n",
        as_chat("<answer>0.5</answer>"),
        "So the total is $18.",
        "<reasoning>\n18 is tempting\n</reasoning>\n<answer>\n17\n</answer>\n",
        "<answer>\n18",
    ]
    answers = ["1000", "1/2", "18", "18", "18"]
    assert score(math_verify_reward, completions, answers) == [2.0, 2.0, 2.0, 0.0, 0.0]


@pytest.mark.parametrize("name", sorted(BUILTIN_REWARDS))
def test_load_reward_builtin_names(name: str) -> None:
    assert load_reward(name) is BUILTIN_REWARDS[name]
    assert load_reward(f"{name}_reward") is BUILTIN_REWARDS[name]


def test_load_reward_from_import_path(tmp_path, monkeypatch) -> None:
    (tmp_path / "leangrpo_test_user_rewards.py").write_text(
        "def shout(prompts, completions, **kwargs):\n"
        "    return [float(c.isupper()) for c in completions]\n"
        "NOT_A_FUNCTION = 3\n"
    )
    (tmp_path / "leangrpo_test_broken.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    shout = load_reward("leangrpo_test_user_rewards:shout")
    assert shout(prompts=["p", "p"], completions=["HI", "hi"]) == [1.0, 0.0]

    bad_paths = {
        "no_such_reward": "unknown reward 'no_such_reward'; known rewards are correctness, int,",
        "leangrpo_no_such_module:f": "cannot import module 'leangrpo_no_such_module' for reward "
        "'leangrpo_no_such_module:f': ModuleNotFoundError",
        "leangrpo_test_broken:f": "RuntimeError: boom at import",
        "leangrpo_test_user_rewards:missing": "module 'leangrpo_test_user_rewards' has no "
        "attribute 'missing'",
        "leangrpo_test_user_rewards:NOT_A_FUNCTION": "is not callable (it is a int)",
        "a:b:c": "invalid reward import path 'a:b:c'",
        ":f": "invalid reward import path ':f'",
    }
    for path, expected in bad_paths.items():
        with pytest.raises(RewardError) as info:
            load_reward(path)
        assert expected in str(info.value)
        assert "\n" not in str(info.value)


def constant(value):
    def reward(prompts, completions, **kwargs):
        return [value] * len(completions)

    return reward


def fails_on_boom(prompts, completions, **kwargs):
    if any("boom" in c for c in completions):
        raise ValueError("bad value\nsecond line")
    return [1.0] * len(completions)


def test_score_completions_weights_and_none() -> None:
    def some_none(prompts, completions, **kwargs):
        return [None, 3.0, None]

    funcs = [("one", constant(1.0), 2.0), ("some_none", some_none, 0.5), ("all_none", constant(None), 1.0)]
    scores = score_completions(funcs, ["p"] * 3, ["a", "b", "c"], {}, on_error="raise")

    assert scores.names == ["one", "some_none", "all_none"]
    assert scores.per_func.dtype == torch.float32 and scores.per_func.shape == (3, 3)
    assert torch.equal(scores.per_func[:, 0], torch.ones(3))
    assert scores.per_func[:, 2].isnan().all() and scores.per_func[0, 1].isnan()
    assert scores.total.tolist() == [2.0, 3.5, 2.0]
    assert not scores.failed.any()


def test_completion_every_function_declined_is_unscorable_as_in_trl() -> None:
    """Every function returning None makes the total NaN (not 0): left out of the group's mean and std,
    advantage 0. TRL 1.16 gives [0.577, 0, -1.155, 0.577] for G = 4 and rewards [1, None, 0, 1]."""

    def values(*scores):
        return lambda prompts, completions, **kwargs: list(scores)

    funcs = [("a", values(1.0, None, None, 1.0), 1.0), ("b", values(None, None, 0.0, None), 1.0)]
    scores = score_completions(funcs, ["p"] * 4, ["w", "x", "y", "z"], {}, on_error="raise")
    assert scores.total[[0, 2, 3]].tolist() == [1.0, 0.0, 1.0] and scores.total[1].isnan()
    assert not scores.failed.any()
    advantages, _ = group_advantages(scores.total, num_generations=4)
    assert advantages.tolist() == pytest.approx([0.57725, 0.0, -1.15450, 0.57725], abs=1e-4)


def test_score_completions_builtins_on_chat_completions() -> None:
    funcs = [(name, func, 1.0) for name, func in BUILTIN_REWARDS.items()]
    prompts = [[{"role": "user", "content": "6 dozen?"}]] * 2
    completions = [as_chat(WELL), as_chat("72")]
    scores = score_completions(funcs, prompts, completions, {"answer": ["72", "72"]}, "raise")
    # Four format rewards at 0.5 plus two correctness rewards at 2.0; a bare "72" only passes
    # math_verify, which falls back to the whole completion.
    assert scores.total.tolist() == pytest.approx([6.0, 2.0])


def test_trl_style_user_reward_works_unchanged() -> None:
    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion[0]["content"])) for completion in completions]

    completions = [as_chat("x" * 20), as_chat("x" * 25)]
    scores = score_completions([("len", reward_len, 1.0)], ["p", "p"], completions, {}, "raise")
    assert scores.total.tolist() == [0.0, -5.0]


def test_raising_reward_with_on_error_raise_names_function_and_completion() -> None:
    completions = ["fine", "x boom\ny"]
    with pytest.raises(RewardError) as info:
        score_completions([("boomer", fails_on_boom, 1.0)], ["p", "p"], completions, {}, "raise")
    assert str(info.value) == (
        "reward function 'boomer' raised ValueError: bad value\\nsecond line on completion #1: 'x boom\\ny'"
    )
    assert isinstance(info.value.__cause__, ValueError)


def test_raising_reward_with_on_error_missing_fails_only_that_completion() -> None:
    funcs = [("boomer", fails_on_boom, 1.0), ("two", constant(2.0), 1.0)]
    scores = score_completions(funcs, ["p"] * 3, ["ok", "boom", "ok"], {}, on_error="missing")
    assert scores.failed.tolist() == [False, True, False]
    assert scores.total[0] == 3.0 and scores.total[2] == 3.0 and scores.total[1].isnan()
    assert scores.per_func[1, 0].isnan() and scores.per_func[1, 1] == 2.0


def test_long_completion_is_abridged_in_error() -> None:
    with pytest.raises(RewardError) as info:
        score_completions([("b", fails_on_boom, 1.0)], ["p"], ["boom" + "z" * 500], {}, "raise")
    assert str(info.value).endswith(": 'boom" + "z" * 196 + "'")


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ([1.0, 1.0, 1.0], "reward function 'bad' returned 3 values for 4 completions"),
        (
            [1.0, 1.0, "abc", 1.0],
            "reward function 'bad' returned a non-number 'abc' on completion #2: 'c2'",
        ),
        ([math.nan, 1.0, 1.0, 1.0], "reward function 'bad' returned nan on completion #0: 'c0'"),
        ([1.0, -math.inf, 1.0, 1.0], "reward function 'bad' returned -inf on completion #1: 'c1'"),
        (1.0, "reward function 'bad' returned a float, not a list"),
    ],
)
def test_garbage_output_raises(output, message: str) -> None:
    def bad(prompts, completions, **kwargs):
        return output

    completions = [f"c{i}" for i in range(4)]
    with pytest.raises(RewardError) as info:
        score_completions([("bad", bad, 1.0)], ["p"] * 4, completions, {}, "raise")
    assert str(info.value) == message


def test_garbage_output_with_on_error_missing_fails_only_bad_completions() -> None:
    def nan_on_odd(prompts, completions, **kwargs):
        return [math.nan if c.endswith(("1", "3")) else 1.0 for c in completions]

    def wrong_length(prompts, completions, **kwargs):
        return [1.0, 1.0]

    completions = [f"c{i}" for i in range(4)]
    scores = score_completions([("nan", nan_on_odd, 1.0)], ["p"] * 4, completions, {}, "missing")
    assert scores.failed.tolist() == [False, True, False, True]
    assert scores.total[0] == 1.0
    scores = score_completions([("len", wrong_length, 1.0)], ["p"] * 4, completions, {}, "missing")
    assert scores.failed.all() and scores.total.isnan().all()


def test_reward_failing_only_on_whole_batch() -> None:
    def batch_only(prompts, completions, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("cannot batch")
        return [1.0]

    args = (["p", "p"], ["a", "b"], {})
    with pytest.raises(RewardError, match=r"^reward function 'b' raised RuntimeError: cannot batch$"):
        score_completions([("b", batch_only, 1.0)], *args, on_error="raise")
    scores = score_completions([("b", batch_only, 1.0)], *args, on_error="missing")
    assert scores.total.tolist() == [1.0, 1.0] and not scores.failed.any()


def test_columns_are_sliced_per_completion_and_lengths_checked() -> None:
    def echo(prompts, completions, answer, **kwargs):
        if "boom" in completions:
            raise ValueError("boom")
        return [float(a) for a in answer]

    scores = score_completions(
        [("echo", echo, 1.0)], ["p"] * 3, ["a", "boom", "c"], {"answer": ["1", "2", "3"]}, "missing"
    )
    assert scores.per_func[:, 0].tolist()[::2] == [1.0, 3.0]
    with pytest.raises(RewardError, match="one entry per completion"):
        score_completions([("echo", echo, 1.0)], ["p"], ["a", "b"], {}, "raise")


def test_answers_match_works_off_the_main_thread() -> None:
    results = []
    thread = threading.Thread(target=lambda: results.append(answers_match("1,000", "1000")))
    thread.start()
    thread.join()
    assert results == [True]


def test_import_does_not_pull_in_torch_or_sympy() -> None:
    code = "import sys, leangrpo.data.rewards; print('torch' in sys.modules, 'sympy' in sys.modules)"
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert output.stdout.split() == ["False", "False"]


def test_builtin_soft_overlong_punishment_equals_trls():
    """DAPO's overlong shaping, built in (no TRL needed), gives TRL's values at every length."""
    from trl.rewards import get_soft_overlong_punishment

    ours = load_reward("soft_overlong_punishment", kwargs={"max_completion_len": 20, "soft_punish_cache": 8})
    theirs = get_soft_overlong_punishment(max_completion_len=20, soft_punish_cache=8)
    ids = [[7] * n for n in range(25)]
    assert ours(prompts=[""] * 25, completions=[""] * 25, completion_ids=ids) == theirs(completion_ids=ids)
    assert ours(prompts=[""], completions=[""], completion_ids=[[7] * 16]) == [-0.5]
    for kwargs, problem in [
        (None, "needs kwargs"),
        ({"max_completion_len": 4, "soft_punish_cache": 9}, "<="),
    ]:
        with pytest.raises(RewardError, match=problem):
            load_reward("soft_overlong_punishment", kwargs=kwargs)


def test_math_verify_keeps_its_timeouts_when_scored():
    """Rewards run in abandonable worker threads, where math-verify's signal-alarm timeouts cannot act; a
    power tower would then keep a worker (and the step) busy until rewards.timeout_s. math_verify_reward
    runs on the main thread instead, so its own timeouts bound it."""
    from leangrpo.data.rewards import math_verify_reward, score_completions

    start = time.monotonic()
    scores = score_completions(
        [("math_verify", math_verify_reward, 1.0)],
        ["q"],
        ["<answer>\n9^9^9^9\n</answer>"],
        {"answer": ["5"]},
        "missing",
        timeout_s=20,
    )
    assert scores.per_func.tolist() == [[0.0]] and not scores.failed.any()
    assert time.monotonic() - start < 15
