"""A toy reward that a tiny random model can learn in a few steps (imported by path in the e2e tests)."""


def vowel_share(prompts, completions, **kwargs):
    """Share of the completion's letters that are vowels: smooth, so every group has signal."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    out = []
    for t in texts:
        letters = [ch for ch in t.lower() if ch.isalpha()]
        out.append(sum(ch in "aeiou" for ch in letters) / max(len(letters), 1))
    return out


def vowel_share_some_questions(prompts, completions, question, **kwargs):
    """vowel_share for questions whose length is a multiple of 3, else 0 (those groups carry no signal)."""
    shares = vowel_share(prompts, completions)
    return [share if len(q) % 3 == 0 else 0.0 for share, q in zip(shares, question, strict=True)]


def length_share(prompts, completions, **kwargs):
    """The completion's length in characters over 40: a second reward with its own scale."""
    return [len(c[0]["content"] if isinstance(c, list) else c) / 40 for c in completions]


def record_prompts(prompts, completions, **kwargs):
    """Scores nothing; appends each question it is shown to prompts-rank<R>.txt in $LEANGRPO_TEST_OUT."""
    import os
    from pathlib import Path

    out = Path(os.environ["LEANGRPO_TEST_OUT"]) / f"prompts-rank{os.environ.get('RANK', '0')}.txt"
    with out.open("a") as f:
        f.writelines(q + "\n" for q in kwargs["question"])
    return [0.0] * len(completions)


def flaky(prompts, completions, **kwargs):
    """Misbehaves on purpose: the wrong length for a batch; for one completion, by its length:
    NaN, None (not applicable: fine), a string, inf, or a number."""
    if len(completions) > 1:
        return [0.0] * (len(completions) + 1)
    text = completions[0][0]["content"] if isinstance(completions[0], list) else completions[0]
    return [[float("nan"), None, "oops", float("inf"), 1.0][len(text) % 5]]


async def async_vowel_share(prompts, completions, log_metric, trainer_state, completion_ids, **kwargs):
    """vowel_share, awaited; logs the step and the mean completion length it saw (TRL's log_metric)."""
    import asyncio

    await asyncio.sleep(0)
    log_metric("toy/global_step", trainer_state.global_step)
    log_metric("toy/tokens", sum(map(len, completion_ids)) / len(completion_ids))
    return vowel_share(prompts, completions)


def distinct_chars(completions, **kwargs):
    """TRL's quickstart reward, verbatim: it needs completions as strings (TRL's standard format)."""
    return [float(len(set(completion.lower()))) for completion in completions]
