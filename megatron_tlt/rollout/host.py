"""Host-side helpers of the per-step bookkeeping (this code runs on every engine step,
while the device waits for its inputs)."""

from __future__ import annotations

import numpy as np
import torch


def int64_tensor(values) -> torch.Tensor:
    """`torch.tensor(values, dtype=torch.int64)` for a list (or a rectangular list of lists)
    of Python ints: the same CPU tensor, built through numpy, about 3-4x faster on the
    hundreds to thousands of values of a step's int tables (torch.tensor converts element
    by element)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))
