"""Graceful stop: SIGINT/SIGTERM ask the training loop to finish its step and save, instead of dying."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from leangrpo.core.errors import Stopped, ask_stop

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# What signal.signal returns and accepts: a function, SIG_DFL/SIG_IGN, or None (set outside Python).
_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class StopSignals:
    """While active, the first SIGINT or SIGTERM sets `requested` (and `signum`); a second one ends the
    process at once with exit code 128 + its number (130, 143), wherever it is: inside a save, a reward
    or a library that would catch an exception. The last complete checkpoint stays intact (saves are
    atomic), and the run lock dies with the process.

    The handler only sets a flag and writes with os.write (safe inside a signal handler); the loop
    checks the flag between steps. Outside the main thread (where handlers cannot be set) it is inert.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, _Handler] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def stopped(self, message: str) -> Stopped:
        """The exception that ends the run after a requested stop, with the signal's exit code."""
        assert self.signum is not None, "only after a signal"
        return Stopped(message, 128 + self.signum)

    def __enter__(self) -> StopSignals:
        ask_stop(None)
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in _SIGNALS}
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        ask_stop(None)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested:  # a second signal: the sender means it
            os.write(2, f"\n{name} again: aborting now (the last complete checkpoint is intact)\n".encode())
            with contextlib.suppress(Exception):  # what was printed so far (os._exit flushes nothing)
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(128 + signum)
        self.signum = signum
        ask_stop(signum)  # a wait on a server's answer gives up (core.errors.stop_asked)
        os.write(
            2, f"\n{name}: finishing this step, then saving a checkpoint (Ctrl-C again aborts)\n".encode()
        )
