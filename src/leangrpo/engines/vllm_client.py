"""Rollouts from a vLLM server in another process, or on other GPUs or machines (TRL's
`vllm_mode="server"`): `leangrpo vllm-serve` (engines/vllm_server.py), or generation only from TRL's or
vLLM's own server.

The client samples as the colocated engine does (the same prompt tokens, SamplingParams fields, EOS set
and per-completion seeds from torch's RNG) and pushes the policy's weights after every update: a
safetensors file in a directory the server can read (CPU, or any machine sharing it), or NCCL on CUDA;
a LoRA policy's adapter alone, as such a file, where the server serves LoRA (`--max-lora-rank`), on
the checkpoint's base (which the server reloads first where an earlier run's update replaced it).
It needs neither vLLM nor a GPU on the trainer's side for the file transport, and it may be called from
a background thread (its HTTP client is thread-safe; one weight update at a time). Image prompts of a
vision-language model go to leangrpo's own server as their text and images (`image_fields`), which the
model's processor also encodes for the trainer, as on a colocated vLLM.

Every answer is untrusted: it is checked (a JSON object of the expected shape, token ids inside the
vocabulary, one finite log-prob per token) and a bad one is one VLLMError line, as is an answer slower
than `grpo.vllm_server_read_timeout`. A stop asked for (SIGTERM, SIGINT) ends a wait for an answer at
once. The key in LEANGRPO_VLLM_API_KEY, when set, goes with every request (`vllm-serve --api-key`).
"""

from __future__ import annotations

import base64
import io
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import httpx
import torch

from leangrpo.core.errors import stop_asked
from leangrpo.engines.tools import Toolbox
from leangrpo.engines.types import RolloutBatch, Sampling, SyncStats
from leangrpo.engines.vllm import (
    Prompt,
    VLLMError,
    adapter_config,
    adapter_refusal,
    adapter_tensors,
    applied_weights,
    import_vllm,
    logger,
    run_context,
    sampled_batch,
    sampling_fields,
    say_4bit_base,
    say_adapter_sync,
    say_merged,
)
from leangrpo.models.load import is_4bit, is_peft

if TYPE_CHECKING:
    from peft import PeftModel
    from torch import Tensor
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from leangrpo.config.schema import Config

