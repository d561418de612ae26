"""`grpo.vllm_mode: server`, the parts that need no vLLM: TRL's config names and defaults, the trainer
needing no vLLM on CPU, and the client's one-line refusals (no server, another model). The server itself
is tested for real in tests/real_vllm/test_vllm_server.py."""

from __future__ import annotations

import socket
import sys

import pytest
from test_e2e import run_cli, write_config
from test_memory import make_cfg

from leangrpo.config.trl_fields import TRL_DEFAULTS
from leangrpo.engines.vllm import VLLMError
from leangrpo.engines.vllm_client import SHAPE_FIELDS, check_model, server_url
from leangrpo.train.preflight import World, preflight

SERVER_FIELDS = (
    "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port"
)  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_trl_names_defaults_and_url():
    cfg = make_cfg(grpo={"use_vllm": True, "vllm_mode": "server"})
    assert {name: getattr(cfg.grpo, name) for name in SERVER_FIELDS} == {
        n: TRL_DEFAULTS[n] for n in SERVER_FIELDS
    }
    assert server_url(None, "10.0.0.2", 8001) == "http://10.0.0.2:8001"
    assert server_url("http://gen-node:9000/", "ignored", 1) == "http://gen-node:9000"  # base URL wins


def test_server_mode_needs_no_vllm_on_cpu_and_runs_under_ddp_not_fsdp(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails, whether installed or not
    cfg = make_cfg(grpo={"use_vllm": True, "vllm_mode": "server"}, output_dir=str(tmp_path / "run"))
    preflight(cfg, World(num_processes=2, device="cpu"))  # DDP: each process generates through the server
    with pytest.raises(VLLMError, match="^grpo.vllm_mode=server runs under DDP, not FSDP") as info:
        preflight(cfg, World(num_processes=2, device="cpu", sharded=True))
    assert "\n" not in str(info.value)


def test_train_without_a_server_stops_in_one_line(tmp_path, tiny_model_dir, gsm8k_dir):
    port = free_port()  # nothing listens there
    grpo = {
        "use_vllm": True,
        "vllm_mode": "server",
        "vllm_server_host": "127.0.0.1",
        "vllm_server_port": port,
    }
    cfg = write_config(
        tmp_path / "run.yaml", tiny_model_dir, gsm8k_dir / "train.jsonl", tmp_path / "run",
        grpo={**grpo, "vllm_server_timeout": 1},
    )  # fmt: skip
    result = run_cli("train", "-c", str(cfg))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: no vLLM server answered at http://127.0.0.1:{port}/health within 1 s "
        f"(grpo.vllm_server_timeout); start one with: leangrpo vllm-serve --model {tiny_model_dir}"
    )


def test_a_server_of_another_model_is_refused_in_one_line(tiny_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    served = {"model": f"/srv/models/{tiny_model_dir.name}", "max_model_len": 256}
    same = {**served, **{key: getattr(config, key) for key in SHAPE_FIELDS}}
    check_model(same, config, str(tiny_model_dir), 200, "http://s:1")  # the same model, another path
    check_model(served, config, str(tiny_model_dir), 200, "http://s:1")  # vLLM's server: name and context
    with pytest.raises(VLLMError) as info:
        check_model({**same, "vocab_size": 7}, config, "org/other", 300, "http://s:1")
    assert str(info.value) == (
        "the vLLM server at http://s:1 does not serve this run's model "
        f"(model {tiny_model_dir.name} ≠ other; vocab_size 7 ≠ {config.vocab_size}; "
        "max_model_len 256 < the 300 this run needs); "
        "start it with: leangrpo vllm-serve --model org/other"
    )
