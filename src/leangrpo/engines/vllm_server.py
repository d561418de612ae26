"""`leangrpo vllm-serve`: one vLLM engine behind a small HTTP API, for `grpo.vllm_mode: server` (the
client is engines/vllm_client.py).

The routes speak vLLM's own (OpenAI-compatible) names and payloads where vLLM has them, so that TRL's
`VLLMClient` can generate from this server and leangrpo's client from `trl vllm-serve` / `vllm serve`:

- `GET /health`, `GET /v1/models`, `GET /get_world_size`, `POST /reset_prefix_cache`;
- `POST /v1/completions`: token ids (or a text) in (`prompt`), token ids and each sampled token's log-prob out
  (`choices[i].token_ids`, `choices[i].logprobs.token_logprobs`), vLLM's SamplingParams fields in the body;
  leangrpo's extensions: `seed` may be a list, one per prompt (each completion its own seed), and image
  prompts of a vision-language model are their text with `images` (each image once, a base64 PNG as TRL's
  `pil_to_base64` sends it) and `prompt_images` (each prompt's, as indexes into `images`), decoded within
  bounds (`decoded_images`) and given to vLLM as `multi_modal_data`;
- `GET /model_info`: what the trainer checks before training (architecture, vocabulary, shapes);
- weight updates: `POST /load_weights` (a safetensors file on a shared filesystem, CPU or GPU), or NCCL
  (`/init_communicator`, `/update_named_params`, `/close_communicator`; CUDA only, not run on a GPU here).
  An NCCL update waits `--nccl-timeout` seconds at most for the trainer (forming the group, then each
  tensor): a trainer that dies mid-broadcast leaves the server refusing every request in one line
  (restart it), not waiting forever with its engine's lock held;
- a LoRA adapter (with `--max-lora-rank`): `POST /load_adapter`, its tensors' safetensors file (as for
  /load_weights) and its adapter_config.json values; completions then sample with it. An adapter goes on the
  base the server holds: /model_info's `base_changed` says whether a weight update (a full or merged one, of
  an earlier run) replaced the checkpoint's since the server loaded it, and `POST /restore_base` reloads the
  checkpoint (an adapter-only run's client asks for it before its first adapter).

On a shared network: it listens on 127.0.0.1 unless `--host` says otherwise; with a key (`--api-key` or
LEANGRPO_VLLM_API_KEY) every route answers 401 to a request without it; `/load_weights` reads only regular
files directly inside its own weights directory (`--weights-dir`, or one it creates), which /model_info
names for the client. fastapi and uvicorn (vLLM's dependencies) are imported only to serve.
"""

from __future__ import annotations

import atexit
import base64
import binascii
import hmac
import io
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor

from leangrpo.engines.vllm import (
    LORA_RANKS,
    Prompt,
    ServedAdapter,
    VLLMError,
    build_llm,
    reload_weights,
    sample_tokens,
)
from leangrpo.engines.vllm_client import API_KEY_ENV, model_shape
from leangrpo.models.load import resolve_model_path

if TYPE_CHECKING:
    from fastapi import FastAPI
    from PIL.Image import Image

MAX_IMAGES = 4096
"""Images one /v1/completions request may carry (each counted once, however many prompts share it)."""
MAX_IMAGE_BYTES, MAX_REQUEST_IMAGE_BYTES = 128 * 2**20, 2**30
"""A PNG's bytes, and all of a request's together."""
MAX_IMAGE_PIXELS, MAX_REQUEST_PIXELS = 89_478_485, 2**29
"""An image's pixels (PIL's own decompression-bomb threshold: a 24-megapixel photo passes), and all of a
request's together: what the decoded images may take in memory (1.5 GiB as RGB)."""


