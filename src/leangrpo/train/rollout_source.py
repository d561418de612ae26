"""Where a step's batch comes from: the step's prompts, the rollout engine (built once, given the policy's
weights when it holds a copy of its own), async rollouts generated in the background, TRL's rollout_func,
and DAPO's dynamic sampling rounds. A step's prompts and samples are a pure function of the seed, the step,
the round and the process, so that a resumed run draws exactly what an uninterrupted one would."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from leangrpo.core import grpo
from leangrpo.data.rewards import RewardScores
from leangrpo.data.rows import PromptFormat, prompt_images
from leangrpo.data.sources import PromptSampler
from leangrpo.engines.registry import async_engine, build_engine
from leangrpo.engines.types import (
    PolicyEngine,
    RolloutBatch,
    RolloutEngine,
    Sampling,
    eos_token_ids,
    rollout_func_batch,
)
from leangrpo.engines.vision import vision_processor
from leangrpo.train.rollouts import AsyncRollouts, Generation, Job, Rollout, Taken, agreed, rollout_seed

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import PreTrainedTokenizerBase

    from leangrpo.config.schema import Config
    from leangrpo.engines.agents import AgentSpec, RolloutFunc
    from leangrpo.engines.tools import Toolbox
    from leangrpo.train.policy import Policy
    from leangrpo.train.scoring import Scorer


class RolloutFuncEngine(PolicyEngine):
    """A RolloutEngine that generates through TRL's `rollout_func(prompts, trainer)`, as TRL evaluates a run
    that generates with one: each prompt text is mapped back to its row's prompt, and the function samples
    as it does in training (greedy evaluation and pass@k samples alike). Its extra keys reach the
    evaluation's rewards, as in training."""

    def __init__(
        self, rollout_func: RolloutFunc, trainer: Any, tokenizer: PreTrainedTokenizerBase, eos: list[int],
        prompts: list[Any], prompt_format: PromptFormat, device: torch.device,
    ):  # fmt: skip
        self.rollout_func, self.trainer, self.tokenizer, self.eos = rollout_func, trainer, tokenizer, eos
        self.prompts = {prompt_format.render(tokenizer, p): p for p in prompts}
        self.device = device

    def generate(
        self,
        prompt_texts: list[str],
        sampling: Sampling,
        toolboxes: list[Toolbox] | None = None,
        images: list[list[Any]] | None = None,
    ) -> RolloutBatch:
        prompts = [self.prompts[text] for text in prompt_texts for _ in range(sampling.num_generations)]
        output = self.rollout_func(prompts, self.trainer)
        return rollout_func_batch(output, self.tokenizer, self.eos, self.device, keep_logprobs=False)


