"""Output files written whole or not at all: a temporary file in the same directory,
flushed to disk, renamed over the target. A run killed mid-write (or a machine losing
power) leaves the previous file (or none), never a truncated one a rerun or a reader would
trust. Reports, the saved config, checkpoint manifests and the `latest` tracker use it."""

from __future__ import annotations

import json
import os


def write_text(path: str, text: str) -> None:
    """Write `text` to `path` atomically (creating its directory)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{os.path.join(d, os.path.basename(path))}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_json(path: str, obj, **dump_kwargs) -> None:
    """json.dumps(obj, indent=2, **dump_kwargs) written atomically to `path`."""
    write_text(path, json.dumps(obj, indent=2, **dump_kwargs))


def check_output_file(path: str, flag: str = "--json", *, renamed_into_place: bool = True) -> None:
    """Refuse, before the work whose result goes to `path`, a path write_text would fail
    on after it: a directory, a directory part that is a file, or an unwritable directory
    (the nearest one that exists; write_text creates the rest). renamed_into_place=False:
    the caller opens `path` itself, so an existing writable file (or /dev/stdout) is
    enough."""
    from megatron_tlt.errors import TLTError

    if os.path.isdir(path):
        raise TLTError(f"{flag} {path} is a directory, not a file")
    if not renamed_into_place and os.path.exists(path) and os.access(path, os.W_OK):
        return
    d = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(d):
        d = os.path.dirname(d)
    if not os.path.isdir(d):
        raise TLTError(f"{flag} {path}: {d} is a file, not a directory")
    if not os.access(d, os.W_OK | os.X_OK):
        raise TLTError(f"{flag} {path}: directory {d} is not writable")