class Completion(BaseModel):
    """vLLM's /v1/completions body, as far as leangrpo and TRL use it: further fields are SamplingParams'."""

    model_config = ConfigDict(extra="allow")

    prompt: list[list[int] | str]
    images: list[str] | None = None  # base64 PNGs, each once
    prompt_images: list[list[int]] | None = None  # each prompt's images, as indexes into `images`
    seed: int | list[int] | None = None
    n: int = 1
    max_tokens: int = 16
    logprobs: int | None = None
    model: str | None = None  # OpenAI's fields that are not sampling settings: accepted, not needed
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False


class WeightsFile(BaseModel):
    """A safetensors file the trainer wrote; `partial`: it holds the changed tensors only (LoRA's adapted
    layers, merged), the rest comes from the served model's own checkpoint."""

    path: str
    partial: bool = False


class AdapterFile(BaseModel):
    """A LoRA adapter: the safetensors file of its tensors the trainer wrote (moved into the adapter's own
    directory), and its adapter_config.json values."""

    path: str
    config: dict[str, Any]


class Communicator(BaseModel):
    """Where the trainer (rank 0) opens the NCCL group the weights are broadcast on."""

    host: str
    port: int
    world_size: int


class NamedParams(BaseModel):
    """(name, dtype, shape) of each tensor the trainer is about to broadcast, in order."""

    params: list[tuple[str, str, list[int]]]


