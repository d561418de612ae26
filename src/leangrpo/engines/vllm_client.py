"""Rollouts from a vLLM server in another process, or on other GPUs or machines (TRL's
`vllm_mode="server"`): `leangrpo vllm-serve` (engines/vllm_server.py), or generation only from TRL's or
vLLM's own server.

The client samples as the colocated engine does (the same prompt tokens, SamplingParams fields, EOS set
and per-completion seeds from torch's RNG) and pushes the policy's weights after every update: a
safetensors file in a directory the server can read (CPU, or any machine sharing it), or NCCL on CUDA.
It needs neither vLLM nor a GPU on the trainer's side for the file transport, and it may be called from
a background thread (its HTTP client is thread-safe; one weight update at a time).
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import torch

from leangrpo.engines.tools import Toolbox
from leangrpo.engines.types import RolloutBatch, Sampling
from leangrpo.engines.vllm import VLLMError, applied_weights, import_vllm, sampled_batch, sampling_fields
from leangrpo.models.load import is_peft

if TYPE_CHECKING:
    from torch import Tensor
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from leangrpo.config.schema import Config

SHAPE_FIELDS = (
    "architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "intermediate_size",
)  # fmt: skip
"""The model config fields `leangrpo vllm-serve` reports (/model_info), which must equal the trainer's."""


def server_url(base_url: str | None, host: str, port: int) -> str:
    """TRL's rule: `vllm_server_base_url` when set, else http://host:port."""
    return (base_url or f"http://{host}:{port}").rstrip("/")


def check_server(device: str, sharded: bool) -> None:
    """Server mode: the trainer needs vLLM only on CUDA (its NCCL group), and the whole weights on the
    process that sends them (DDP, not FSDP)."""
    if device == "cuda":
        import_vllm()
    if sharded:
        raise VLLMError(
            "grpo.vllm_mode=server runs under DDP, not FSDP, for now (the first process sends the whole "
            "weights); launch with the ddp accelerate config"
        )


