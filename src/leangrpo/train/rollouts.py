"""A step's rollout (`Rollout`: the data a step carries from its rollout to its record), what generates it
(`Generation`), and async rollouts (`grpo.async_rollouts`, docs/async.md): the next step's batch is
generated in a background thread while this step trains, by an engine holding the weights of its last
sync, and never used more than `grpo.max_staleness` optimizer steps after them.

One batch is generated ahead at most. The engine is synced only between two rollouts, from the main
thread, before the update that follows starts writing the policy: a batch generated during step k's
update holds the weights after step k - 1, so it is `num_iterations` optimizer steps stale when step k + 1
trains on it. A bound below that makes the next batch wait for the update (the synchronous schedule,
staleness 0) instead of being thrown away.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from leangrpo.engines.types import EngineError, RolloutBatch, RolloutEngine

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from leangrpo.engines.agents import AgentSpec
    from leangrpo.engines.types import GenerateLevers
    from leangrpo.train.distributed import Replicated


@dataclass
class Rollout:
    """A step's rows (its prompts), their sampled completions, and what generating them measured
    (async/*, dynamic_sampling/*): the step's data travels with it, not beside it."""

    rows: list[dict[str, Any]]
    batch: RolloutBatch
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Generation:
    """What a rollout source generates with: the policy (wrapped for DDP or FSDP2), how it is distributed,
    its tokenizer and the device's speed levers, and TRL's tools, environments or rollout_func."""

    policy: torch.nn.Module
    dist: Replicated
    tokenizer: PreTrainedTokenizerBase
    levers: GenerateLevers | None
    agent: AgentSpec | None


Job = Callable[[RolloutEngine], Rollout]
"""Generating one batch with a given engine: what may run in the background thread."""


T = TypeVar("T")


def agreed(any_process: Callable[[bool], bool], engine_call: Callable[[], T]) -> T:
    """`engine_call()`, with every process agreeing, before its next collective, whether it failed on
    any: an `EngineError` on one process is raised on all, so that all take the failure path together
    (checkpointing the step before, itself through collectives) instead of the others waiting forever in
    the step's collectives."""
    try:
        out, failed = engine_call(), None
    except EngineError as e:
        out, failed = None, e
    if any_process(failed is not None):
        raise failed or EngineError("the rollout engine of another process failed (its error is in its log)")
    return out  # type: ignore[return-value]  # None only when failed, which raised


def rollout_seed(seed: int, step: int, round_: int, rank: int) -> int:
    """The seed of one rollout's samples: a pure function of the run's seed, the step, dynamic sampling's
    round and the process, like the prompts, so that a batch is the same whichever thread generates it
    and whenever it does (a resume generates an in-flight batch again)."""
    digest = hashlib.blake2b(f"{seed}:{step}:{round_}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # 63 bits: torch.Generator.manual_seed's range


@dataclass
class Taken:
    """A batch generated in the background: its rows and completions, the optimizer step of the weights
    that generated it, and the seconds its generation took."""

    rollout: Rollout
    version: int
    seconds: float


@dataclass
class _InFlight:
    step: int
    version: int
    future: Future[tuple[Rollout, float]]


def _timed(job: Job, engine: RolloutEngine) -> tuple[Rollout, float]:
    start = time.perf_counter()
    out = job(engine)
    return out, time.perf_counter() - start


def _use_device(device: torch.device) -> None:
    """The background thread's CUDA device: the process's own (a new thread starts on device 0, which on
    ranks above 0 is another process's GPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.set_device(device)


class AsyncRollouts:
    """One background thread generating with `engine` (which must hold weights of its own: see
    `engines.registry.async_engine`) on the process's `device`, the batch in flight, and the weights'
    version the engine holds."""

    def __init__(
        self, engine: RolloutEngine, max_staleness: int, updates_per_step: float, device: torch.device
    ):
        self.engine = engine
        # a batch generated during an update is up to ⌈updates_per_step⌉ optimizer steps stale when used
        self.ahead = max_staleness >= updates_per_step
        self.version: int | None = None  # the optimizer step of the engine's weights; None: never synced
        self.in_flight: _InFlight | None = None
        self._thread = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="leangrpo-rollouts",
            initializer=_use_device,
            initargs=(device,),
        )

    def sync(self, model: PreTrainedModel, version: int) -> None:
        """Give the engine `model`'s weights, those after optimizer step `version`, once the batch in
        flight is generated (the batch itself stays in flight, to be taken)."""
        if self.in_flight is not None:
            wait([self.in_flight.future])
        if version != self.version:
            self.engine.sync_weights(model)
            self.version = version

    def submit(self, step: int, job: Job) -> None:
        """Start generating `step`'s batch in the background with the engine's current weights."""
        assert self.in_flight is None and self.version is not None, "one batch in flight, after a sync"
        self.in_flight = _InFlight(step, self.version, self._thread.submit(_timed, job, self.engine))

    def take(self, step: int) -> Taken:
        """`step`'s batch, once generated (an error raised while generating it is raised here)."""
        in_flight, self.in_flight = self.in_flight, None
        assert in_flight is not None and in_flight.step == step, f"step {step}'s batch is not in flight"
        rollout, seconds = in_flight.future.result()
        return Taken(rollout, in_flight.version, seconds)

    def close(self) -> None:
        """Drop the batch in flight (a resumed run generates it again from its step index) and stop the
        thread, once its current generation ends."""
        self.in_flight = None
        self._thread.shutdown(wait=True, cancel_futures=True)