class Served:
    """The engine and what each route does with it; one request at a time uses it (`lock`)."""

    def __init__(
        self,
        model: str,
        llm: Any,
        tensor_parallel_size: int,
        weights_dir: Path,
        max_lora_rank: int | None = None,
        nccl_timeout: float = 600.0,
    ):
        """`weights_dir`: the only directory /load_weights and /load_adapter read from (the adapters' own
        directories go there too). `max_lora_rank`: the rank of adapters `llm` serves (None: none).
        `nccl_timeout`: seconds an NCCL weight update waits for the trainer (forming the group, then each
        tensor)."""
        self.model, self.llm, self.world_size = model, llm, tensor_parallel_size
        self.weights_dir, self.max_lora_rank, self.nccl_timeout = weights_dir, max_lora_rank, nccl_timeout
        self.adapter = None if max_lora_rank is None else ServedAdapter(llm, weights_dir)
        self.lock = threading.Lock()
        self.communicator: Any = None
        self.broken: str | None = None  # why the engine can no longer serve (an update cut short)
        self.base_changed = False  # a weight update replaced (some of) the checkpoint's weights

    def usable(self) -> None:
        """One VLLMError line once an update was cut short: the engine holds partly updated weights."""
        if self.broken is not None:
            raise VLLMError(self.broken)

    def health(self) -> dict[str, str]:
        self.usable()
        return {"status": "ok"}

    def models(self) -> dict[str, Any]:
        max_len = self.llm.llm_engine.model_config.max_model_len
        return {"object": "list", "data": [{"id": self.model, "object": "model", "max_model_len": max_len}]}

    def model_info(self) -> dict[str, Any]:
        config = self.llm.llm_engine.model_config
        shape = model_shape(config.hf_config)
        return {
            "model": self.model, "max_model_len": config.max_model_len, **shape,
            "weights_dir": str(self.weights_dir), "max_lora_rank": self.max_lora_rank,
            "base_changed": self.base_changed,
        }  # fmt: skip

    def get_world_size(self) -> dict[str, int]:
        return {"world_size": self.world_size}

    def complete(self, body: Completion) -> dict[str, Any]:
        """Each prompt's `n` completions, prompt-major as vLLM's server returns them; a seed list gives
        each prompt its own seed (with n > 1, its completions take seed, seed + 1...)."""
        self.usable()
        seeds = body.seed if isinstance(body.seed, list) else [body.seed] * len(body.prompt)
        if len(seeds) != len(body.prompt):
            raise VLLMError(f"{len(seeds)} seeds for {len(body.prompt)} prompts")
        requests = [r for r in vllm_prompts(body) for _ in range(body.n)]
        prompts = [p for p in body.prompt for _ in range(body.n)]
        seeds = [None if s is None else s + k for s in seeds for k in range(body.n)]
        fields = {**(body.model_extra or {}), "max_tokens": body.max_tokens, "logprobs": 0}
        with self.lock:
            adapter = None if self.adapter is None else self.adapter.request
            ids, logprobs = sample_tokens(self.llm, requests, fields, seeds, adapter)
        return {"object": "text_completion", "model": self.model, "choices": [
            {"index": i, "text": "", "prompt_token_ids": prompt, "token_ids": tokens,
             "logprobs": None if body.logprobs is None else {
                 "tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": logps,
                 "top_logprobs": [None] * len(tokens)}}
            for i, (prompt, tokens, logps) in enumerate(zip(prompts, ids, logprobs, strict=True))
        ]}  # fmt: skip

    def load_weights(self, body: WeightsFile) -> dict[str, str]:
        """Reload every weight from the trainer's file (and, when partial, the served checkpoint): a file in
        the server's weights directory, nothing else."""
        self.usable()
        path = owned_file(body.path, self.weights_dir)
        base = checkpoint_files(self.model) if body.partial else []
        with self.lock:
            self.base_changed = True  # before the reload: one cut short leaves it changed too
            reload_weights(self.llm, _reload_from_file, path=path, base=base)
            self._bare()
        return {"status": "ok"}

    def restore_base(self) -> dict[str, str]:
        """Reload the checkpoint the server loaded (vLLM's in-place reload from the model's own path) and
        sample with no adapter: the base an adapter-only run's adapters go on, whatever came before."""
        self.usable()
        with self.lock:
            reload_weights(self.llm)
            self.base_changed = False
            self._bare()
        return {"status": "ok"}

    def load_adapter(self, body: AdapterFile) -> dict[str, str]:
        """Sample with the trainer's adapter from now on: its file (in the server's weights directory,
        nothing else) moves into a new adapter directory there, loaded under a new id."""
        path = owned_file(body.path, self.weights_dir)
        if self.adapter is None:
            raise VLLMError("this server serves no LoRA adapter: start it with --max-lora-rank")
        with self.lock:
            self.adapter.load(body.config, Path(path))
        return {"status": "ok"}

    def _bare(self) -> None:
        """Whole weights were reloaded (LoRA merged into them): sample with no adapter."""
        if self.adapter is not None:
            self.adapter.drop()

    def reset_prefix_cache(self) -> dict[str, str]:
        with self.lock:
            self.llm.reset_prefix_cache()
        return {"status": "ok"}

    def init_communicator(self, body: Communicator) -> dict[str, str]:
        """Join the trainer's NCCL group as rank 1 (CUDA only; not run on a GPU here), waiting
        `nccl_timeout` seconds at most for the trainer to form it (the store's timeout)."""
        self.usable()
        if self.world_size != 1 or not torch.cuda.is_available():
            raise VLLMError("NCCL weight updates need CUDA and --tensor-parallel-size 1; use /load_weights")
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(
            body.host, body.port, rank=1, world_size=body.world_size, store_timeout=int(self.nccl_timeout)
        )
        self.communicator = PyNcclCommunicator(group, device=torch.device("cuda:0"))
        return {"status": "ok"}

    def update_named_params(self, body: NamedParams) -> dict[str, str]:
        """Receive the announced tensors from the trainer's broadcast, one at a time, into the reload. Each
        waits `nccl_timeout` seconds at most: past it the trainer is taken for dead, the group is dropped
        and the server answers every later request with one line saying to restart it (its engine holds
        partly updated weights, and the receive left pending cannot be cancelled: vLLM's NCCL wrapper has
        no abort)."""
        self.usable()
        if self.communicator is None:
            raise VLLMError("no NCCL group: POST /init_communicator first")

        def received() -> Iterator[tuple[str, Tensor]]:
            for i, (name, dtype, shape) in enumerate(body.params):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype), device="cuda")
                what = f"tensor {i + 1} of {len(body.params)} ({name})"
                wait_for_tensor(self._receive(tensor), self.nccl_timeout, what)
                yield name, tensor

        with self.lock:
            self.base_changed = True
            try:
                reload_weights(self.llm, weights_iterator=received())
            except VLLMError as e:
                self.communicator = None
                self.broken = f"{e}; the engine holds partly updated weights: restart leangrpo vllm-serve"
                print(f"leangrpo vllm-serve: {self.broken}", flush=True)
                raise VLLMError(self.broken) from None
            self._bare()
        return {"status": "ok"}

    def _receive(self, tensor: Tensor) -> Callable[[], bool]:
        """Start receiving `tensor` from the trainer (rank 0) on a stream of its own; returns whether it
        has arrived, a poll that never blocks (NCCL alone would wait forever)."""
        stream, arrived = torch.cuda.Stream(), torch.cuda.Event()
        with torch.cuda.stream(stream):
            self.communicator.broadcast(tensor, src=0, stream=stream)
            arrived.record(stream)
        return arrived.query

    def close_communicator(self) -> dict[str, str]:
        self.communicator = None
        return {"status": "ok"}


