"""vLLM's sleep mode as VLLMEngine drives it, on a fake `vllm.LLM` that keeps vLLM's sleep semantics
(level 1: weights to CPU memory, KV cache discarded; level 2: both discarded): no rollout may run on
weights that sleep or were discarded, however rollouts and syncs alternate. The real engine's sleep mode
is tested on CUDA in tests/real_vllm/test_vllm_engine.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from leangrpo.engines import vllm
from leangrpo.engines.types import Sampling


class FakeLLM:
    """The parts of `vllm.LLM` the engine calls, with the state sleep and wake leave its memory in."""

    def __init__(self) -> None:
        self.weights, self.kv_cache = "loaded", "awake"  # weights: loaded, on_cpu, discarded
        self.llm_engine = SimpleNamespace(
            model_config=SimpleNamespace(max_model_len=64), reset_encoder_cache=lambda: None
        )
        self.generated: list[str] = []

    def sleep(self, level: int) -> None:
        self.weights, self.kv_cache = ("on_cpu" if level == 1 else "discarded"), "discarded"

    def wake_up(self, tags: list[str] | None = None) -> None:
        tags = ["weights", "kv_cache"] if tags is None else tags
        if "weights" in tags and self.weights != "loaded":  # discarded ones wake as uninitialised memory
            self.weights = "loaded" if self.weights == "on_cpu" else "garbage"
        if "kv_cache" in tags:
            self.kv_cache = "awake"

    def collective_rpc(self, method, kwargs):
        assert self.weights != "on_cpu" and self.weights != "discarded", "loading into sleeping weights"
        list(kwargs["weights_iterator"])
        self.weights = "loaded"

    def apply_model(self, fn) -> None:
        pass

    def reset_prefix_cache(self) -> None:
        pass

    def sample(self, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        self.generated.append(f"weights {self.weights}, KV cache {self.kv_cache}")
        return [[7, 8] for _ in prompts], [[-0.5, -0.5] for _ in prompts]


@pytest.fixture
def engine(monkeypatch, tiny_model_dir):
    from leangrpo.models.load import load_tokenizer

    llm = FakeLLM()
    monkeypatch.setattr(vllm, "build_llm", lambda *a, **k: llm)
    monkeypatch.setattr(
        vllm, "sample_tokens", lambda llm, prompts, fields, seeds, adapter=None: llm.sample(prompts)
    )
    tok = load_tokenizer(str(tiny_model_dir))
    return vllm.VLLMEngine(str(tiny_model_dir), tok, [tok.eos_token_id], max_model_len=64, sleep_mode=True)


def test_sleep_mode_never_samples_from_sleeping_or_discarded_weights(engine):
    """sync, then two rollouts before the next sync (evaluation, dynamic sampling's extra rounds), a sync,
    a rollout: every rollout runs on the last synced weights, on the GPU, with a KV cache; and between
    them the engine sleeps, so that the update has the GPU to itself."""
    model = torch.nn.Linear(2, 2)
    sampling = Sampling(num_generations=2, max_prompt_length=16, max_completion_length=2)
    engine.sync_weights(model)
    for step in ("generate", "generate", "sync", "generate"):
        if step == "sync":
            engine.sync_weights(model)
        else:
            batch = engine.generate(["a b c"], sampling)
            assert batch.completion_ids.shape == (2, 2)
            assert (engine.llm.weights, engine.llm.kv_cache) != ("loaded", "awake")  # asleep again
    assert engine.llm.generated == ["weights loaded, KV cache awake"] * 3
