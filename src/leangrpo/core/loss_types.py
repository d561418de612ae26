"""TRL's loss_type names, the one list of them: each names an objective (the per-token term, a key of
`grpo.OBJECTIVES`) and an aggregation (how a micro-batch's per-token terms become its share of the batch
loss, a key of `grpo.AGGREGATIONS`) at once. Kept apart from grpo.py's tensor math and free of torch, so
that the config (config/schema.py) validates and documents `grpo.loss_type` against it without loading
torch."""

from __future__ import annotations

LOSS_TYPES: dict[str, tuple[str, str]] = {
    "grpo": ("clip", "grpo"),
    "bnpo": ("clip", "bnpo"),
    "dr_grpo": ("clip", "dr_grpo"),
    "dapo": ("clip", "dapo"),
    "cispo": ("cispo", "dapo"),
    "sapo": ("sapo", "grpo"),
    "luspo": ("clip", "luspo"),
    "vespo": ("vespo", "dapo"),
}


def unclipped_loss_types() -> list[str]:
    """The loss types whose objective is not the clipped surrogate (no ratio clip for `delta` to cap)."""
    return [name for name, (objective, _) in LOSS_TYPES.items() if objective != "clip"]