def vllm_prompts(body: Completion) -> list[Prompt]:
    """Each prompt of `body` as vLLM takes it: its token ids, or its text with its images (`decoded_images`)
    as `multi_modal_data`. An image prompt is text: vLLM would expand the image tokens of ids again."""
    images = decoded_images(body.images or [])
    picks = body.prompt_images if body.prompt_images is not None else [[] for _ in body.prompt]
    if len(picks) != len(body.prompt):
        raise VLLMError(f"prompt_images has {len(picks)} lists for {len(body.prompt)} prompts")
    prompts: list[Prompt] = []
    for prompt, picked in zip(body.prompt, picks, strict=True):
        if len(picked) > MAX_IMAGES or any(not 0 <= i < len(images) for i in picked):
            raise VLLMError(f"prompt_images names images {picked[:8]} of the {len(images)} sent")
        if isinstance(prompt, list) and picked:
            raise VLLMError("a prompt with images must be its text, not token ids")
        if isinstance(prompt, list):
            prompts.append(prompt)
        else:
            mm = {"multi_modal_data": {"image": [images[i] for i in picked]}} if picked else {}
            prompts.append({"prompt": prompt, **mm})
    return prompts


def decoded_images(encoded: list[str]) -> list[Image]:
    """The request's images, each a base64 PNG, decoded within bounds (the server's input is untrusted):
    at most MAX_IMAGES, each at most MAX_IMAGE_BYTES and MAX_IMAGE_PIXELS (read from the PNG's header,
    before decoding), all at most MAX_REQUEST_IMAGE_BYTES and MAX_REQUEST_PIXELS; anything else is one
    VLLMError line naming the image."""
    if len(encoded) > MAX_IMAGES:
        raise VLLMError(f"{len(encoded)} images in one request, over the {MAX_IMAGES} allowed")
    if sum(map(len, encoded)) * 3 // 4 > MAX_REQUEST_IMAGE_BYTES:
        raise VLLMError(f"the request's images are over {MAX_REQUEST_IMAGE_BYTES} bytes together")
    images, pixels = [], 0
    for i, data in enumerate(encoded):
        image = png_image(data, f"image {i}")
        pixels += image.width * image.height
        if pixels > MAX_REQUEST_PIXELS:
            raise VLLMError(f"the request's images are over {MAX_REQUEST_PIXELS} pixels together")
        try:
            image.load()
        except (ValueError, OSError, SyntaxError) as e:  # PIL's errors for a broken or cut PNG
            raise VLLMError(f"image {i} is not a PNG that decodes: {e}") from None
        images.append(image)
    return images


