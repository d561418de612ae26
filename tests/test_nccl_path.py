"""Server mode's NCCL weight path, the parts a CPU can run (issue 53, item 7): the address the trainer
offers the server, and the wait on a broadcast that a failing server would otherwise leave hanging."""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest
import torch

from leangrpo.engines.vllm import VLLMError
from leangrpo.engines.vllm_client import address_towards, wait_for_broadcast

URL = "http://server:8000"


def test_the_group_address_is_the_one_that_routes_to_the_server():
    """Loopback for a server on this machine; for another machine, an address of the interface that
    routes there, never the 127.0.1.1 that gethostbyname(gethostname()) gives on Debian."""
    assert address_towards("http://127.0.0.1:8000") == "127.0.0.1"
    assert address_towards("http://localhost:8000") in ("127.0.0.1", "::1")
    try:
        remote = address_towards("http://192.0.2.1:8000")  # TEST-NET-1: routed, never reached
    except VLLMError as e:
        assert str(e).startswith("no route from this machine to the vLLM server's host '192.0.2.1'")
        pytest.skip("this machine has no route off itself")
    assert not remote.startswith("127.")


def failed(message: str) -> Future:
    future: Future = Future()
    future.set_exception(VLLMError(message))
    return future


def test_a_server_failing_mid_update_ends_the_wait_in_one_line():
    start = time.monotonic()
    with pytest.raises(
        VLLMError, match=r"^the weight update to the vLLM server at http://server:8000 failed: boom$"
    ):
        wait_for_broadcast(lambda: False, failed("boom"), 60, lambda: False, URL)
    assert time.monotonic() - start < 5


def test_a_broadcast_that_never_completes_times_out():
    pending: Future = Future()
    start = time.monotonic()
    with pytest.raises(
        VLLMError, match=r"did not receive the weights within 0.3 s \(grpo.vllm_server_read_timeout\)"
    ):
        wait_for_broadcast(lambda: False, pending, 0.3, lambda: False, URL)
    assert 0.3 <= time.monotonic() - start < 5
    with pytest.raises(VLLMError, match="^stopped while sending weights"):
        wait_for_broadcast(lambda: False, pending, 60, lambda: True, URL)


def test_a_completed_broadcast_returns():
    done: Future = Future()
    done.set_result({"status": "ok"})
    wait_for_broadcast(lambda: True, done, 1, lambda: False, URL)


class FakeLLM:
    """vllm.LLM as the server's reload uses it: the workers consume the weights iterator."""

    def __init__(self) -> None:
        self.loaded: list[str] = []

    def collective_rpc(self, method, kwargs):
        for name, _ in kwargs["weights_iterator"]:
            self.loaded.append(name)

    def apply_model(self, fn):
        pass

    def reset_prefix_cache(self):
        pass

    @property
    def llm_engine(self):
        return self  # vllm.LLM's engine, for its encoder cache

    def reset_encoder_cache(self) -> None:
        pass


def test_a_trainer_dying_mid_broadcast_ends_the_servers_wait_and_says_restart(tmp_path, monkeypatch):
    """The server's side (issue 53, item 7): the trainer sends the first tensor and dies. The reload
    stops after --nccl-timeout instead of waiting forever with the engine's lock held, the group is
    dropped, and every later request, /health included, is one line saying to restart the server."""
    from leangrpo.engines.vllm_server import NamedParams, Served

    monkeypatch.setattr("torch.empty", lambda shape, dtype, device: torch.zeros(shape, dtype=dtype))
    llm = FakeLLM()
    served = Served("m", llm, 1, tmp_path, nccl_timeout=0.3)
    served.communicator = object()  # joined; the receive below stands in for its broadcast
    arrivals = iter([True])  # the first tensor arrives, then nothing more
    monkeypatch.setattr(served, "_receive", lambda tensor: lambda: next(arrivals, False))
    body = NamedParams(params=[("a", "float32", [2]), ("b", "float32", [3]), ("c", "float32", [1])])
    start = time.monotonic()
    with pytest.raises(VLLMError) as e:
        served.update_named_params(body)
    assert 0.3 <= time.monotonic() - start < 5
    line = str(e.value)
    assert line.startswith(
        "the trainer sent no tensor 2 of 3 (b) within 0.3 s of a weight update (--nccl-timeout)"
    )
    assert line.endswith("restart leangrpo vllm-serve") and "\n" not in line
    assert llm.loaded == ["a"] and served.communicator is None
    assert served.lock.acquire(blocking=False)  # released: nothing waits on it forever
    served.lock.release()
    for request in (served.health, lambda: served.update_named_params(body)):
        with pytest.raises(VLLMError, match="restart leangrpo vllm-serve$"):
            request()


def test_a_whole_broadcast_reloads_every_tensor(tmp_path, monkeypatch):
    from leangrpo.engines.vllm_server import NamedParams, Served

    monkeypatch.setattr("torch.empty", lambda shape, dtype, device: torch.zeros(shape, dtype=dtype))
    llm = FakeLLM()
    served = Served("m", llm, 1, tmp_path, nccl_timeout=0.3)
    served.communicator = object()
    monkeypatch.setattr(served, "_receive", lambda tensor: lambda: True)
    body = NamedParams(params=[("a", "float32", [2]), ("b", "bfloat16", [3])])
    assert served.update_named_params(body) == {"status": "ok"}
    assert llm.loaded == ["a", "b"] and served.health() == {"status": "ok"}
