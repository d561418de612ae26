"""The differential suite (issue 49, item 7): the corpus of TRL usage in `corpus.py` runs under TRL 1.16 (one
subprocess for every case) and under leangrpo (in this process) on the tiny model, and each case's records are
compared key by key. Every difference is declared: DELIBERATE holds those docs/trl.md (or the docs it points
to) gives as deliberate, UNDECLARED the real ones no doc declares yet (each also an xfail test naming it), so
that any new difference fails the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import corpus
import pytest

HERE = Path(__file__).resolve().parent
DOCS = HERE.parent.parent / "docs"


@dataclass(frozen=True)
class Difference:
    """A declared difference: `expect` maps TRL's value to leangrpo's; `reason` quotes the docs saying it."""

    reason: str
    expect: Callable[[Any], Any]


def keys(minus: tuple[str, ...] = (), plus: tuple[str, ...] = ()) -> Callable[[Any], Any]:
    """TRL's key list less `minus` (a trailing `*` takes a prefix), with `plus`."""

    def kept(key: str) -> bool:
        return not any(key.startswith(m[:-1]) if m.endswith("*") else key == m for m in minus)

    return lambda theirs: sorted({k for k in theirs if kept(k)} | set(plus))


def per_generation(theirs: Any) -> Any:
    """TRL's per-optimizer-step value at the even optimizer steps only: leangrpo's step is one generation and
    its `num_iterations` (2) optimizer steps (events as (name, global_step), steps, a {step: value} dict)."""
    if isinstance(theirs, dict):
        return {k: v for k, v in theirs.items() if int(k) % 2 == 0}
    return [x for x in theirs if (x[1] if isinstance(x, list) else x) % 2 == 0]


OURS_ONLY = (
    "peak_memory_mb", "reward_failures", "skipped_steps", "step_seconds", "time/advantages", "time/reference",
    "time/rollout", "time/score", "time/update", "tokens_per_s",
)  # fmt: skip
METRICS = Difference("Metrics TRL does not have keep leangrpo's names", keys(plus=OURS_ONLY))
TOOL_METRICS = Difference("`tools/turns` (model turns per rollout)", keys(plus=(*OURS_ONLY, "tools/turns")))
ARGS_BIN, ARGS_JSON = ("training_args.bin",), ("training_args.json",)  # TRL's pickle, leangrpo's JSON
SHA = Difference(
    "`leangrpo_sha256.json` listing its files' hashes, and `training_args.json` for `training_args.bin`",
    keys(ARGS_BIN, (*ARGS_JSON, "leangrpo_sha256.json")),
)
STEPS = Difference("one metrics row per step (the mean over its iterations)", per_generation)
DELIBERATE: dict[str, dict[str, Difference]] = {
    case: {
        "metric_keys": TOOL_METRICS if case in ("tools", "tool_call", "environment") else METRICS,
        "saved": SHA,
    }
    for case in corpus.CASES
}
MERGED = ("chat_template.jinja", "config.json", "generation_config.json", "leangrpo_sha256.json")
MERGED += ("model.safetensors", "tokenizer.json", "tokenizer_config.json")
MERGED_KEYS = keys(ARGS_BIN, (*ARGS_JSON, *(f"merged/{name}" for name in MERGED)))  # and SHA's training_args
DELIBERATE["peft"]["saved"] = DELIBERATE["grpo_script"]["saved"] = Difference(
    "and the merged model in `dir/merged/`", MERGED_KEYS
)
DELIBERATE["evaluation"]["eval_keys"] = Difference(
    "`eval_loss` (the GRPO loss on the eval completions), `eval_entropy`, `eval_clip_ratio/*`, "
    "`eval_num_tokens`",
    keys(minus=("eval_loss", "eval_entropy", "eval_clip_ratio/*", "eval_num_tokens")),
)
DELIBERATE["accumulation"].update(events=STEPS, steps=STEPS, learning_rates=STEPS)

