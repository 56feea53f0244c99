"""Daemon logging: one event per line, the journal's format under systemd."""

from __future__ import annotations

import logging
import os
import sys


class OneLineFormatter(logging.Formatter):
    """One event, one line: newlines in messages, ids and tracebacks are escaped, so a
    client-chosen request id cannot forge log lines and the journal keeps an event whole.

    Under systemd (``$JOURNAL_STREAM`` set) the line starts with the syslog priority
    (``<3>`` …), which journald turns into the entry's level, and carries no timestamp
    (the journal has its own).
    """

    _PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3,
                 logging.CRITICAL: 2}

    def __init__(self, journal: bool) -> None:
        fmt = "%(name)s: %(message)s" if journal else "%(asctime)s %(levelname)s %(name)s: %(message)s"
        super().__init__(fmt)
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        text = text.replace("\n", "\\n").replace("\r", "\\r")
        if self.journal:
            return f"<{self._PRIORITY.get(record.levelno, 6)}>{text}"
        return text


def setup_logging(level: str) -> None:
    """Log to stderr, one line per event (the journal's format under systemd)."""
    # At info the daemon logs a line per finished request: skip what our format never
    # shows (caller frame lookup, thread and process names) to keep a line cheap.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter(journal=bool(os.environ.get("JOURNAL_STREAM"))))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper()))
