"""Async rollouts (`grpo.async_rollouts`) on the tiny model: with a staleness bound of 0 the run is the
synchronous one, bit for bit; with a bound of 1 every batch but the first is one optimizer step stale, and
the importance-sampling correction sees the gap; a resumed run uses every step's batch once; what async
cannot run with is refused in one line."""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import load_file
from test_e2e import read_metrics
from test_resume import _timing as _phase_timing
from test_resume import interrupt_after, make_config, prompts_seen

from leangrpo.core.errors import Stopped, UserError
from leangrpo.engines.agents import AgentSpec
from leangrpo.engines.hf import SnapshotEngine
from leangrpo.engines.types import Sampling
from leangrpo.run.checkpoint import checkpoint_dirs, read_state
from leangrpo.run.resolve import load_config
from leangrpo.train.policy import Policy, batch_logprobs
from leangrpo.train.preflight import World, check_async_agent, preflight
from leangrpo.train.trainer import Trainer

pytestmark = pytest.mark.slow


def _timing(key: str) -> bool:
    return _phase_timing(key) or key == "async/generate_seconds"


REWARDS = {"functions": [{"name": "toy_rewards:vowel_share"}, {"name": "toy_rewards:record_prompts"}]}


@pytest.fixture
def threads(monkeypatch) -> list[str]:
    """The names of the threads the snapshot engine generated in, one per batch."""
    names: list[str] = []
    generate = SnapshotEngine.generate

    def recording(self, *args, **kwargs):
        names.append(threading.current_thread().name)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(SnapshotEngine, "generate", recording)
    return names


def train(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch, name: str, evaluation=None, **grpo) -> list[dict]:
    path = make_config(tmp_path, tiny_model_dir, gsm8k_dir, name, grpo=grpo, rewards=REWARDS,
                       optim={"max_steps": 4}, logging={"save_steps": 2}, eval=evaluation or {})  # fmt: skip
    (tmp_path / name).mkdir()
    monkeypatch.setenv("LEANGRPO_TEST_OUT", str(tmp_path / name))
    Trainer(load_config(path), overwrite=True).train()
    return read_metrics(tmp_path / name)


def test_bound_zero_is_the_synchronous_run(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch, threads):
    sync = train(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch, "sync")
    assert threads == []  # the synchronous run generates with the policy itself
    async0 = train(
        tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch, "async0", async_rollouts=True, max_staleness=0
    )
    assert threads == ["leangrpo-rollouts_0"] * 4  # every batch came from the background thread
    assert [r["async/staleness_max"] for r in async0] == [0.0] * 4
    for a, b in zip(sync, async0, strict=True):
        common = {k for k in a.keys() & b.keys() if not _timing(k)}
        assert common >= {"reward", "loss", "grad_norm", "completions/mean_length"}
        assert {k: a[k] for k in common} == {k: b[k] for k in common}  # exact, not approximate
    weights = {n: load_file(tmp_path / n / "model" / "model.safetensors") for n in ("sync", "async0")}
    start = load_file(tiny_model_dir / "model.safetensors")
    assert any(not torch.equal(weights["sync"][k], start[k]) for k in start)  # training moved them
    for key, value in weights["sync"].items():
        assert torch.equal(weights["async0"][key], value), key
    assert prompts_seen(tmp_path, "sync") == prompts_seen(tmp_path, "async0")


def test_bound_one_overlaps_and_corrects(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch, threads):
    evaluation = {"enabled": True, "path": str(gsm8k_dir), "limit": 2, "eval_steps": 2}
    rows = train(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch, "async1", evaluation, async_rollouts=True)
    evals = [r for r in rows if "eval/accuracy" in r]
    rows = [r for r in rows if "eval/accuracy" not in r]
    assert [r["step"] for r in evals] == [0, 2, 4]  # evaluated beside the batch in flight
    assert len(threads) == 4
    staleness = [(r["async/staleness_mean"], r["async/staleness_max"]) for r in rows]
    assert staleness == [(0.0, 0.0)] + [(1.0, 1.0)] * 3  # step 1 had nothing ahead of it
    assert all(r["async/generate_seconds"] > 0 and "time/sync" in r for r in rows)
    assert "vllm/logprob_diff_mean" not in rows[0]  # on-policy: nothing to correct
    for r in rows[
        1:
    ]:  # one update behind: the sampler's log-probs differ from the trainer's, and are weighed
        assert r["vllm/logprob_diff_mean"] > 0 and r["vllm/is_ratio_mean"] > 0


