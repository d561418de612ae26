"""Graceful stop: SIGINT/SIGTERM ask the training loop to finish its step and save, instead of dying."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# What signal.signal returns and accepts: a function, SIG_DFL/SIG_IGN, or None (set outside Python).
_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class StopSignals:
    """While active, the first SIGINT or SIGTERM sets `requested`; a second one aborts at once.

    The handler only sets a flag and writes with os.write (safe inside a signal handler); the loop
    checks the flag between steps. Outside the main thread (where handlers cannot be set) it is inert.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, _Handler] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in _SIGNALS}
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.requested:  # a second SIGTERM: the sender means it (the last checkpoint stays intact)
            os.write(2, b"\nSIGTERM again: aborting now\n")
            raise SystemExit(128 + signum)
        self.requested = True
        name = signal.Signals(signum).name
        os.write(
            2, f"\n{name}: finishing this step, then saving a checkpoint (Ctrl-C again aborts)\n".encode()
        )
