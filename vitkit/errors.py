"""The errors vitkit raises on purpose. The CLI prints their message on one line (exit status 2); any other
exception is a bug and keeps its traceback."""
from __future__ import annotations


class VitkitError(Exception):
    """An expected failure: bad input, a missing or unusable file, a configuration that cannot work."""


class UsageError(VitkitError, ValueError):
    """An argument, option, config value or input that cannot work (also a ValueError, as before)."""


class CheckpointError(VitkitError, ValueError):
    """A checkpoint that is missing, truncated, of an unknown format or that does not fit the model."""