def test_snapshot_log_probs_are_the_trainers(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from leangrpo.models.load import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = load_tokenizer(str(tiny_model_dir))
    engine = SnapshotEngine(model, tokenizer)
    sampling = Sampling(
        num_generations=2, max_prompt_length=32, max_completion_length=6, temperature=0.7, seed=1
    )
    batch = engine.generate(["Hello there", "What is 2 + 2?"], sampling)
    assert batch.sampling_logprobs is not None and batch.sampling_logprobs.shape == batch.completion_ids.shape
    trainer = batch_logprobs(Policy(model, 0.7, 64, False), batch, 4, 1)
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(batch.sampling_logprobs[mask], trainer[mask], atol=1e-4, rtol=0)
    again = engine.generate(["Hello there", "What is 2 + 2?"], sampling)
    assert torch.equal(again.completion_ids, batch.completion_ids)  # the seed, not the global RNG
    with torch.no_grad():  # the snapshot moves only when synced
        next(p for p in model.parameters()).add_(1.0)
    assert torch.equal(
        engine.generate(["Hello there", "What is 2 + 2?"], sampling).completion_ids, batch.completion_ids
    )
    engine.sync_weights(model)
    assert all(torch.equal(a, b) for a, b in zip(engine.model.parameters(), model.parameters(), strict=True))


def test_a_lora_snapshot_copies_the_adapter_only(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from leangrpo.config.schema import LoraConfig
    from leangrpo.models.load import apply_lora, load_tokenizer

    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraConfig(enabled=True, r=4))
    engine = SnapshotEngine(model, load_tokenizer(str(tiny_model_dir)))
    theirs = dict(model.named_parameters())
    for name, param in engine.model.named_parameters():
        shared = param.data_ptr() == theirs[name].data_ptr()
        assert shared != theirs[name].requires_grad, name  # the frozen base shared, the adapter copied
        assert not param.requires_grad


def test_resumed_run_uses_every_batch_once(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch):
    straight = train(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch, "straight", async_rollouts=True)
    path = make_config(tmp_path, tiny_model_dir, gsm8k_dir, "resumed", grpo={"async_rollouts": True},
                       rewards=REWARDS, optim={"max_steps": 4}, logging={"save_steps": 2})  # fmt: skip
    (tmp_path / "resumed").mkdir()
    monkeypatch.setenv("LEANGRPO_TEST_OUT", str(tmp_path / "resumed"))
    with monkeypatch.context() as m:
        interrupt_after(m, 2)
        with pytest.raises(Stopped):
            Trainer(load_config(path), overwrite=True).train()
    [ckpt] = checkpoint_dirs(tmp_path / "resumed")
    assert read_state(ckpt)["async_discarded_step"] == 3  # generated ahead, never trained on
    Trainer(load_config(path), resume=True).train()
    resumed = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight[:2], resumed[:2], strict=True):
        assert {k: v for k, v in a.items() if not _timing(k)} == {
            k: v for k, v in b.items() if not _timing(k)
        }
    assert resumed[2]["async/staleness_max"] == 0.0  # generated again, from the checkpoint's weights
    assert resumed[3]["async/staleness_max"] == 1.0
    seen = prompts_seen(tmp_path, "resumed")
    assert seen == prompts_seen(tmp_path, "straight")  # each step's prompts once: none twice, none lost
    assert len(seen) == 4 * 2 * 4  # steps × prompts per step × completions


