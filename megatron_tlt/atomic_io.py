"""Output files written whole or not at all: a temporary file in the same directory,
renamed over the target. A run killed mid-write leaves the previous file (or none), never
a truncated one a rerun or a reader would trust."""

from __future__ import annotations

import json
import os


def write_text(path: str, text: str) -> None:
    """Write `text` to `path` atomically (creating its directory)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_json(path: str, obj, **dump_kwargs) -> None:
    """json.dumps(obj, indent=2, **dump_kwargs) written atomically to `path`."""
    write_text(path, json.dumps(obj, indent=2, **dump_kwargs))
