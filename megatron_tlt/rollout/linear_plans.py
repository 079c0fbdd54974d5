"""Which kernel each decode-shaped projection runs, kept so that the same seed gives the
same tokens.

`LinearPlanner` (triton_linear.py) picks each projection's kernel by timing cuBLAS and a
few Triton configs on the device. The candidates round differently (cuBLAS's own
accumulation order against split-K float32 planes summed in a fixed order), so a choice
made by timing is also a choice of numerics: two engines that timed on their own may
decode different tokens from the same seed when two candidates time within noise of each
other. (Seen on an H200: a test comparing a graph engine with an eager one failed while
another process trained on the same GPU, and passed on an idle one.) Two measures keep
DESIGN's "same seed -> same tokens":

- one planner per device per process (`LinearPlanner.shared`): every engine a process
  builds runs the same kernel for the same shape;
- `MEGATRON_TLT_LINEAR_PLANS=PATH.json`: the plans are read from that file at first use
  and every new choice is added to it, so later runs, and ranks that start after it was
  written, make the same choices. The file records the GPU's name; another GPU's file is
  refused (its timings say nothing about this one).

This module needs neither Triton nor a GPU: the config record and the file live here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile

import torch

from megatron_tlt.errors import ConfigError

log = logging.getLogger(__name__)

PLANS_ENV = "MEGATRON_TLT_LINEAR_PLANS"
_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class LinearConfig:
    """How one projection runs: `cublas` (F.linear) or a Triton config."""

    kind: str = "cublas"  # "cublas" | "dot" | "fma"
    block_m: int = 16
    block_n: int = 32
    block_k: int = 256
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __str__(self) -> str:
        if self.kind == "cublas":
            return "cublas"
        return (f"{self.kind}:m{self.block_m}n{self.block_n}k{self.block_k}s{self.splits}"
                f"w{self.num_warps}p{self.num_stages}")


CUBLAS = LinearConfig()

_KINDS = ("cublas", "dot", "fma")


def _key_out(key: tuple) -> list:
    return [f"dtype:{str(v).removeprefix('torch.')}" if isinstance(v, torch.dtype) else v for v in key]


def _key_in(items: list) -> tuple:
    out = []
    for v in items:
        if isinstance(v, str) and v.startswith("dtype:"):
            dt = getattr(torch, v[len("dtype:"):], None)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"unknown dtype {v!r}")
            v = dt
        elif not isinstance(v, (int, str, bool)):
            raise ValueError(f"key entry {v!r}")
        out.append(v)
    return tuple(out)


def _config_in(d) -> LinearConfig | None:
    if d is None:
        return None
    if not isinstance(d, dict) or d.get("kind") not in _KINDS:
        raise ValueError(f"config {d!r}")
    return LinearConfig(**d)


class PlanFile:
    """The plans of one GPU model in a JSON file (module docstring).

    plans: (m, n, k, dtype, split) -> (config, us); fused: (kind, m, n, k, planes, dtype)
    -> (config or None, fused us, unfused us) -- LinearPlanner's two caches."""

    def __init__(self, path: str, device_name: str):
        self.path = os.path.abspath(path)
        self.device_name = device_name

    def read(self) -> tuple[dict, dict]:
        """The file's plans ({} and {} when it does not exist yet); ConfigError when it is
        not a plan file or was written on another GPU model."""
        try:
            with open(self.path) as f:
                raw = json.load(f)
        except FileNotFoundError:
            return {}, {}
        except (OSError, ValueError) as e:
            raise ConfigError(f"{PLANS_ENV}: cannot read {self.path}: {e}") from e
        if not isinstance(raw, dict) or raw.get("format") != _FORMAT:
            raise ConfigError(f"{PLANS_ENV}: {self.path} is not a linear plan file (format {_FORMAT})")
        if raw.get("device") != self.device_name:
            raise ConfigError(f"{PLANS_ENV}: {self.path} holds plans timed on {raw.get('device')!r}, "
                              f"this GPU is {self.device_name!r}; point {PLANS_ENV} at another file "
                              "or delete this one")
        try:
            plans = {_key_in(e["key"]): (_config_in(e["config"]), float(e["us"]))
                     for e in raw.get("plans", [])}
            fused = {_key_in(e["key"]): (_config_in(e["config"]), float(e["fused_us"]),
                                         float(e["unfused_us"]))
                     for e in raw.get("fused", [])}
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{PLANS_ENV}: {self.path} has a malformed entry: {e}") from e
        if any(c is None for c, _ in plans.values()):
            raise ConfigError(f"{PLANS_ENV}: {self.path} has a projection plan without a config")
        return plans, fused

    def write(self, plans: dict, fused: dict) -> tuple[dict, dict]:
        """Add these plans to the file; entries already in it are kept as they are (another
        process may have written them since this one read it). Atomic: written to a
        temporary file beside it, then renamed over it. Returns what the file now holds."""
        disk_plans, disk_fused = self.read()
        plans = {**plans, **disk_plans}
        fused = {**fused, **disk_fused}
        raw = {"format": _FORMAT, "device": self.device_name,
               "plans": [{"key": _key_out(k), "config": dataclasses.asdict(c), "us": us}
                         for k, (c, us) in sorted(plans.items(), key=lambda kv: str(kv[0]))],
               "fused": [{"key": _key_out(k), "config": None if c is None else dataclasses.asdict(c),
                          "fused_us": f_us, "unfused_us": u_us}
                         for k, (c, f_us, u_us) in sorted(fused.items(), key=lambda kv: str(kv[0]))]}
        d = os.path.dirname(self.path)
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".linear_plans.", dir=d)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(raw, f, indent=1)
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return plans, fused