SHAPE_FIELDS = (
    "architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "intermediate_size",
)  # fmt: skip
"""The model config fields `leangrpo vllm-serve` reports (/model_info), which must equal the trainer's
(`model_shape`)."""
API_KEY_ENV = "LEANGRPO_VLLM_API_KEY"
"""The shared key `leangrpo vllm-serve --api-key` requires, sent by the client as `Authorization: Bearer`."""
CONNECT_TIMEOUT = 10.0
"""Seconds to open a connection to the server."""


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
        read_timeout: float = 1800.0,
        max_model_len: int = 0,
        group_port: int = 51216,
        stop: Callable[[], bool] = stop_asked,
        processor: Any | None = None,
    ):
        """Wait up to `timeout` seconds for the server's /health, then refuse, in one line, a server that
        serves another model than `name_or_path` (`model`'s config) or a context below `max_model_len`.
        Each request waits `read_timeout` seconds at most for its answer, or until `stop()` is true.
        `processor`: a vision-language model's, which encodes image prompts for the trainer."""
        self.url, self.tokenizer, self.eos, self.stop = url, tokenizer, eos, stop
        self.processor = processor
        key = os.environ.get(API_KEY_ENV)
        self.http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {key}"} if key else None,
            timeout=httpx.Timeout(read_timeout, connect=CONNECT_TIMEOUT),
        )  # fmt: skip
        self.read_timeout, self.vocab_size = read_timeout, int(model_shape(model.config)["vocab_size"])
        wait_for_health(self.http, url, timeout, name_or_path)
        info = self._info()
        self.leangrpo = "architectures" in info  # leangrpo's own server: seed lists, weight updates
        self.served, self.max_model_len = info["model"], int(info["max_model_len"] or 0)
        check_model(info, model.config, name_or_path, max_model_len, url)
        # leangrpo's server loads weights only from its own directory (the same path on both sides)
        self.weights_dir = info.get("weights_dir")
        self.sync_lock, self.group_port = threading.Lock(), group_port
        self.communicator: Any = None  # the NCCL group (CUDA), opened at the first sync
        self.lora_rank: int | None = info.get("max_lora_rank")
        self.merged_why: str | None = None  # why syncs of a peft model send it merged, once said
        if self._sends_adapter(model) and self.lora_rank is not None:  # either way said at start
            say_adapter_sync(self.lora_rank)
        self.adapters = 0  # adapters the server loaded
        self.base_changed = bool(info.get("base_changed"))  # an earlier run's update replaced its base
        self.base_ready = False  # the server's base is this run's own, made so before the first adapter
        self.last_sync: SyncStats | None = None

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        eos: list[int],
        processor: Any | None = None,
    ) -> VLLMServerEngine:
        """The training run's: the server `grpo.vllm_server_*` names, long enough for the evaluation too;
        `processor`: a vision-language model's."""
        g = cfg.grpo
        say_4bit_base(cfg)
        url = server_url(g.vllm_server_base_url, g.vllm_server_host, g.vllm_server_port)
        return cls(
            url, model, cfg.model.name_or_path, tokenizer, eos, timeout=g.vllm_server_timeout,
            read_timeout=g.vllm_server_read_timeout, max_model_len=run_context(cfg) or 0,
            group_port=g.vllm_group_port, processor=processor,
        )  # fmt: skip

    def generate(
        self,
        prompt_texts: list[str],
        sampling: Sampling,
        toolboxes: list[Toolbox] | None = None,
        images: list[list[Any]] | None = None,
    ) -> RolloutBatch:
        """As VLLMEngine.generate, each completion its own request and seed (drawn here, from torch's RNG or
        the rollout's own, `sampling.seed`); `images` (one list a prompt) only to leangrpo's own server."""
        if images is not None and not self.leangrpo:
            raise VLLMError(
                f"the vLLM server at {self.url} is not leangrpo's: its /v1/completions takes no images; "
                "start it with: leangrpo vllm-serve"
            )
        return sampled_batch(
            self.tokenizer, self.eos, prompt_texts, sampling, toolboxes, self._sample, self.max_model_len,
            images, self.processor,
        )  # fmt: skip

    def _sample(
        self, prompts: Sequence[Prompt], sampling: Sampling, rng: torch.Generator | None
    ) -> tuple[list[list[int]], list[list[float]]]:
        """One completion of each prompt, token ids or (leangrpo's server only, `generate`) an image
        prompt's text and images."""
        seeds = torch.randint(2**31 - 1, (len(prompts),), generator=rng).tolist()
        body = {"model": self.served, **sampling_fields(sampling, self.eos)}
        if self.leangrpo:  # one request, a seed per prompt
            return self._complete({**body, **image_fields(prompts), "seed": seeds})
        with ThreadPoolExecutor(max_workers=min(32, len(prompts))) as pool:  # vLLM's server batches them
            parts = list(
                pool.map(lambda p, s: self._complete({**body, "prompt": [p], "seed": s}), prompts, seeds)
            )
        return [i for ids, _ in parts for i in ids], [lp for _, logps in parts for lp in logps]

    def _complete(self, body: dict[str, Any]) -> tuple[list[list[int]], list[list[float]]]:
        body = {**body, "return_token_ids": True, "return_tokens_as_token_ids": True}
        answer = self._call("POST", "/v1/completions", json=body)
        try:
            return checked_choices(answer, len(body["prompt"]), self.vocab_size, body["max_tokens"])
        except ValueError as e:
            raise VLLMError(f"the vLLM server at {self.url} answered /v1/completions badly: {e}") from None

    def sync_weights(
        self, model: PreTrainedModel, weights: Iterable[tuple[str, Tensor]] | None = None
    ) -> None:
        """Push `model`'s weights to the server; under several processes (DDP), the first one pushes and
        the others wait for it (`last_sync` says what went, on the first). A LoRA model sends its adapter
        alone where the server serves LoRA (`_adapter_refusal`, said once at start); otherwise only its
        adapted layers, merged: the server takes the rest from its own copy of the base checkpoint. A 4-bit
        base (QLoRA), the checkpoint's weights quantized, goes dequantized: whole before the first adapter,
        its 4-bit layers with every merged sync (`applied_weights`, `adapted_only`).
        `weights` is for in-process engines under FSDP2, which server mode refuses: the weights are read
        from `model`."""
        import torch.distributed as dist

        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        start, adapter, sent = time.perf_counter(), self._sends_adapter(model), 0
        if not several or dist.get_rank() == 0:
            with self.sync_lock, torch.no_grad():
                if adapter:
                    sent = self._send_adapter(cast("PeftModel", model))
                if not sent and model.device.type == "cuda":
                    sent = self._send_nccl(model)
                elif not sent:
                    sent = self._send_file(model)
        if several:
            dist.barrier()
        self.last_sync = SyncStats(sent, time.perf_counter() - start, adapter and self.merged_why is None)

    def _sends_adapter(self, model: PreTrainedModel) -> bool:
        """Whether syncs of `model` send its adapter alone; the first reason they cannot is said once."""
        if not is_peft(model):
            return False
        if self.merged_why is None:
            self._merge_because(self._adapter_refusal(model))
        return self.merged_why is None

    def _adapter_refusal(self, model: PeftModel) -> str | None:
        """Why syncs of `model` cannot send its adapter alone to this server (None: they can)."""
        if not self.leangrpo:
            return None  # generation only: the first sync stops the run (`_send_file`)
        if self.lora_rank is None:
            return f"the vLLM server at {self.url} serves no LoRA (start it with --max-lora-rank)"
        if not self.weights_dir or not Path(self.weights_dir).is_dir():
            return f"the server's weights directory {self.weights_dir!r} (where the adapter goes) is not here"
        return adapter_refusal(model, self.lora_rank)

    def _merge_because(self, why: str | None) -> None:
        if why is not None:
            self.merged_why = say_merged(why)

    def _send_adapter(self, model: PeftModel) -> int:
        """The adapter's tensors as one safetensors file in the server's weights directory, loaded there as
        an adapter (`/load_adapter`, which moves the file into the adapter's own directory); its bytes, or
        0 when the server refused the first one (this sync and the later ones then send merged layers).
        Before the first, the server's base is made this run's (`_own_base`), its bytes counted too."""
        from safetensors.torch import save_file

        base = 0
        if not self.base_ready:
            base = self._own_base(model)
            self.base_ready = True
        path = self.new_weights_file()
        try:
            save_file(adapter_tensors(model), str(path))
            size = path.stat().st_size
            self._call("POST", "/load_adapter", json={"path": str(path), "config": adapter_config(model)})
        except VLLMError as e:
            if self.adapters:
                raise
            self._merge_because(f"the server refused it ({e})")
            return 0
        finally:
            path.unlink(missing_ok=True)
        self.adapters += 1
        return base + size

    def _own_base(self, model: PeftModel) -> int:
        """Make the base the server's adapters go on this run's own; the bytes sent. A 4-bit base (QLoRA)
        goes whole, dequantized (`_send_file`). Otherwise the checkpoint's is the run's, and where an earlier
        run's full or merged update replaced it (/model_info's `base_changed`), the server reloads its
        checkpoint (`/restore_base`): an adapter would otherwise go on that run's weights, silently."""
        if is_4bit(model):
            return self._send_file(cast("PreTrainedModel", model), adapter=False)
        if self.base_changed:
            logger.info(
                "vLLM weight sync: the server holds an earlier run's weights; it reloads its checkpoint"
            )
            try:
                self._call("POST", "/restore_base")
            except VLLMError as e:
                raise VLLMError(
                    f"{e}; restart leangrpo vllm-serve to serve the checkpoint's weights"
                ) from None
            self.base_changed = False
        return 0

    def close(self) -> None:
        """The HTTP connections go; the server and its weights stay for the next run."""
        self.http.close()

    def _send_file(self, model: PreTrainedModel, adapter: bool = True) -> int:
        """One safetensors file, new, in the server's weights directory (which this side must see at the
        same path: the same machine or a shared filesystem), loaded by the server through vLLM's in-place
        reload, then deleted; its bytes. A peft model sends the weights that differ from the checkpoint's
        alone (`applied_weights`' `adapted_only`), which the server completes from the checkpoint; `adapter`
        False: every weight, its LoRA layers' base ones (a 4-bit base, dequantized, before the first
        adapter)."""
        from safetensors.torch import save_file

        if not self.leangrpo:
            raise VLLMError(
                f"the vLLM server at {self.url} is not leangrpo's: it cannot take weight updates from "
                "leangrpo (generation only); start it with: leangrpo vllm-serve"
            )
        partial = is_peft(model) and adapter
        path = self.new_weights_file()
        save_file(weights_to_send(model, partial, adapter), str(path))
        try:
            size = path.stat().st_size
            self._call("POST", "/load_weights", json={"path": str(path), "partial": partial})
        finally:
            path.unlink(missing_ok=True)
        return size

    def _send_nccl(self, model: PreTrainedModel) -> int:
        """CUDA: every weight broadcast on an NCCL group with the server, as TRL's server takes them.
        NOT TESTED on a GPU (benchmarks/gpu_check.py does not reach it); needs vLLM beside the trainer.

        The group's address is this machine's on the interface that routes to the server
        (`address_towards`). Forming the group waits read_timeout at most (the store's timeout); the
        broadcasts run on a stream of their own, and the trainer waits for them as long, or until the
        server's /update_named_params fails or a stop is asked (`wait_for_broadcast`): a server dying
        mid-update is one VLLMError line, not a hang. The group is then dropped (the next sync forms a
        new one); the broadcast left pending on its stream cannot be cancelled (vLLM's NCCL wrapper
        has no abort), so the run checkpoints and ends."""
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        timeout = int(self.read_timeout)
        if self.communicator is None:  # the trainer is rank 0 of {trainer, server}
            host = address_towards(self.url)
            body = {"host": host, "port": self.group_port, "world_size": 2}
            with ThreadPoolExecutor(max_workers=1) as pool:
                joined = pool.submit(self._call, "POST", "/init_communicator", json=body)
                group = StatelessProcessGroup.create(
                    host, self.group_port, rank=0, world_size=2, store_timeout=timeout
                )
                self.communicator = PyNcclCommunicator(group, device=model.device)
                joined.result()
        params = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in applied_weights(model)]
        stream, sent = torch.cuda.Stream(device=model.device), torch.cuda.Event()
        stream.wait_stream(torch.cuda.current_stream(model.device))  # the update's weights are written
        with ThreadPoolExecutor(max_workers=1) as pool:  # the server receives while this side sends
            loaded = pool.submit(self._call, "POST", "/update_named_params", json={"params": params})
            size = 0
            with torch.cuda.stream(stream):
                for _, tensor in applied_weights(model):
                    self.communicator.broadcast(tensor.contiguous(), src=0, stream=stream)
                    size += tensor.nbytes
                sent.record(stream)
            try:
                wait_for_broadcast(sent.query, loaded, timeout, self.stop, self.url)
            except VLLMError:
                self.communicator = None
                raise
        return size

    def new_weights_file(self) -> Path:
        """A new, empty file of a name of its own in the server's weights directory (never a link)."""
        where = Path(str(self.weights_dir or ""))
        if not self.weights_dir or not where.is_absolute() or not where.is_dir() or where.is_symlink():
            raise VLLMError(
                f"the vLLM server at {self.url} loads weights from {self.weights_dir!r}, which is not a "
                "directory on this machine: run the trainer beside it, or start it with --weights-dir "
                "on a filesystem both machines share"
            )
        path = where / f"weights-{uuid.uuid4().hex}.safetensors"
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        return path

    def _info(self) -> dict[str, Any]:
        """leangrpo's /model_info; from another vLLM server, what /v1/models says (name and context)."""
        route, response = "/model_info", self._send("GET", "/model_info")
        if response.status_code != 200:
            route, response = "/v1/models", self._send("GET", "/v1/models")
            self._ok(response, route)
        try:
            answer = json_object(response)
            return checked_info(answer) if route == "/model_info" else checked_models(answer)
        except ValueError as e:
            raise VLLMError(f"the vLLM server at {self.url} answered {route} badly: {e}") from None

    def _call(self, method: str, route: str, **kwargs: Any) -> dict[str, Any]:
        """The route's JSON answer, an object; any failure is one VLLMError line (the trainer checkpoints
        and stops)."""
        response = self._send(method, route, **kwargs)
        self._ok(response, route)
        try:
            return json_object(response)
        except ValueError as e:
            raise VLLMError(f"the vLLM server at {self.url} answered {route} badly: {e}") from None

    def _ok(self, response: httpx.Response, route: str) -> None:
        """Nothing for a 200; else the server's last line of complaint, as one VLLMError line."""
        if response.status_code == 401:
            raise VLLMError(
                f"the vLLM server at {self.url} refused {route} (401): set {API_KEY_ENV} to the key it was "
                "started with (vllm-serve --api-key)"
            )
        if response.status_code != 200:
            detail = response.text.strip().splitlines()[-1:] or [f"HTTP {response.status_code}"]
            raise VLLMError(f"the vLLM server at {self.url} failed {route}: {detail[0][:300]}")

    def _send(self, method: str, route: str, **kwargs: Any) -> httpx.Response:
        """The request, sent from a thread of its own, waited for until it answers (read_timeout at most)
        or a stop is asked for: then the wait ends at once, the request left behind."""
        done, outcome = threading.Event(), list[httpx.Response | BaseException]()

        def request() -> None:
            try:
                outcome.append(self.http.request(method, route, **kwargs))
            except BaseException as e:  # handed to the waiting caller
                outcome.append(e)
            done.set()

        threading.Thread(target=request, daemon=True, name="leangrpo-vllm-request").start()
        while not done.wait(0.2):
            if self.stop():
                raise VLLMError(f"stopped while waiting for the vLLM server at {self.url} to answer {route}")
        if isinstance(outcome[0], httpx.TimeoutException):
            raise VLLMError(
                f"the vLLM server at {self.url} did not answer {route} within {self.read_timeout:g} s "
                "(grpo.vllm_server_read_timeout)"
            ) from outcome[0]
        if isinstance(outcome[0], httpx.HTTPError):
            e = outcome[0]
            raise VLLMError(
                f"the vLLM server at {self.url} stopped answering ({type(e).__name__}: {e})"
            ) from e
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]


