"""`grpo.vllm_mode: server`, the parts that need no vLLM: TRL's config names and defaults, the trainer
needing no vLLM on CPU, and the client's one-line refusals (no server, another model). The server itself
is tested for real in tests/real_vllm/test_vllm_server.py."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from test_e2e import PYTHONPATH, run_cli, write_config
from test_memory import make_cfg

from leangrpo.cli import main
from leangrpo.config.trl_fields import TRL_DEFAULTS
from leangrpo.engines.types import Sampling
from leangrpo.engines.vllm import VLLMError
from leangrpo.engines.vllm_client import SHAPE_FIELDS, VLLMServerEngine, check_model, server_url
from leangrpo.train.preflight import World, preflight

API_KEY_ENV = "LEANGRPO_VLLM_API_KEY"  # the documented name, shared by vllm-serve and the client
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


# ------------------------------------------------------------------------ a fake server (issue 50)

Answer = Any  # a JSON value, raw text, (status, either), "hang", or a function of the request's body


@contextlib.contextmanager
def fake_server(answers: dict[str, Answer]) -> Iterator[tuple[str, list[tuple[str, str | None]]]]:
    """A tiny HTTP server on 127.0.0.1 answering each route as `answers` says: (its URL, the (route,
    Authorization header) of each request). "hang" answers nothing until the server stops (30 s at most)."""
    stopped, seen = threading.Event(), []

    class Handler(BaseHTTPRequestHandler):
        def answer(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = json.loads(self.rfile.read(length) or "null")
            seen.append((self.path, self.headers.get("authorization")))
            answer = answers.get(self.path, (404, {"detail": "Not Found"}))
            answer = answer(body) if callable(answer) else answer
            if answer == "hang":
                stopped.wait(30)
                return
            status, content = answer if isinstance(answer, tuple) else (200, answer)
            data = (content if isinstance(content, str) else json.dumps(content)).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = answer

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        stopped.set()
        server.shutdown()
        server.server_close()


def model_info(model_dir: Path, weights_dir: Path) -> dict[str, Any]:
    """What leangrpo's server says of the tiny model."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    shape = {key: getattr(config, key) for key in SHAPE_FIELDS}
    return {"model": str(model_dir), "max_model_len": 256, **shape, "weights_dir": str(weights_dir)}


def completions(tokens: int = 3, logprob: float = -1.0) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A good /v1/completions answer: `tokens` tokens (id 5) of each prompt."""

    def answer(body: dict[str, Any]) -> dict[str, Any]:
        choice = {"token_ids": [5] * tokens, "logprobs": {"token_logprobs": [logprob] * tokens}}
        return {"choices": [choice for _ in body["prompt"]]}

    return answer


def engine_on(url: str, model_dir: Path, **kwargs: Any) -> VLLMServerEngine:
    from transformers import AutoConfig

    model = SimpleNamespace(config=AutoConfig.from_pretrained(model_dir))
    return VLLMServerEngine(url, model, str(model_dir), None, [0], timeout=3, **kwargs)  # type: ignore[arg-type]


SAMPLING = Sampling(num_generations=1, max_prompt_length=8, max_completion_length=4)


def choice(tokens: Any, logprobs: Any) -> dict[str, Any]:
    return {"choices": [{"token_ids": tokens, "logprobs": {"token_logprobs": logprobs}}]}


BAD_INFO = [
    ({}, "/model_info badly: no model, max_model_len, architectures"),
    ([], "a JSON list, not an object"),
]
BAD_COMPLETIONS = [
    ("<html>oops</html>", "/v1/completions badly: not JSON"),
    ([], "/v1/completions badly: a JSON list, not an object"),
    ({"object": "text_completion"}, "no choices list for 1 prompts"),
    (choice([10**9], [-1.0]), "token 1000000000, not an id in [0, "),
    (choice([-1], [-1.0]), "token -1, not an id in [0, "),
    (choice(["a", "b"], [-1.0, -1.0]), "token 'a', not an id in [0, "),
    (choice([5, 6, 7], [-1.0]), "choice 0 has 3 tokens (max_tokens 4), 1 log-probs"),
    (choice([5, 6], [-1.0, float("nan")]), "choice 0 has log-prob nan, not a finite number"),
]


@pytest.mark.parametrize(("info", "why"), BAD_INFO, ids=["empty", "list"])
def test_a_bad_model_info_is_one_line(tiny_model_dir, info, why):
    routes = {"/health": {"status": "ok"}, "/model_info": info}
    with (
        fake_server(routes) as (url, _),
        pytest.raises(VLLMError, match="answered /model_info badly") as caught,
    ):
        engine_on(url, tiny_model_dir)
    assert why in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(("answer", "why"), BAD_COMPLETIONS, ids=[
    "non-json", "list", "no-choices", "id-1e9", "id-minus-1", "string-tokens", "short-logprobs", "nan",
])  # fmt: skip
def test_a_bad_completion_is_one_line(tiny_model_dir, tmp_path, answer, why):
    """Each of issue 50's bad answers (case 16) is one VLLMError line naming what is wrong."""
    routes = {"/health": {}, "/model_info": model_info(tiny_model_dir, tmp_path), "/v1/completions": answer}
    with fake_server(routes) as (url, _):
        engine = engine_on(url, tiny_model_dir)
        with pytest.raises(
            VLLMError, match="^the vLLM server at .* answered /v1/completions badly: "
        ) as caught:
            engine._sample([[1, 2]], SAMPLING, None)
    assert why in str(caught.value) and "\n" not in str(caught.value)


