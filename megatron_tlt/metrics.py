"""Metrics: one JSON line per step (flushed), plus TensorBoard when it is installed.

Only global rank 0 writes; on other ranks every call is a no-op, so callers need no
rank checks. A line is ``{"step": N, "time": <unix seconds>, <name>: <value>, ...}``;
tensors become Python numbers, non-finite floats are written as null (valid JSON).

On resume, `MetricsWriter(..., resume_step=N)` first drops the lines of steps > N
that a crashed run logged after its last checkpoint, so the file reads as one
uninterrupted run.

TensorBoard (`tensorboard=True`): scalars go to `<out_dir>/tensorboard` when
`torch.utils.tensorboard` and the `tensorboard` package import; otherwise one
WARNING and JSONL only.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any, Optional

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def _is_rank0() -> bool:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except ImportError:  # pragma: no cover
        pass
    return int(os.environ.get("RANK", "0")) == 0


def _plain(value: Any) -> Any:
    """JSON-safe Python value: tensors/numpy scalars -> numbers, nan/inf -> None."""
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def read_metrics(path: str) -> list[dict]:
    """All lines of a metrics JSONL file (for tests and tools)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class MetricsWriter:
    def __init__(self, out_dir: str, *, tensorboard: bool = False, resume_step: Optional[int] = None,
                 enabled: Optional[bool] = None, filename: str = METRICS_FILE):
        self.enabled = _is_rank0() if enabled is None else enabled
        self.path = os.path.join(out_dir, filename)
        self._file = None
        self._tb = None
        if not self.enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        if resume_step is not None:
            self._truncate_after(resume_step)
        elif os.path.exists(self.path):
            os.replace(self.path, self.path + ".old")  # a fresh run: keep, but out of the way
        self._file = open(self.path, "a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=os.path.join(out_dir, "tensorboard"),
                                         purge_step=None if resume_step is None else resume_step + 1)
            except ImportError as e:
                log.warning("logging.tensorboard=true but TensorBoard is unavailable (%s); "
                            "writing %s only", e, self.path)

    def _truncate_after(self, step: int) -> None:
        if not os.path.exists(self.path):
            return
        kept = []
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash
                if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
                    kept.append(json.dumps(rec) + "\n")
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict) -> None:
        """Write one line for `step` (flushed) and its numeric values to TensorBoard."""
        if not self.enabled:
            return
        rec = {"step": int(step), "time": round(time.time(), 3)}
        rec.update({str(k): _plain(v) for k, v in metrics.items()})
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in rec.items():
                if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