UNDECLARED: dict[str, dict[str, Difference]] = {case: {} for case in corpus.CASES}


def _expected(case: str, key: str, theirs: Any, tables: tuple[dict[str, dict[str, Difference]], ...]) -> Any:
    """TRL's value of `key` in `case` through the differences `tables` declare: what leangrpo must record."""
    for table in tables:
        if difference := table.get(case, {}).get(key):
            theirs = difference.expect(theirs)
    return theirs


@pytest.fixture(scope="module")
def records(tiny_model_dir, tmp_path_factory) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every case's records under TRL (one subprocess, running while leangrpo's run here)."""
    pytest.importorskip("trl")
    import leangrpo

    out = tmp_path_factory.mktemp("parity")
    paths = [str(HERE.parent.parent / "src"), str(HERE.parent), str(HERE)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    command = [sys.executable, str(HERE / "corpus.py"), "trl", str(tiny_model_dir), str(out / "trl")]
    with subprocess.Popen([*command, *corpus.CASES], env=env, stderr=subprocess.PIPE, text=True) as trl:
        ours = corpus.run(leangrpo, str(tiny_model_dir), out / "lean", list(corpus.CASES))  # meanwhile
        _, stderr = trl.communicate(timeout=600)
    assert trl.returncode == 0, stderr[-3000:]
    return json.loads((out / "trl" / "records.json").read_text()), ours


@pytest.mark.slow
@pytest.mark.parametrize("case", list(corpus.CASES))
def test_every_difference_from_trl_is_declared(records, case):
    """Each recorded value is TRL's, or TRL's through the declared differences; each declared one differs."""
    theirs, ours = records[0][case], records[1][case]
    assert "error" not in theirs and "error" not in ours, (theirs, ours)
    assert set(theirs) == set(ours)
    tables = (DELIBERATE, UNDECLARED)
    mismatched = {k: (theirs[k], ours[k]) for k in theirs if _expected(case, k, theirs[k], tables) != ours[k]}
    assert not mismatched
    declared = {k for table in tables for k in table.get(case, {})}
    assert not {k for k in declared if theirs[k] == ours[k]}, "a declared difference is gone: remove it"


UNDECLARED_CASES = [(case, key) for case, table in UNDECLARED.items() for key in table]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "key"),
    [
        pytest.param(c, k, marks=pytest.mark.xfail(reason=UNDECLARED[c][k].reason, strict=True))
        for c, k in UNDECLARED_CASES
    ],
)
def test_undeclared_differences(records, case, key):
    """A real difference from TRL that no doc declares: xfail until fixed or declared in docs/trl.md."""
    theirs, ours = records[0][case][key], records[1][case][key]
    assert _expected(case, key, theirs, (DELIBERATE,)) == ours


def test_each_deliberate_difference_is_in_the_docs():
    """Each deliberate difference quotes the docs that declare it, so the suite and docs/trl.md agree."""
    docs = " ".join(p.read_text() for p in DOCS.glob("*.md")).replace("\n", " ")
    for table in DELIBERATE.values():
        for difference in table.values():
            assert difference.reason in docs, difference.reason


def test_a_new_difference_fails_the_comparison():
    """The comparison itself: a declared difference is absorbed, an extra key or a changed value is not."""
    theirs = ["loss", "reward"]
    assert _expected("docstring", "metric_keys", theirs, (DELIBERATE,)) == sorted([*theirs, *OURS_ONLY])
    assert _expected("docstring", "metric_keys", theirs, (DELIBERATE,)) != sorted([*theirs, *OURS_ONLY, "x"])
    assert _expected("docstring", "max_completion_length", 4, (DELIBERATE, UNDECLARED)) == 4
    events = [["on_step_end", 1], ["on_step_end", 2]]
    assert _expected("accumulation", "events", events, (DELIBERATE,)) == [["on_step_end", 2]]
    assert per_generation({"1": 1e-4, "2": 5e-5}) == {"2": 5e-5}