def image_fields(prompts: Sequence[Prompt]) -> dict[str, Any]:
    """The /v1/completions fields of `prompts` for leangrpo's server: token ids as they are; image prompts
    (`image_requests`) as their text, with each image once as a base64 PNG (TRL's `pil_to_base64`; the
    group's completions share their prompt's images) and each prompt's images as indexes into them."""
    if not any(isinstance(p, dict) for p in prompts):
        return {"prompt": list(prompts)}
    index: dict[int, int] = {}  # id(image) -> its place in `images`
    images: list[str] = []
    texts, picks = [], []
    for prompt in prompts:
        assert isinstance(prompt, dict)
        picked = []
        for image in prompt["multi_modal_data"]["image"]:
            if id(image) not in index:
                index[id(image)] = len(images)
                images.append(png_base64(image))
            picked.append(index[id(image)])
        texts.append(prompt["prompt"])
        picks.append(picked)
    return {"prompt": texts, "images": images, "prompt_images": picks}


def png_base64(image: Any) -> str:
    """A PIL image as base64 PNG, lossless (the server's vLLM sees the trainer's pixels); one line when it
    cannot be one."""
    buffer = io.BytesIO()
    try:
        image.save(buffer, format="PNG")
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise VLLMError(f"an image prompt's image cannot be sent to the vLLM server as a PNG: {e}") from None
    return base64.b64encode(buffer.getvalue()).decode()


