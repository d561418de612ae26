"""The base of every user-facing error: the CLI prints its one-line message and exits non-zero."""


class UserError(Exception):
    """Bad input (config, data, model path, reward function...), reported as one line."""