def plan_file_from_env(device: torch.device) -> PlanFile | None:
    """The plan file named by MEGATRON_TLT_LINEAR_PLANS for this CUDA device, or None."""
    path = os.environ.get(PLANS_ENV, "").strip()
    if not path or device.type != "cuda":
        return None
    return PlanFile(path, torch.cuda.get_device_name(device))


class PlanCache:
    """The two caches of a kernel planner (`plans`, `fused`: PlanFile's layouts), kept in
    step with an optional plan file; LinearPlanner (triton_linear.py) adds the timing."""

    _shared: dict[tuple[type, torch.device], PlanCache] = {}

    def __init__(self, plan_file: PlanFile | None = None):
        self.plan_file = plan_file
        self.plans: dict[tuple, tuple[LinearConfig, float]] = {}
        """(m, n, k, dtype, split) -> (config, microseconds per call)."""
        self.fused: dict[tuple, tuple[LinearConfig | None, float, float]] = {}
        """(kind, m, n, k, planes, dtype) -> (config or None, fused us, unfused us)."""
        self.num_tuned = 0
        """Choices this planner timed itself (not read from `plan_file`)."""
        if plan_file is not None:
            self._read_file()
            log.info("linear plans: %d projection and %d fused choices read from %s",
                     len(self.plans), len(self.fused), plan_file.path)

    @classmethod
    def shared(cls, device) -> PlanCache:
        """The process's planner for `device`, created at first use (with the plan file
        MEGATRON_TLT_LINEAR_PLANS names then, if set)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        planner = cls._shared.get((cls, device))
        if planner is None:
            planner = cls._shared[(cls, device)] = cls(plan_file=plan_file_from_env(device))
        return planner

    def _read_file(self) -> None:
        self._take(*self.plan_file.read())

    def _take(self, plans: dict, fused: dict) -> None:
        self.plans.update(plans)  # the file's choice wins: other runs already used it
        self.fused.update(fused)

    def _choose(self, cache: dict, key: tuple, tune):
        """cache[key] (cache: self.plans or self.fused), from tune() when neither this
        planner nor its file has it; a new choice is added to the file."""
        if key not in cache and self.plan_file is not None:
            self._read_file()  # another process may have written it since
        if key not in cache:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"LinearPlanner: {key[:-1]} first seen during CUDA graph "
                                   "capture; run the bucket eagerly first")
            cache[key] = tune()
            self.num_tuned += 1
            if self.plan_file is not None:
                self._take(*self.plan_file.write(self.plans, self.fused))
        return cache[key]