def address_towards(url: str) -> str:
    """This machine's address on the interface that routes to the server at `url`, where the server can
    reach the trainer's NCCL group. `gethostbyname(gethostname())` is often 127.0.1.1 (Debian's
    /etc/hosts entry), which a server on another machine cannot join. Connecting a UDP socket sends
    nothing: it only picks the route. No route is one VLLMError line."""
    parsed = httpx.URL(url)
    host, port = parsed.host, parsed.port or 80
    try:
        family, kind, proto, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(where)
            return str(probe.getsockname()[0])
    except OSError as e:
        raise VLLMError(f"no route from this machine to the vLLM server's host {host!r}: {e}") from None


def wait_for_broadcast(
    sent: Callable[[], bool], loaded: Future[Any], timeout: float, stop: Callable[[], bool], url: str
) -> None:
    """Wait until `sent()` (the broadcast's CUDA event has completed) and the server's answer `loaded`
    came; the server's failure (`loaded` raising), `timeout` seconds or a stop asked for end the wait
    with one VLLMError line, where NCCL alone would wait forever."""
    deadline = time.monotonic() + timeout
    while not (sent() and loaded.done()):
        if loaded.done() and loaded.exception() is not None:
            raise VLLMError(f"the weight update to the vLLM server at {url} failed: {loaded.exception()}")
        if stop():
            raise VLLMError(f"stopped while sending weights to the vLLM server at {url}")
        if time.monotonic() > deadline:
            raise VLLMError(
                f"the vLLM server at {url} did not receive the weights within {timeout:g} s "
                "(grpo.vllm_server_read_timeout)"
            )
        time.sleep(0.05)
    loaded.result()