def test_a_good_completion_passes(tiny_model_dir, tmp_path):
    routes = {
        "/health": {}, "/model_info": model_info(tiny_model_dir, tmp_path), "/v1/completions": completions(),
    }  # fmt: skip
    with fake_server(routes) as (url, _):
        engine = engine_on(url, tiny_model_dir)
        assert engine._sample([[1, 2], [3]], SAMPLING, None) == ([[5] * 3] * 2, [[-1.0] * 3] * 2)


def test_a_server_that_never_answers_times_out_or_stops(tiny_model_dir, tmp_path):
    """A read is bounded (grpo.vllm_server_read_timeout), and a stop asked for ends the wait at once."""
    routes = {"/health": {}, "/model_info": model_info(tiny_model_dir, tmp_path), "/v1/completions": "hang"}
    with fake_server(routes) as (url, _):
        engine = engine_on(url, tiny_model_dir, read_timeout=1.0)
        start = time.monotonic()
        with pytest.raises(VLLMError, match=r"did not answer /v1/completions within 1 s \(grpo.vllm_server_"):
            engine._sample([[1, 2]], SAMPLING, None)
        assert time.monotonic() - start < 5
        asked = time.monotonic() + 0.5
        engine = engine_on(url, tiny_model_dir, stop=lambda: time.monotonic() > asked)
        with pytest.raises(
            VLLMError, match="^stopped while waiting for the vLLM server at .* /v1/completions$"
        ):
            engine._sample([[1, 2]], SAMPLING, None)
        assert time.monotonic() - asked < 2


def test_an_adapter_only_run_has_a_changed_base_restored_or_stops_in_one_line(tiny_model_dir, tmp_path):
    """Where /model_info says an earlier run's update changed the server's base, the client asks the server
    to reload its checkpoint (/restore_base) before its first adapter, once; not otherwise. A server that
    cannot is one line saying to restart it; a base_changed that is not a bool, one line too."""
    import torch

    model = torch.nn.Linear(2, 2)  # no 4-bit weights: the checkpoint's base is the run's
    failed = (500, {"detail": "loading the updated weights failed: no space"})
    for changed, restore, requests in [(False, {}, []), (True, {}, ["/restore_base"]), (True, failed, None)]:
        info = {**model_info(tiny_model_dir, tmp_path), "base_changed": changed}
        with fake_server({"/health": {}, "/model_info": info, "/restore_base": restore}) as (url, seen):
            engine = engine_on(url, tiny_model_dir)
            if requests is None:
                with pytest.raises(VLLMError) as caught:
                    engine._own_base(model)  # type: ignore[arg-type]
                assert str(caught.value) == (
                    f"the vLLM server at {url} failed /restore_base: {json.dumps(failed[1])}; "
                    "restart leangrpo vllm-serve to serve the checkpoint's weights"
                )
                continue
            assert engine._own_base(model) == engine._own_base(model) == 0  # type: ignore[arg-type]
        assert [route for route, _ in seen][2:] == requests
    info = {**model_info(tiny_model_dir, tmp_path), "base_changed": "yes"}
    with fake_server({"/health": {}, "/model_info": info}) as (url, _), pytest.raises(VLLMError) as caught:
        engine_on(url, tiny_model_dir)
    assert str(caught.value) == f"the vLLM server at {url} answered /model_info badly: base_changed 'yes'"


