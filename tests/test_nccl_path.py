"""Server mode's NCCL weight path, the parts a CPU can run (issue 53, item 7): the address the trainer
offers the server, and the wait on a broadcast that a failing server would otherwise leave hanging."""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest

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