class VLLMServerEngine:
    """A RolloutEngine on a vLLM server at `url`, checked against the trainer's `model` before use."""

    holds_weights = sampler_logprobs = True

    def __init__(
        self,
        url: str,
        model: PreTrainedModel,
        name_or_path: str,
        tokenizer: PreTrainedTokenizerBase,
        eos: list[int],
        *,
        timeout: float = 240.0,
        max_model_len: int = 0,
        group_port: int = 51216,
    ):
        """Wait up to `timeout` seconds for the server's /health, then refuse, in one line, a server that
        serves another model than `name_or_path` (`model`'s config) or a context below `max_model_len`."""
        self.url, self.tokenizer, self.eos = url, tokenizer, eos
        self.http = httpx.Client(base_url=url, timeout=httpx.Timeout(None, connect=10.0))
        wait_for_health(self.http, url, timeout, name_or_path)
        info = self._info()
        self.leangrpo = "architectures" in info  # leangrpo's own server: seed lists, weight updates
        self.served, self.max_model_len = info["model"], int(info["max_model_len"] or 0)
        check_model(info, model.config, name_or_path, max_model_len, url)
        self.sync_dir = Path(tempfile.mkdtemp(prefix="leangrpo-vllm-sync-"))
        weakref.finalize(self, shutil.rmtree, self.sync_dir, True)
        self.sync_lock, self.group_port = threading.Lock(), group_port
        self.communicator: Any = None  # the NCCL group (CUDA), opened at the first sync

    @classmethod
    def from_config(
        cls, cfg: Config, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, eos: list[int]
    ) -> VLLMServerEngine:
        """The training run's: the server `grpo.vllm_server_*` names, long enough for the evaluation too."""
        g, ev = cfg.grpo, cfg.eval
        url = server_url(g.vllm_server_base_url, g.vllm_server_host, g.vllm_server_port)
        eval_length = g.max_prompt_length + (ev.max_new_tokens or 0) if ev.enabled else 0
        return cls(
            url, model, cfg.model.name_or_path, tokenizer, eos, timeout=g.vllm_server_timeout,
            max_model_len=max(g.max_model_length, eval_length), group_port=g.vllm_group_port,
        )  # fmt: skip

    def generate(
        self, prompt_texts: list[str], sampling: Sampling, toolboxes: list[Toolbox] | None = None
    ) -> RolloutBatch:
        """As VLLMEngine.generate, each completion its own request and seed (drawn here, from torch's RNG or
        the rollout's own, `sampling.seed`)."""
        return sampled_batch(
            self.tokenizer, self.eos, prompt_texts, sampling, toolboxes, self._sample, self.max_model_len
        )

    def _sample(
        self, prompts: list[list[int]], sampling: Sampling, rng: torch.Generator | None
    ) -> tuple[list[list[int]], list[list[float]]]:
        seeds = torch.randint(2**31 - 1, (len(prompts),), generator=rng).tolist()
        body = {"model": self.served, **sampling_fields(sampling, self.eos)}
        if self.leangrpo:  # one request, a seed per prompt
            return self._complete({**body, "prompt": prompts, "seed": seeds})
        with ThreadPoolExecutor(max_workers=min(32, len(prompts))) as pool:  # vLLM's server batches them
            parts = list(
                pool.map(lambda p, s: self._complete({**body, "prompt": [p], "seed": s}), prompts, seeds)
            )
        return [i for ids, _ in parts for i in ids], [lp for _, logps in parts for lp in logps]

    def _complete(self, body: dict[str, Any]) -> tuple[list[list[int]], list[list[float]]]:
        body = {**body, "return_token_ids": True, "return_tokens_as_token_ids": True}
        choices = self._call("POST", "/v1/completions", json=body)["choices"]
        return [c["token_ids"] for c in choices], [c["logprobs"]["token_logprobs"] for c in choices]

    def sync_weights(
        self, model: PreTrainedModel, weights: Iterable[tuple[str, Tensor]] | None = None
    ) -> None:
        """Push `model`'s weights to the server; under several processes (DDP), the first one pushes and
        the others wait for it. A LoRA model sends only its adapted layers, merged: the server takes the
        rest from its own copy of the base checkpoint. `weights` is for in-process engines under FSDP2,
        which server mode refuses: the weights are read from `model`."""
        import torch.distributed as dist

        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not several or dist.get_rank() == 0:
            with self.sync_lock, torch.no_grad():
                if model.device.type == "cuda":
                    self._send_nccl(model)
                else:
                    self._send_file(model)
        if several:
            dist.barrier()

    def close(self) -> None:
        """The HTTP connections go; the server and its weights stay for the next run."""
        self.http.close()

    def _send_file(self, model: PreTrainedModel) -> None:
        """One safetensors file in `sync_dir` (which the server must see at the same path), loaded by the
        server through vLLM's in-place reload, then deleted."""
        from safetensors.torch import save_file

        if not self.leangrpo:
            raise VLLMError(
                f"the vLLM server at {self.url} is not leangrpo's: it cannot take weight updates from "
                "leangrpo (generation only); start it with: leangrpo vllm-serve"
            )
        partial = is_peft(model)
        path = self.sync_dir / "weights.safetensors"
        save_file(weights_to_send(model, partial), str(path))
        try:
            self._call("POST", "/load_weights", json={"path": str(path), "partial": partial})
        finally:
            path.unlink(missing_ok=True)

    def _send_nccl(self, model: PreTrainedModel) -> None:
        """CUDA: every weight broadcast on an NCCL group with the server, as TRL's server takes them.
        NOT TESTED (no GPU where leangrpo is tested); needs vLLM installed beside the trainer."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        if self.communicator is None:  # the trainer is rank 0 of {trainer, server}
            host = socket.gethostbyname(socket.gethostname())
            body = {"host": host, "port": self.group_port, "world_size": 2}
            with ThreadPoolExecutor(max_workers=1) as pool:
                joined = pool.submit(self._call, "POST", "/init_communicator", json=body)
                group = StatelessProcessGroup.create(host, self.group_port, rank=0, world_size=2)
                self.communicator = PyNcclCommunicator(group, device=model.device)
                joined.result()
        params = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in applied_weights(model)]
        with ThreadPoolExecutor(max_workers=1) as pool:  # the server receives while this side sends
            loaded = pool.submit(self._call, "POST", "/update_named_params", json={"params": params})
            for _, tensor in applied_weights(model):
                self.communicator.broadcast(tensor.contiguous(), src=0)
            loaded.result()

    def _info(self) -> dict[str, Any]:
        """leangrpo's /model_info; from another vLLM server, what /v1/models says (name and context)."""
        response = self._send("GET", "/model_info")
        if response.status_code == 200:
            return dict(response.json())
        served = self._call("GET", "/v1/models")["data"][0]
        return {"model": served["id"], "max_model_len": served.get("max_model_len")}

    def _call(self, method: str, route: str, **kwargs: Any) -> dict[str, Any]:
        """The route's JSON answer; any failure is one VLLMError line (the trainer checkpoints and stops)."""
        response = self._send(method, route, **kwargs)
        if response.status_code != 200:
            detail = response.text.strip().splitlines()[-1:] or [f"HTTP {response.status_code}"]
            raise VLLMError(f"the vLLM server at {self.url} failed {route}: {detail[0][:300]}")
        return dict(response.json())

    def _send(self, method: str, route: str, **kwargs: Any) -> httpx.Response:
        try:
            return self.http.request(method, route, **kwargs)
        except httpx.HTTPError as e:
            raise VLLMError(
                f"the vLLM server at {self.url} stopped answering ({type(e).__name__}: {e})"
            ) from e


def weights_to_send(model: torch.nn.Module, adapted_only: bool) -> dict[str, torch.Tensor]:
    """`applied_weights` as one dict (a tied LM head comes once, as the embedding: vLLM ties it again)."""
    return {name: t.contiguous() for name, t in applied_weights(model, adapted_only=adapted_only)}


def wait_for_health(http: httpx.Client, url: str, timeout: float, name_or_path: str) -> None:
    """Poll GET /health until it answers 200; after `timeout` seconds, one VLLMError line saying how to
    start a server."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if http.get("/health", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            raise VLLMError(
                f"no vLLM server answered at {url}/health within {timeout:g} s (grpo.vllm_server_timeout); "
                f"start one with: leangrpo vllm-serve --model {name_or_path}"
            )
        time.sleep(min(1.0, left))


def check_model(info: dict[str, Any], config: Any, name_or_path: str, max_model_len: int, url: str) -> None:
    """Refuse, in one line, a server whose model is not the trainer's: another name (the last part of its
    path or hub id), architecture, vocabulary or shape, or a context window shorter than the run needs."""
    theirs, ours = Path(str(info["model"])).name, Path(name_or_path).name
    differ = [f"model {theirs} ≠ {ours}"] if theirs != ours else []
    for key in SHAPE_FIELDS:
        if key in info and info[key] != getattr(config, key, None):
            differ.append(f"{key} {info[key]} ≠ {getattr(config, key, None)}")
    if info.get("max_model_len") and info["max_model_len"] < max_model_len:
        differ.append(f"max_model_len {info['max_model_len']} < the {max_model_len} this run needs")
    if differ:
        raise VLLMError(
            f"the vLLM server at {url} does not serve this run's model ({'; '.join(differ)}); "
            f"start it with: leangrpo vllm-serve --model {name_or_path}"
        )
