"""Run by torch.multiprocessing in test_trl: `Scorer.advantages` on one of two gloo processes."""

from __future__ import annotations

import os

import torch

AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def advantages_on_rank(rank: int, port: int, rewards: torch.Tensor, out: str) -> None:
    """This rank's half of `rewards` [2N, 2] (one column per reward function) through Scorer.advantages
    with scale_rewards=batch, for each multi_objective_aggregation; saves {aggregation: (advantages,
    group stds)} to out/rank<R>.pt."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"
    )
    from accelerate import Accelerator

    from leangrpo.data.rewards import RewardScores
    from leangrpo.run.resolve import validate_config
    from leangrpo.train.scoring import Scorer

    n = len(rewards) // 2
    per_func = rewards[rank * n : (rank + 1) * n]
    total = torch.where(per_func.isnan().all(1), torch.nan, per_func.nansum(1))
    scores = RewardScores(per_func, total, torch.zeros(n, dtype=torch.bool), ["int", "correctness"])
    acc, results = Accelerator(cpu=True), {}
    for aggregation in AGGREGATIONS:
        cfg = validate_config({
            "model": {"name_or_path": "m"},
            "data": {"path": "d.jsonl"},
            "rewards": {"functions": [{"name": "int"}, {"name": "correctness"}],
                        "multi_objective_aggregation": aggregation},
            "grpo": {"num_generations": 4, "scale_rewards": "batch"},
        })  # fmt: skip
        scorer = Scorer(cfg, acc, [(None, None, 1.0)] * 2, conversational=False, num_rows=1)
        results[aggregation] = scorer.advantages(scores)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()  # gloo threads left at exit can abort the process
