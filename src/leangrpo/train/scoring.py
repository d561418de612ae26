"""Rewards and advantages: each reward function on each completion, called as TRL calls it (its inputs
built by `data.rewards.reward_inputs`, as evaluation builds them), and the advantages GRPO takes from
them, over every process's groups."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from leangrpo.core import grpo
from leangrpo.data.rewards import RewardContext, RewardScores, TrainerState, reward_inputs, score_completions

if TYPE_CHECKING:
    from accelerate import Accelerator

    from leangrpo.config.schema import Config
    from leangrpo.train.rollouts import Rollout

RewardFuncs = list[tuple[str, Callable[..., list[Any]], float]]


class Scorer:
    """Scores a step's completions and turns the scores into advantages, over every process's groups."""

    def __init__(
        self, cfg: Config, acc: Accelerator, reward_funcs: RewardFuncs, conversational: bool, num_rows: int
    ):
        self.cfg, self.acc, self.reward_funcs = cfg, acc, reward_funcs
        self.conversational, self.num_rows = conversational, num_rows
        self.shuffle_generator = torch.Generator().manual_seed(cfg.seed)  # grpo.shuffle_rewards only

    def score(self, step: int, rollout: Rollout, stop: Callable[[], bool]) -> RewardScores:
        """Every reward function on every completion, called as TRL calls it (prompts, completions,
        completion_ids, the row's columns, trainer_state, log_extra, log_metric); `stop` abandons rewards
        still running when a stop is asked for."""
        cfg, batch = self.cfg, rollout.batch
        use = batch.tool_use
        prompts, completions, columns = reward_inputs(
            rollout.rows, batch.completion_texts, self.conversational,
            None if use is None else use.messages, None if use is None else use.columns,
        )  # fmt: skip
        ids, mask = batch.completion_ids.cpu(), batch.completion_mask.bool().cpu()
        context = RewardContext(
            completion_ids=[row[keep].tolist() for row, keep in zip(ids, mask, strict=True)],
            trainer_state=TrainerState(
                global_step=cfg.optimizer_steps(step - 1),
                max_steps=cfg.optimizer_steps(cfg.optim.max_steps),
                epoch=(step - 1) * cfg.prompts_per_step * self.acc.num_processes / self.num_rows,
            ),
        )
        return score_completions(
            self.reward_funcs, prompts, completions, columns, cfg.rewards.on_error, context,
            cfg.rewards.timeout_s, stop=stop,
        )  # fmt: skip

    def informative(self, scores: RewardScores) -> Tensor:
        """Which of this process's groups carry a signal, under `rewards.multi_objective_aggregation`."""
        return grpo.informative_groups(self.combine(scores.per_func, scores.total)[1])

    def combine(self, per_func: Tensor, total: Tensor) -> tuple[Tensor, Tensor]:
        """Advantages and group stds, the rewards combined as `rewards.multi_objective_aggregation` says."""
        G = self.cfg.grpo.num_generations
        if self.cfg.rewards.multi_objective_aggregation == "normalize_then_sum":
            weights = torch.tensor([weight for _, _, weight in self.reward_funcs], device=per_func.device)
            return grpo.normalize_then_sum(per_func, weights, total.isnan(), G)
        return grpo.group_advantages(total, G, self.cfg.grpo.scale_rewards)

    def advantages(self, scores: RewardScores) -> tuple[Tensor, Tensor]:
        """This process's advantages and every process's group reward stds, as TRL computes them: on all
        processes' rewards (`scale_rewards: batch` and normalize_then_sum use the whole batch's std),
        combined as `rewards.multi_objective_aggregation` says."""
        acc = self.acc
        per_func, total = acc.gather(scores.per_func.to(acc.device)), acc.gather(scores.total.to(acc.device))
        if self.cfg.grpo.shuffle_rewards:
            G = self.cfg.grpo.num_generations
            rows = grpo.shuffle_within_groups(len(total), G, self.shuffle_generator).to(total.device)
            per_func, total = per_func[rows], total[rows]
        advantages, group_std = self.combine(per_func, total)
        n = len(scores.total)
        return advantages[acc.process_index * n : (acc.process_index + 1) * n], group_std
