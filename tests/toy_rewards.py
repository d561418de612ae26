"""A toy reward that a tiny random model can learn in a few steps (imported by path in the e2e tests)."""


def vowel_share(prompts, completions, **kwargs):
    """Share of the completion's letters that are vowels: smooth, so every group has signal."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    out = []
    for t in texts:
        letters = [ch for ch in t.lower() if ch.isalpha()]
        out.append(sum(ch in "aeiou" for ch in letters) / max(len(letters), 1))
    return out


def space_share(prompts, completions, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch == " " for ch in t) / max(len(t), 1) for t in texts]
