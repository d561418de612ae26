"""The base of every user-facing error: the CLI prints its one-line message and exits non-zero."""


class UserError(Exception):
    """Bad input (config, data, model path, reward function...), reported as one line."""


class DeviceOptionError(UserError, RuntimeError):
    """A memory option was asked for on a machine that cannot provide it."""


def os_reason(e: OSError) -> str:
    """The OS's words for a failed file operation, with its errno: `No space left on device (errno 28)`."""
    return f"{e.strerror or e} (errno {e.errno})" if e.errno else str(e)


def error_reason(e: BaseException) -> str:
    """Why a read or write failed, in one line: the OSError in the exception's chain (torch.save wraps it
    in a RuntimeError, `unexpected pos ...`), else the error's own first line (safetensors puts the OS's
    words in its message)."""
    cause: BaseException | None = e
    while cause is not None:
        if isinstance(cause, OSError):
            return os_reason(cause)
        cause = cause.__cause__ or cause.__context__
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


class TrainingError(UserError, RuntimeError):
    """The run cannot go on as configured or trained: too many non-finite steps in a row, weights that are
    not finite, an engine that failed, an option this run cannot honour."""


class Stopped(Exception):
    """The run stopped because a signal asked it to, after saving what could be saved and saying how to
    resume; the CLI prints `message` and exits with `exit_code` (128 + the signal: 130, 143)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


_stop_asked: list[int] = []  # the signal a run was asked to stop by (run/signals.py's StopSignals)


def ask_stop(signum: int | None) -> None:
    """Record (a signal number) or forget (None) that the run was asked to stop: what waits below the run
    layer on something outside the process (a vLLM server's answer) gives up when it sees it. A plain
    list append, safe inside a signal handler."""
    if signum is None:
        _stop_asked.clear()
    else:
        _stop_asked.append(signum)


def stop_asked() -> bool:
    """Whether the run was asked to stop (SIGINT or SIGTERM while StopSignals is active)."""
    return bool(_stop_asked)
