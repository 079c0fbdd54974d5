"""User-facing errors.

Anything the user can fix (a config value, a path, a checkpoint, a parallel size)
raises `TLTError` (or `ConfigError`) with a one-line message naming the field and the
value. The CLI prints such errors as one line on stderr and exits with status 2, no
traceback; every other exception is a bug and keeps its traceback.
"""


class TLTError(Exception):
    """Bad input the user can fix; the message is shown as-is, on one line."""


class ConfigError(TLTError, ValueError):
    """An invalid config key or value (also a ValueError, as STYLE.md asks)."""


class CheckpointError(TLTError):
    """A missing, partial, corrupt or mismatched checkpoint."""
