"""Errors raised for bad user input: configs, paths, files.

The CLI prints these as one line (no traceback) and exits with status 2, so
each message must name the offending key or file and say how to fix it.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value, override or layout that cannot work.

    ``key`` is the dotted config key at fault (``train.seq_len``), when one is.
    """

    def __init__(self, message: str, key: str | None = None):
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


class UserInputError(ValueError):
    """A file or path given by the user is missing, unreadable or malformed."""


class RunStopped(RuntimeError):
    """A run that stopped itself on purpose (too many skipped steps in a row).

    Not bad input: the CLI prints it as one ``error:`` line and exits 1."""
