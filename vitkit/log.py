"""vitkit's messages: every module logs to `logging.getLogger(__name__)` (a child of the "vitkit" logger), none
prints.

The `vitkit` command shows them on standard error (`show()`): an info line as `vitkit: <message>`, a warning as
`vitkit: warning: <message>`. A program that imports vitkit decides for itself, with logging's own configuration:
`logging.basicConfig(level=logging.INFO)`, or `vitkit.log.show()` for the command's lines. Without either, Python
prints warnings and errors (their message alone) and keeps the info quiet, as for any library.

What a command prints as its answer (a table, JSON, a prediction per line, the training progress line) is its
output, not a message, and stays on the stream the command writes it to.
"""
from __future__ import annotations

import logging
import sys

ROOT = "vitkit"


class _Stderr(logging.Handler):
    """Writes to `sys.stderr` as it is when the message comes, not as it was when the handler was made (so a
    redirection, or pytest's capture, sees every line)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging's contract: a handler never raises
            self.handleError(record)


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.levelno >= logging.ERROR:
            return f"vitkit: error: {text}"
        if record.levelno >= logging.WARNING:
            return f"vitkit: warning: {text}"
        return f"vitkit: {text}"


def show(level: int = logging.INFO) -> None:
    """Show vitkit's messages from `level` up on standard error as the `vitkit` command does (once; calling it
    again changes the level)."""
    logger = logging.getLogger(ROOT)
    logger.setLevel(level)
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        handler = _Stderr()
        handler.setFormatter(_Format())
        logger.addHandler(handler)
