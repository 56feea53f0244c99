"""Errors that end the daemon's start-up with one line and exit code 2."""

from __future__ import annotations


class StartupError(RuntimeError):
    """The daemon cannot start as configured (a lock held by another daemon, a socket
    in use, a model or tokenizer that cannot be loaded). The CLI prints the message as
    one line and exits 2, like a config error."""