def test_what_async_cannot_run_with_is_refused(tmp_path, tiny_model_dir, gsm8k_dir):
    path = make_config(tmp_path, tiny_model_dir, gsm8k_dir, "refused", grpo={"async_rollouts": True})
    for override, world, problem in [
        ("grpo.dynamic_sampling=true", World(), "grpo.dynamic_sampling"),
        ("grpo.max_staleness=1", World(num_processes=2, sharded=True), "FSDP"),
    ]:
        with pytest.raises(UserError, match=f"grpo.async_rollouts with {problem}: .*; turn one of them off"):
            preflight(load_config(str(path), [override]), world, overwrite=True)
    cfg = load_config(str(path))
    with pytest.raises(UserError, match="rollout_func"):
        check_async_agent(cfg, AgentSpec([], rollout_func=lambda prompts, trainer: {}))
    check_async_agent(cfg, AgentSpec([add]))  # plain tools run in the rollout thread


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def test_two_processes_each_generate_ahead_and_stay_in_sync(tmp_path, tiny_model_dir, gsm8k_dir):
    from test_e2e import TESTS, torchrun, write_config

    cfg = write_config(
        tmp_path / "run.yaml", tiny_model_dir, gsm8k_dir / "train.jsonl", tmp_path / "run", rewards=REWARDS,
        optim={"max_steps": 3, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1},
        grpo={"async_rollouts": True},
    )  # fmt: skip
    proc = torchrun(
        TESTS / "ddp_worker.py", str(cfg), port=29561, env_extra={"LEANGRPO_TEST_OUT": str(tmp_path)}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    w0, w1 = ((tmp_path / f"weights-rank{r}.sha256").read_text() for r in (0, 1))
    assert w0 == w1  # every process's update saw the same gradients
    p0, p1 = (set((tmp_path / f"prompts-rank{r}.txt").read_text().splitlines()) for r in (0, 1))
    assert len(p0) == len(p1) == 3 and not p0 & p1  # each rank its own prompt per step
    assert [r["async/staleness_max"] for r in read_metrics(tmp_path / "run")] == [0.0, 1.0, 1.0]


def test_the_background_thread_uses_the_process_device(monkeypatch):
    """A new thread starts on CUDA device 0: the rollout thread sets the process's own device first."""
    from leangrpo.train.rollouts import AsyncRollouts

    calls: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name, d))
    )
    rollouts = AsyncRollouts(object(), max_staleness=1, updates_per_step=1, device=torch.device("cuda", 1))  # type: ignore[arg-type]
    rollouts.version = 0
    rollouts.submit(1, lambda engine: "batch")  # type: ignore[arg-type,return-value]
    assert rollouts.take(1).rollout == "batch"
    rollouts.close()
    assert [d for name, d in calls if name.startswith("leangrpo-rollouts")] == [torch.device("cuda", 1)]

    calls.clear()  # on the CPU, no CUDA call at all
    cpu = AsyncRollouts(object(), max_staleness=1, updates_per_step=1, device=torch.device("cpu"))  # type: ignore[arg-type]
    cpu.version = 0
    cpu.submit(1, lambda engine: "batch")  # type: ignore[arg-type,return-value]
    cpu.take(1)
    cpu.close()
    assert calls == []


def test_phase_timer_waits_for_its_own_stream_only(monkeypatch):
    """`torch.cuda.synchronize()` waits for the whole device, background generation included: the timer
    waits for the current stream's kernels only, so the overlap stays and time/* is the phase's own."""
    from leangrpo.train.metrics import PhaseTimer

    waited: list[str] = []

    class Stream:
        def synchronize(self) -> None:
            waited.append("stream")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: waited.append("device"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    timer = PhaseTimer()
    with timer("update"):
        pass
    assert waited == ["stream"] and timer.seconds["update"] >= 0


def test_an_engine_failure_on_one_process_is_raised_on_all():
    """Every process agrees, right after an engine call, whether it failed anywhere: all take the failure
    path (checkpoint the step before, through collectives) together, none waits in the step's collectives."""
    from leangrpo.engines.types import EngineError
    from leangrpo.train.rollouts import agreed

    asked: list[bool] = []

    def world(other_failed: bool):
        def any_process(flag: bool) -> bool:
            asked.append(flag)
            return flag or other_failed

        return any_process

    assert agreed(world(False), lambda: "batch") == "batch" and asked == [False]

    def failing() -> str:
        raise EngineError("vLLM died")

    with pytest.raises(EngineError, match="vLLM died"):  # this process failed: the others are told
        agreed(world(False), failing)
    assert asked[-1] is True
    with pytest.raises(EngineError, match="another process"):  # another one failed: this one stops too
        agreed(world(True), lambda: "batch")
    assert asked[-1] is False
    with pytest.raises(ValueError):  # not an engine's failure: raised as before
        agreed(world(False), lambda: int("x"))