def test_the_key_goes_with_every_request_and_a_refusal_is_one_line(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "s3cret")
    routes = {
        "/health": {},
        "/model_info": model_info(tiny_model_dir, tmp_path),
        "/v1/completions": completions(),
    }
    with fake_server(routes) as (url, seen):
        engine_on(url, tiny_model_dir)._sample([[1]], SAMPLING, None)
    assert [route for route, _ in seen] == ["/health", "/model_info", "/v1/completions"]
    assert {key for _, key in seen} == {"Bearer s3cret"}
    with fake_server({"/health": (401, {"detail": "key"})}) as (url, _):
        start = time.monotonic()
        with pytest.raises(VLLMError, match=f"refused /health \\(401\\): set {API_KEY_ENV} to the key"):
            engine_on(url, tiny_model_dir)
        assert time.monotonic() - start < 2  # at once, not after grpo.vllm_server_timeout


def test_weights_go_only_into_the_servers_own_directory(tiny_model_dir, tmp_path):
    """The client writes each weights file, new, in the directory /model_info names; a directory this side
    does not have is one line."""
    routes = {"/health": {}, "/model_info": model_info(tiny_model_dir, tmp_path)}
    with fake_server(routes) as (url, _):
        path = engine_on(url, tiny_model_dir).new_weights_file()
    assert path.parent == tmp_path and path.name.startswith("weights-") and path.stat().st_size == 0
    routes = {"/health": {}, "/model_info": model_info(tiny_model_dir, tmp_path / "elsewhere")}
    with fake_server(routes) as (url, _), pytest.raises(VLLMError, match="not a directory on this machine"):
        engine_on(url, tiny_model_dir).new_weights_file()