def json_object(response: httpx.Response) -> dict[str, Any]:
    """The answer's JSON object; ValueError for anything else (not JSON, a list, nested past the parser)."""
    try:
        answer = response.json()
    except (ValueError, RecursionError):
        raise ValueError(f"not JSON ({response.text[:60]!r})") from None
    if not isinstance(answer, dict):
        raise ValueError(f"a JSON {type(answer).__name__}, not an object")
    return answer


def checked_info(info: dict[str, Any]) -> dict[str, Any]:
    """leangrpo's /model_info: the model's name, context, shape fields, weights directory and whether its
    base changed, each of its type."""
    missing = [key for key in ("model", "max_model_len", *SHAPE_FIELDS) if key not in info]
    if missing:
        raise ValueError(f"no {', '.join(missing)}")
    if not isinstance(info["model"], str) or not _count(info["max_model_len"], none=True):
        raise ValueError(f"model {info['model']!r:.60}, max_model_len {info['max_model_len']!r:.60}")
    if not isinstance(info.get("weights_dir"), (str, type(None))):
        raise ValueError(f"weights_dir {info['weights_dir']!r:.60}")
    if not _count(info.get("max_lora_rank"), none=True):
        raise ValueError(f"max_lora_rank {info['max_lora_rank']!r:.60}")
    if not isinstance(info.get("base_changed", False), bool):
        raise ValueError(f"base_changed {info['base_changed']!r:.60}")
    return info