def png_image(data: str, what: str) -> Image:
    """The PNG in base64 `data`, opened (its header read, its pixels not yet decoded), within the bounds of
    one image; one VLLMError line naming `what` otherwise."""
    from PIL import Image

    if len(data) * 3 // 4 > MAX_IMAGE_BYTES:
        raise VLLMError(f"{what} is over {MAX_IMAGE_BYTES} bytes")
    try:
        image = Image.open(io.BytesIO(base64.b64decode(data, validate=True)), formats=["PNG"])
    except (binascii.Error, ValueError, OSError, Image.DecompressionBombError) as e:
        raise VLLMError(f"{what} is not a base64 PNG: {e}") from None
    if image.width * image.height > MAX_IMAGE_PIXELS:
        raise VLLMError(f"{what} is {image.width}x{image.height}, over {MAX_IMAGE_PIXELS} pixels")
    return image


def wait_for_tensor(arrived: Callable[[], bool], timeout: float, what: str) -> None:
    """Return once `arrived()`; one VLLMError line after `timeout` seconds without it."""
    deadline = time.monotonic() + timeout
    while not arrived():
        if time.monotonic() > deadline:
            raise VLLMError(
                f"the trainer sent no {what} within {timeout:g} s of a weight update (--nccl-timeout)"
            )
        time.sleep(0.01)


def owned_file(path: str, weights_dir: Path) -> str:
    """`path` when it names a regular file (not a link) directly inside `weights_dir`; else one VLLMError
    line: /load_weights reads nothing else."""
    given = Path(path)
    inside = given.is_absolute() and os.path.realpath(given.parent) == os.path.realpath(weights_dir)
    try:
        regular = inside and stat.S_ISREG(os.lstat(given).st_mode)
    except OSError:
        regular = False
    if not regular:
        raise VLLMError(
            f"/load_weights reads only a file in the server's weights directory {weights_dir}, "
            f"not {path[:200]!r}"
        )
    return str(given)


def key_accepted(authorization: str | None, key: str) -> bool:
    """Whether an Authorization header carries the server's key (`Bearer KEY`, compared in constant time)."""
    return hmac.compare_digest((authorization or "").encode(), f"Bearer {key}".encode())


def own_weights_dir(weights_dir: str | None) -> Path:
    """The directory /load_weights reads from: `weights_dir` (made if missing), or a new private one
    (mode 700) removed when the server stops."""
    if weights_dir is None:
        made = Path(tempfile.mkdtemp(prefix="leangrpo-vllm-weights-"))
        atexit.register(shutil.rmtree, made, True)
        return made
    path = Path(weights_dir).absolute()
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return Path(os.path.realpath(path))


def _reload_from_file(worker: Any, path: str, base: list[str], is_checkpoint_format: bool) -> None:
    """Run by each vLLM worker (so tensor-parallel ranks read the file themselves): reload in place."""
    weights = file_weights(path, base)
    worker.reload_weights(weights_iterator=weights, is_checkpoint_format=is_checkpoint_format)


def file_weights(path: str, base: list[str]) -> Iterator[tuple[str, Tensor]]:
    """The tensors of safetensors file `path`, one at a time, then every other tensor of the `base`
    checkpoint files, so that each layer is reloaded whole."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        sent = set(f.keys())
        for name in sent:
            yield name, f.get_tensor(name)
    for file in base:
        with safe_open(file, "pt") as f:
            names = f.keys()
            for name in names:
                if name not in sent:
                    yield name, f.get_tensor(name)


def checkpoint_files(model: str) -> list[str]:
    """The served checkpoint's safetensors files (a hub id: its copy in the hub cache, which vLLM filled)."""
    path = Path(resolve_model_path(model))
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(str(path), allow_patterns=["*.safetensors"]))
    files = sorted(str(f) for f in path.glob("*.safetensors"))
    if not files:
        raise VLLMError(f"{model} has no safetensors files to complete a LoRA update from")
    return files