@pytest.mark.parametrize("second", ["hang", "nan"])
def test_a_run_stops_on_a_hung_or_bad_answer_with_the_step_before_checkpointed(
    tmp_path, tiny_model_dir, gsm8k_dir, second
):
    """`leangrpo train` on a fake server whose second /v1/completions answer never comes (one SIGTERM:
    exit 143 within seconds) or carries a NaN log-prob (exit 2, one line); either way step 1 is saved."""
    calls = []

    def answer(body: dict[str, Any]) -> Any:
        calls.append(1)
        if len(calls) == 1:
            return completions()(body)
        return "hang" if second == "hang" else completions(logprob=float("nan"))(body)

    weights = tmp_path / "weights"
    weights.mkdir()
    routes = {
        "/health": {}, "/model_info": model_info(tiny_model_dir, weights), "/load_weights": {"status": "ok"},
        "/v1/completions": answer,
    }  # fmt: skip
    with fake_server(routes) as (url, _):
        grpo = {
            "use_vllm": True,
            "vllm_mode": "server",
            "vllm_server_base_url": url,
            "vllm_server_timeout": 5,
        }
        cfg = write_config(
            tmp_path / "run.yaml", tiny_model_dir, gsm8k_dir / "train.jsonl", tmp_path / "run", grpo=grpo,
        )  # fmt: skip
        raw = yaml.safe_load(cfg.read_text())
        raw["eval"] = {"enabled": False}
        raw["logging"] = {**raw.get("logging", {}), "save_steps": 0}
        cfg.write_text(yaml.safe_dump(raw))
        env = {**os.environ, "PYTHONPATH": PYTHONPATH}
        proc = subprocess.Popen(
            [sys.executable, "-m", "leangrpo", "train", "-c", str(cfg)], env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 240
            while len(calls) < 2 and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            if second == "hang":
                time.sleep(0.5)
                proc.send_signal(signal.SIGTERM)
            stopped = time.monotonic()
            output, _ = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert "Traceback" not in output, output
    assert (tmp_path / "run" / "checkpoint-1").is_dir(), output
    if second == "hang":
        assert proc.returncode == 143 and time.monotonic() - stopped < 30, output
        assert "stopped during step 2, its rollout abandoned while still running; resume from step 1" in (
            output
        )
    else:
        bad = f"the vLLM server at {url} answered /v1/completions badly: choice 0 has log-prob nan"
        assert proc.returncode == 2, output
        assert output.strip().splitlines()[-1].startswith(f"error: stopped at step 2: {bad}, not a finite"), (
            output
        )


# ------------------------------------------------------------------------------ the server's side


def test_the_server_listens_on_localhost_by_default():
    from leangrpo.engines.vllm_server import serve

    assert inspect.signature(serve).parameters["host"].default == "127.0.0.1"
    host = next(p for p in main.commands["vllm-serve"].params if p.name == "host")
    assert host.default == "127.0.0.1"


def test_vllm_serve_without_its_extra_names_it_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # `import fastapi` fails, whether installed or not
    result = CliRunner().invoke(main, ["vllm-serve", "--model", "m"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        "error: leangrpo vllm-serve needs vLLM and its server packages (fastapi is missing): "
        "pip install 'leangrpo[vllm]'"
    ]


def test_load_weights_reads_only_the_servers_own_files(tmp_path):
    from leangrpo.engines.vllm_server import own_weights_dir, owned_file

    owned = own_weights_dir(str(tmp_path / "w"))
    assert owned.is_dir()
    good = owned / "weights-1.safetensors"
    good.write_bytes(b"x")
    assert owned_file(str(good), owned) == str(good)
    outside = tmp_path / "secret.safetensors"
    outside.write_bytes(b"x")
    (owned / "link.safetensors").symlink_to(outside)
    (owned / "sub").mkdir()
    for path in (outside, owned / "link.safetensors", owned / "sub", owned / ".." / "secret.safetensors",
                 owned / "missing.safetensors", "weights-1.safetensors"):  # fmt: skip
        with pytest.raises(VLLMError) as caught:
            owned_file(str(path), owned)
        assert str(caught.value).startswith(
            f"/load_weights reads only a file in the server's weights directory {owned}"
        )
        assert "\n" not in str(caught.value)


def test_the_key_is_compared_whole():
    from leangrpo.engines.vllm_server import key_accepted

    assert key_accepted("Bearer k3y", "k3y")
    assert not any(
        key_accepted(h, "k3y") for h in (None, "", "k3y", "Bearer k3", "Bearer k3y ", "bearer k3y")
    )


def png(image: Any) -> str:
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def test_image_prompts_arrive_as_the_trainers_pixels():
    """What `image_fields` sends, the server decodes to the same pixels, each image once however many
    prompts name it, as vLLM's `multi_modal_data` beside each prompt's text; token ids stay ids."""
    from PIL import Image

    from leangrpo.engines.vllm_client import image_fields
    from leangrpo.engines.vllm_server import Completion, vllm_prompts

    red, noise = Image.new("RGB", (7, 5), "red"), Image.effect_noise((9, 4), 60).convert("RGB")
    prompts = [{"prompt": f"<image>{i}", "multi_modal_data": {"image": imgs}}
               for i, imgs in enumerate([[red], [red], [noise, red]])]  # fmt: skip
    fields = image_fields(prompts)
    assert len(fields["images"]) == 2 and fields["prompt_images"] == [[0], [0], [1, 0]]
    decoded = vllm_prompts(Completion(**fields))
    assert [p["prompt"] for p in decoded] == ["<image>0", "<image>1", "<image>2"]  # type: ignore[index]
    for sent, got in zip(prompts, decoded, strict=True):
        for a, b in zip(sent["multi_modal_data"]["image"], got["multi_modal_data"]["image"], strict=True):  # type: ignore[index]
            assert a.size == b.size and a.tobytes() == b.tobytes()
    assert image_fields([[1, 2]]) == {"prompt": [[1, 2]]}
    assert vllm_prompts(Completion(prompt=[[1, 2], "text"])) == [[1, 2], {"prompt": "text"}]


def bad_images() -> list[tuple[dict[str, Any], str, dict[str, int]]]:
    """(request fields, the start of the one line refusing them, server bounds to lower first)."""
    import base64
    import io

    from PIL import Image

    def fields(images: list[str], picks: Any = ((0,),), prompt: Any = ("a",)) -> dict[str, Any]:
        return {"prompt": list(prompt), "images": images, "prompt_images": [list(p) for p in picks]}

    good = png(Image.new("RGB", (4, 4), "red"))
    cut = base64.b64encode(base64.b64decode(good)[:-30]).decode()
    jpeg = io.BytesIO()
    Image.new("RGB", (4, 4)).save(jpeg, format="JPEG")
    return [
        (fields(["not base64!"]), "image 0 is not a base64 PNG", {}),
        (fields([base64.b64encode(jpeg.getvalue()).decode()]), "image 0 is not a base64 PNG", {}),
        (fields([cut]), "image 0 is not a PNG that decodes", {}),
        (fields([png(Image.new("1", (64, 65)))]), "image 0 is 64x65, over 4096 pixels",
         {"MAX_IMAGE_PIXELS": 4096}),
        (fields([good] * 3), "3 images in one request, over the 2", {"MAX_IMAGES": 2}),
        (fields([good]), "image 0 is over 10 bytes", {"MAX_IMAGE_BYTES": 10}),
        (fields([good] * 2), "the request's images are over 100 bytes together",
         {"MAX_REQUEST_IMAGE_BYTES": 100}),
        (fields([good] * 2), "the request's images are over 20 pixels together", {"MAX_REQUEST_PIXELS": 20}),
        (fields([good], [[1]]), "prompt_images names images [1] of the 1", {}),
        (fields([good], [[0], [0]]), "prompt_images has 2 lists for 1", {}),
        (fields([good], prompt=[[1, 2]]), "a prompt with images must be its text", {}),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(11))
def test_bad_images_are_one_line_on_the_server(case, monkeypatch):
    """The server's input is untrusted: images that are not PNGs, cut short, over its bounds (each
    checked here with the bound lowered), or named wrong are one VLLMError line, before vLLM sees them."""
    from leangrpo.engines import vllm_server

    fields, why, bounds = bad_images()[case]
    for name, value in bounds.items():
        monkeypatch.setattr(vllm_server, name, value)
    with pytest.raises(VLLMError) as caught:
        vllm_server.vllm_prompts(vllm_server.Completion(**fields))
    assert str(caught.value).startswith(why) and "\n" not in str(caught.value), str(caught.value)


def test_image_prompts_to_another_server_are_one_line(tiny_model_dir):
    """vLLM's own server (`vllm serve`, `trl vllm-serve`) takes no images in /v1/completions: image prompts
    to it are refused before anything is sent."""
    from PIL import Image

    models = {"data": [{"id": str(tiny_model_dir), "max_model_len": 256}]}
    with fake_server({"/health": {}, "/v1/models": models}) as (url, seen):
        engine = engine_on(url, tiny_model_dir)
        with pytest.raises(VLLMError) as caught:
            engine.generate(["<image>?"], SAMPLING, images=[[Image.new("RGB", (4, 4))]])
    assert str(caught.value) == (
        f"the vLLM server at {url} is not leangrpo's: its /v1/completions takes no images; start it with: "
        "leangrpo vllm-serve"
    )
    assert "/v1/completions" not in [route for route, _ in seen]