def checked_models(models: dict[str, Any]) -> dict[str, Any]:
    """vLLM's /v1/models: the served model's name and context."""
    data = models.get("data")
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        raise ValueError("no data list of models")
    name, max_len = data[0].get("id"), data[0].get("max_model_len")
    if not isinstance(name, str) or not _count(max_len, none=True):
        raise ValueError(f"model {name!r:.60}, max_model_len {max_len!r:.60}")
    return {"model": name, "max_model_len": max_len}


def _count(value: Any, none: bool = False) -> bool:
    """A non-negative int (not a bool), or None where `none`."""
    return (none and value is None) or (type(value) is int and value >= 0)


def checked_choices(
    answer: dict[str, Any], prompts: int, vocab_size: int, max_tokens: int
) -> tuple[list[list[int]], list[list[float]]]:
    """Each choice's token ids and log-probs from a /v1/completions answer: one choice a prompt, at most
    `max_tokens` ids each inside the vocabulary, one finite log-prob each; ValueError naming what is not."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != prompts:
        found = f"{len(choices)} choices" if isinstance(choices, list) else "no choices list"
        raise ValueError(f"{found} for {prompts} prompts")
    ids, logprobs = [], []
    for i, choice in enumerate(choices):
        tokens = choice.get("token_ids") if isinstance(choice, dict) else None
        logps = choice.get("logprobs") if isinstance(choice, dict) else None
        logps = logps.get("token_logprobs") if isinstance(logps, dict) else None
        if not isinstance(tokens, list) or not isinstance(logps, list):
            raise ValueError(f"choice {i} has no token_ids or logprobs.token_logprobs list")
        if len(tokens) > max_tokens or len(logps) != len(tokens):
            raise ValueError(
                f"choice {i} has {len(tokens)} tokens (max_tokens {max_tokens}), {len(logps)} log-probs"
            )
        if bad := [t for t in tokens if not _count(t) or t >= vocab_size][:1]:
            raise ValueError(f"choice {i} has token {bad[0]!r:.60}, not an id in [0, {vocab_size})")
        if bad_lp := [x for x in logps if type(x) not in (int, float) or not math.isfinite(x)][:1]:
            raise ValueError(f"choice {i} has log-prob {bad_lp[0]!r:.60}, not a finite number")
        ids.append(tokens)
        logprobs.append([float(x) for x in logps])
    return ids, logprobs


def weights_to_send(
    model: torch.nn.Module, adapted_only: bool, adapter: bool = True
) -> dict[str, torch.Tensor]:
    """`applied_weights` as one dict (a tied LM head comes once, as the embedding: vLLM ties it again)."""
    weights = applied_weights(model, adapted_only=adapted_only, adapter=adapter)
    return {name: t.contiguous() for name, t in weights}


def wait_for_health(http: httpx.Client, url: str, timeout: float, name_or_path: str) -> None:
    """Poll GET /health until it answers 200; after `timeout` seconds, one VLLMError line saying how to
    start a server."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            status = http.get("/health", timeout=5.0).status_code
        except httpx.HTTPError:
            status = 0
        if status == 200:
            return
        if status == 401:
            raise VLLMError(
                f"the vLLM server at {url} refused /health (401): set {API_KEY_ENV} to the key it was "
                "started with (vllm-serve --api-key)"
            )
        left = deadline - time.monotonic()
        if left <= 0:
            raise VLLMError(
                f"no vLLM server answered at {url}/health within {timeout:g} s (grpo.vllm_server_timeout); "
                f"start one with: leangrpo vllm-serve --model {name_or_path}"
            )
        time.sleep(min(1.0, left))


def model_shape(config: Any) -> dict[str, Any]:
    """SHAPE_FIELDS of a model config: its architectures, and the rest from its text model's config (a
    vision-language model's language model; a text model's own)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {key: getattr(config if key == "architectures" else text, key, None) for key in SHAPE_FIELDS}


def check_model(info: dict[str, Any], config: Any, name_or_path: str, max_model_len: int, url: str) -> None:
    """Refuse, in one line, a server whose model is not the trainer's: another name (the last part of its
    path or hub id), architecture, vocabulary or shape, or a context window shorter than the run needs."""
    theirs, ours = Path(str(info["model"])).name, Path(name_or_path).name
    differ = [f"model {theirs} ≠ {ours}"] if theirs != ours else []
    for key, value in model_shape(config).items():
        if key in info and info[key] != value:
            differ.append(f"{key} {info[key]} ≠ {value}")
    if info.get("max_model_len") and info["max_model_len"] < max_model_len:
        differ.append(f"max_model_len {info['max_model_len']} < the {max_model_len} this run needs")
    if differ:
        raise VLLMError(
            f"the vLLM server at {url} does not serve this run's model ({'; '.join(differ)}); "
            f"start it with: leangrpo vllm-serve --model {name_or_path}"
        )