def build_app(served: Served, api_key: str | None = None) -> FastAPI:
    """The HTTP API on `served`; a VLLMError is answered 500 with its one line as `detail`. With
    `api_key`, every request without it is answered 401."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="leangrpo vllm-serve", docs_url=None, redoc_url=None, openapi_url=None)
    routes: list[tuple[str, str, Callable[..., dict[str, Any]]]] = [
        ("GET", "/health", served.health), ("GET", "/v1/models", served.models),
        ("GET", "/model_info", served.model_info), ("GET", "/get_world_size", served.get_world_size),
        ("POST", "/v1/completions", served.complete), ("POST", "/load_weights", served.load_weights),
        ("POST", "/load_adapter", served.load_adapter), ("POST", "/restore_base", served.restore_base),
        ("POST", "/reset_prefix_cache", served.reset_prefix_cache),
        ("POST", "/init_communicator", served.init_communicator),
        ("POST", "/update_named_params", served.update_named_params),
        ("POST", "/close_communicator", served.close_communicator),
    ]  # fmt: skip
    for method, route, handler in routes:
        app.add_api_route(route, handler, methods=[method])

    @app.exception_handler(VLLMError)
    async def one_line(request: Request, e: VLLMError) -> JSONResponse:
        return JSONResponse(status_code=500, content={"detail": str(e)})

    if api_key:

        @app.middleware("http")
        async def require_key(request: Request, call_next: Callable[..., Any]) -> Any:
            if not key_accepted(request.headers.get("authorization"), api_key):
                detail = f"this server needs its key: Authorization: Bearer KEY ({API_KEY_ENV})"
                return JSONResponse(status_code=401, content={"detail": detail})
            return await call_next(request)

    return app


def require_server_packages() -> None:
    """One line naming the extra to install when fastapi or uvicorn (vLLM's own dependencies) is missing."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise VLLMError(
            f"leangrpo vllm-serve needs vLLM and its server packages ({e.name} is missing): "
            "pip install 'leangrpo[vllm]'"
        ) from None


def serve(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    dtype: str = "auto",
    max_model_len: int | None = None,
    gpu_memory_utilization: float = 0.9,
    seed: int = 0,
    trust_remote_code: bool = False,
    api_key: str | None = None,
    weights_dir: str | None = None,
    nccl_timeout: float = 600.0,
    max_lora_rank: int | None = None,
) -> None:
    """Load `model` into vLLM and answer HTTP requests on host:port until stopped (with `api_key`: only
    requests carrying it); weight files are read from `weights_dir` only (default: a new private one).
    `max_lora_rank`: also serve LoRA adapters up to that rank (rounded up to one of vLLM's)."""
    require_server_packages()
    if data_parallel_size != 1:
        raise VLLMError(
            "--data-parallel-size > 1 is not supported: start one server per GPU group instead "
            "(vLLM's offline engine serves one data-parallel rank; TRL refuses it for dense models too)"
        )
    import uvicorn

    lora_rank = None if max_lora_rank is None else next(r for r in LORA_RANKS if r >= max_lora_rank)
    llm = build_llm(
        resolve_model_path(model), max_model_len=max_model_len, dtype=dtype, seed=seed,
        gpu_memory_utilization=gpu_memory_utilization, trust_remote_code=trust_remote_code,
        tensor_parallel_size=tensor_parallel_size, max_lora_rank=lora_rank,
    )  # fmt: skip
    owned = own_weights_dir(weights_dir)
    keyed = "with a key" if api_key else "without a key"
    print(f"leangrpo vllm-serve: {model} on http://{host}:{port} ({keyed}; weights from {owned})", flush=True)
    app = build_app(Served(model, llm, tensor_parallel_size, owned, lora_rank, nccl_timeout), api_key)
    uvicorn.run(app, host=host, port=port, log_level="warning")