def long_prompts(
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, Any]],
    cfg: Config,
    agent: AgentSpec | None = None,
) -> str | None:
    """A warning of how many prompts are longer than grpo.max_prompt_length and how many tokens their cut
    (`PromptFormat.fit`) removes, counted on the prompts as rollouts render them (system prompt and the
    `agent`'s tool schemas included); None when none is, or without a limit. A prompt whose question
    alone is over the limit raises PromptTooLong (one line), before any rollout."""
    limit = cfg.grpo.max_prompt_length
    if limit is None:
        return None
    fmt = PromptFormat.from_config(cfg.data)  # uncut
    schemas: dict[Any, list[dict[str, Any]] | None] = {}  # by environment name: one render of the tools each

    def tools(row: dict[str, Any]) -> list[dict[str, Any]] | None:
        if agent is None:
            return None
        name = row.get("environment")
        if name not in schemas:
            schemas[name] = agent.schemas(row)
        return schemas[name]

    def length(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    long = cut = 0
    for row in rows:
        text = fmt.render(tokenizer, row["prompt"], tools(row))
        if (before := length(text)) > limit:
            fitted = replace(fmt, max_tokens=limit).fit(tokenizer, row["prompt"], tools(row), text)
            long, cut = long + 1, cut + before - length(fitted)
    if not long:
        return None
    return (
        f"warning: {long} of {len(rows)} prompts are longer than grpo.max_prompt_length={limit} tokens "
        f"(tool schemas and system prompt included); {cut} tokens cut from the middle of what precedes "
        "their last user message, which is kept with the generation header"
    )


class RolloutSource:
    """A step's rows and their sampled completions, by whichever engine the config picks."""

    def __init__(
        self,
        cfg: Config,
        acc: Accelerator,
        gen: Generation,
        rows: list[dict[str, Any]],
        prompt_format: PromptFormat,
        trainer: Any,
        release_memory: Callable[[], None],
    ):
        """`trainer`: the Trainer; a rollout_func is given its `extras.rollout_trainer` (TRL passes its
        GRPOTrainer), or the Trainer itself."""
        self.cfg, self.acc, self.gen, self.rows = cfg, acc, gen, rows
        self.trainer = trainer.extras.rollout_trainer or trainer
        self.prompt_format, self.release_memory = prompt_format, release_memory
        self.sampling = Sampling.from_config(cfg.grpo, cfg.data)
        # each step's prompts (data.shuffle_dataset), and dynamic sampling's extra ones in their own
        # seeded order
        self.sampler, self.resampler = (
            PromptSampler(
                len(rows), cfg.prompts_per_step, seed, acc.process_index, acc.num_processes, shuffle
            )
            for seed, shuffle in ((cfg.seed, cfg.data.shuffle_dataset), (cfg.seed + 2, True))
        )
        self._engine: RolloutEngine | None = None  # built at the first rollout, after any resume or SFT
        self.processor = vision_processor(rows, trainer.processing)  # image prompts: the processor
        self._rollouts: AsyncRollouts | None = None  # grpo.async_rollouts: built with the engine

    @property
    def unwrapped(self) -> Policy:
        return self.acc.unwrap_model(self.gen.policy)

    @property
    def engine(self) -> RolloutEngine:
        """The rollout engine (HF generate, or a vLLM engine built once and fed the current weights)."""
        if self._engine is None:
            gen = self.gen
            self._engine = build_engine(
                self.cfg, self.unwrapped.lm, gen.tokenizer, gen.levers, self.processor
            )
        return self._engine

    @property
    def syncs_each_step(self) -> bool:
        """The engine holds weights of its own, given the policy's before each step's rollout (async
        rollouts give them after it instead, then generate the next batch)."""
        return self.engine.holds_weights and not self.cfg.grpo.async_rollouts

    def start(self) -> None:
        """Build the engine now, before any work, so that a model vLLM cannot load stops the run at once."""
        _ = self.engine

    def sync(self) -> None:
        """Load the policy's current weights into an engine holding its own (HF generate reads the policy
        itself). Every process syncs its own engine; under FSDP2 they gather the weights together, a shard
        group at a time (`Sharded.engine_weights`)."""
        if self.engine.holds_weights:
            lm, weights = self.unwrapped.lm, self.gen.dist.engine_weights(self.gen.policy)
            agreed(self.gen.dist.any_process, lambda: self.engine.sync_weights(lm, weights))

    def sync_for_eval(self, step: int) -> None:
        """The engine given the weights of the step just trained, before evaluating with it (async: after
        the batch in flight)."""
        if self._rollouts is not None and self._rollouts.engine is self.engine:
            self._rollouts.sync(self.unwrapped.lm, self.cfg.optimizer_steps(step))
        else:
            self.sync()

    def eval_engine(self, prompts: list[Any]) -> RolloutEngine:
        """What evaluation of `prompts` generates with: the run's engine or, as TRL evaluates, the run's
        rollout_func."""
        agent, tokenizer = self.gen.agent, self.gen.tokenizer
        if agent is None or agent.rollout_func is None:
            return self.engine
        eos = eos_token_ids(tokenizer, self.unwrapped.lm)
        return RolloutFuncEngine(
            agent.rollout_func, self.trainer, tokenizer, eos, prompts, self.prompt_format, self.acc.device
        )

    def generating(self) -> AbstractContextManager[None]:
        """Around generation: under FSDP2 HF generate needs the whole weights gathered; an engine holding
        its own copy leaves the shards as they are."""
        return nullcontext() if self.engine.holds_weights else self.gen.dist.full_weights(self.gen.policy)

    def rollout(self, step: int, round_: int = 0) -> Rollout:
        """The step's prompts (`round_` > 0: dynamic sampling's extra draws) and G sampled completions of
        each; with async rollouts, the batch generated in the background (started now if it was not).
        The step's first batch carries the engine's last weight sync as vllm/sync_* metrics."""
        agent = self.gen.agent
        if self.cfg.grpo.async_rollouts:
            rollout = self._take(step)
        elif agent is not None and agent.rollout_func is not None:
            rollout = agreed(
                self.gen.dist.any_process, lambda: self._rollout_func(self.step_rows(step, round_))
            )
        else:
            job = self.job(step, round_)
            with self.generating():
                rollout = agreed(self.gen.dist.any_process, lambda: job(self.engine))
            self.release_memory()
        if round_ == 0 and self.engine.last_sync is not None:
            rollout.metrics.update(self.engine.last_sync.metrics())
        return rollout

    def step_rows(self, step: int, round_: int = 0) -> list[dict[str, Any]]:
        """The rows of `step`'s prompts (of dynamic sampling's round `round_`)."""
        if round_:
            indices = self.resampler.indices((step - 1) * self.cfg.grpo.max_resample_rounds + round_ - 1)
        else:
            indices = self.sampler.indices(step - 1)
        return [self.rows[i] for i in indices]

    def _rollout_func(self, rows: list[dict[str, Any]]) -> Rollout:
        """TRL's rollout_func: the user's function generates, with the trainer in hand. The sampler's
        log-probs it returns are kept where the engine's would be (vLLM)."""
        G, gen = self.cfg.grpo.num_generations, self.gen
        assert gen.agent is not None and gen.agent.rollout_func is not None
        with gen.dist.full_weights(gen.policy):
            output = gen.agent.rollout_func([r["prompt"] for r in rows for _ in range(G)], self.trainer)
        eos = eos_token_ids(gen.tokenizer, self.unwrapped.lm)
        batch = rollout_func_batch(output, gen.tokenizer, eos, self.acc.device, self.engine.sampler_logprobs)
        self.release_memory()
        return Rollout(rows, batch)

    def job(self, step: int, round_: int = 0) -> Job:
        """Generating `step`'s batch: here, what must run on this thread (the prompts, the environments'
        reset); returned, the rest as a function of the engine, which may run in another thread. The
        samples are drawn from the rollout's own seed (`rollout_seed`)."""
        cfg, G, agent, tokenizer = self.cfg, self.cfg.grpo.num_generations, self.gen.agent, self.gen.tokenizer
        rows = self.step_rows(step, round_)
        episodes = agent.start(rows, G) if agent is not None and agent.uses_tools else None
        if episodes is not None:  # the prompts after the environments' reset, each with its tools
            rows = [{**r, "prompt": p} for r, p in zip(rows, episodes.prompts, strict=True)]
        # an environment whose reset text differs per rollout: each rollout its own prompt, one sample each
        own = None if episodes is None else episodes.rollout_prompts
        prompts, per_text = ([r["prompt"] for r in rows], G) if own is None else (own, 1)
        texts = [
            self.prompt_format.render(
                tokenizer, p, None if episodes is None else episodes.toolboxes[i * per_text].schemas
            )
            for i, p in enumerate(prompts)
        ]
        seed = rollout_seed(cfg.seed, step, round_, self.acc.process_index)
        sampling = replace(self.sampling, seed=seed, num_generations=per_text)
        device = self.acc.device
        images = [prompt_images(r["prompt"]) for r in rows] if self.processor is not None else None

        def generate(engine: RolloutEngine) -> Rollout:
            toolboxes = None if episodes is None else episodes.toolboxes
            # images only for image prompts: an engine written for text prompts takes no images argument
            batch = engine.generate(texts, sampling, toolboxes, **({"images": images} if images else {}))
            batch = batch.to(device)
            if episodes is not None and episodes.environments is not None and batch.tool_use is not None:
                batch.tool_use.columns["environments"] = episodes.environments  # TRL gives them to rewards
                if own is not None:  # and each rollout's own prompt (`reward_inputs`)
                    batch.tool_use.columns["prompt"] = own
            return Rollout(rows, batch)

        return generate

    # -------------------------------------------------------------------------------- async rollouts

    @property
    def rollouts(self) -> AsyncRollouts:
        """Async rollouts' background thread and engine (built at the first rollout, like the engine)."""
        if self._rollouts is None:
            cfg, gen = self.cfg, self.gen
            engine = async_engine(self.engine, self.unwrapped.lm, gen.tokenizer, gen.levers)
            self._rollouts = AsyncRollouts(
                engine, cfg.grpo.max_staleness, cfg.updates_per_step, self.acc.device
            )
        return self._rollouts

    @property
    def in_flight_step(self) -> int | None:
        """The step whose batch async rollouts are generating, if any (a checkpoint records it as dropped)."""
        in_flight = None if self._rollouts is None else self._rollouts.in_flight
        return None if in_flight is None else in_flight.step

    def prefetch(self, step: int, trained: int) -> None:
        """Async rollouts: give the engine the policy's weights, those after step `trained`, and start
        generating `step`'s batch in the background."""
        self.rollouts.sync(self.unwrapped.lm, self.cfg.optimizer_steps(trained))
        self.rollouts.submit(step, self.job(step))

    def prefetch_next(self, step: int) -> None:
        """While `step` trains, generate the next step's batch, if the staleness bound allows it."""
        if self.rollouts.ahead and step < self.cfg.optim.max_steps:
            agreed(self.gen.dist.any_process, lambda: self.prefetch(step + 1, trained=step - 1))

    def _take(self, step: int) -> Rollout:
        """`step`'s batch from the background thread (generated now if none was ahead: the first step, a
        resumed run's, or a staleness bound below the step's optimizer steps), with its async/* metrics."""
        taken = agreed(self.gen.dist.any_process, lambda: self._prefetched(step))
        staleness = float(self.cfg.optimizer_steps(step - 1) - taken.version)
        assert staleness <= self.cfg.grpo.max_staleness, f"a batch {staleness} optimizer steps stale"
        rollout = taken.rollout
        if staleness == 0 and not self.engine.holds_weights:  # a snapshot of the policy's own weights:
            rollout.batch.sampling_logprobs = None  # no gap to correct, as with HF generate
        every = self.acc.gather(torch.tensor([staleness], device=self.acc.device))
        rollout.metrics.update({
            "async/staleness_mean": float(every.mean()),
            "async/staleness_max": float(every.max()),
            "async/generate_seconds": taken.seconds,
        })  # fmt: skip
        self.release_memory()
        return rollout

    def _prefetched(self, step: int) -> Taken:
        if self.rollouts.in_flight is None:
            self.prefetch(step, trained=step - 1)
        return self.rollouts.take(step)

    # ------------------------------------------------------------------------------ dynamic sampling

    def resample(
        self, step: int, rollout: Rollout, scores: RewardScores, scorer: Scorer, stop: Callable[[], bool]
    ) -> tuple[Rollout, RewardScores]:
        """DAPO's dynamic sampling: while this process (or any other: they generate together) has fewer
        informative groups than the batch holds, and at most `max_resample_rounds` times, draw and score
        another batch of prompts; then keep the first informative groups (`grpo.fill_groups`). The batch
        to train on carries the first batch's metrics and dynamic_sampling/*, summed over processes."""
        g, any_process = self.cfg.grpo, self.gen.dist.any_process
        drawn, informative = [(rollout, scores)], [scorer.informative(scores)]
        while len(drawn) <= g.max_resample_rounds and any_process(
            int(torch.cat(informative).sum()) < len(rollout.rows)
        ):
            more = self.rollout(step, len(drawn))
            more_scores = scorer.score(step, more, stop)
            drawn.append((more, more_scores))
            informative.append(scorer.informative(more_scores))
        flags = torch.cat(informative)
        groups = grpo.fill_groups(flags, len(rollout.rows))
        completions = (groups[:, None] * g.num_generations + torch.arange(g.num_generations)).flatten()
        every_row = [row for r, _ in drawn for row in r.rows]
        batch = RolloutBatch.cat([r.batch for r, _ in drawn]).select(
            completions.to(rollout.batch.prompt_ids.device)
        )
        kept = RewardScores.cat([s for _, s in drawn]).select(completions)
        filled = int((~flags[groups]).sum())
        counts = torch.tensor([len(flags), int((~flags).sum()) - filled, filled], device=self.acc.device)
        prompts, dropped, filled = self.acc.reduce(counts, "sum").tolist()
        metrics = {  # the first round's own metrics (vllm/sync_*) stay: the later rounds do not sync
            **rollout.metrics,
            "dynamic_sampling/rounds": len(drawn) - 1,
            "dynamic_sampling/prompts_drawn": prompts,
            "dynamic_sampling/groups_dropped": dropped,
            "dynamic_sampling/filled": filled,
        }
        return Rollout([every_row[i] for i in groups.tolist()], batch, metrics), kept

    def close(self) -> None:
        """Stop the background thread (dropping the batch in flight) and close the engine."""
        if self._rollouts is not None:
            self._rollouts.close()
        if self._engine is not None:
            self._engine.close()
