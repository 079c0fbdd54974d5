"""Training checkpoints: actor, optimizer, RNG and trainer state; atomic; resumable.

Layout under `<out_dir>/checkpoints/`:

    step_<N>/
        model/                 Actor.save: Megatron dist-checkpoint + tlt_model.json (+ tokenizer)
        optim_rank<r>.pt       optimizer.state_dict() of global rank r (torch.save)
        rng_rank<r>.pt         python / numpy / torch CPU / CUDA / Megatron-tracker RNG states
        extra_rank<r>.pt       optional per-rank caller state (e.g. a replay buffer)
        trainer_state.json     step, consumed samples, anything the caller adds (JSON)
        manifest.json          written last inside the directory: format, step, world/TP/PP, files
    latest                     the step of the newest complete checkpoint, written LAST

Atomicity: every rank writes into `step_<N>.partial/`; after a barrier rank 0 writes
the manifest, renames the directory to `step_<N>` and only then replaces `latest`
(write to a temporary file + `os.replace`). A crash at any point leaves either the
previous checkpoint as `latest` or the new one complete; `*.partial` directories are
never loaded (and are removed by the next save). Saving a step that exists (a rerun)
first renames the old directory to `step_<N>.replaced`, removed only after the tracker is
written; `resolve` resumes from it if a crash came between the two renames. `keep_last`
complete checkpoints are kept (0 keeps all); the one `latest` names is never removed.

Loading checks before touching any state: the directory is complete (its manifest and
every file it lists exist), it was written with the same world size / TP / PP (the
optimizer and RNG states are per rank), and the model it holds has the actor's
architecture (a different shape is a CheckpointError naming the field, from
`mcore_ckpt.check_same_arch`).

Collective: `save` and `load` must be called on every rank.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
from typing import Any, Optional

import torch

from megatron_tlt.atomic_io import write_text
from megatron_tlt.errors import CheckpointError
from megatron_tlt.models import mcore_ckpt

log = logging.getLogger(__name__)

FORMAT = "megatron_tlt.train_ckpt/1"
TRACKER = "latest"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
MODEL_DIR = "model"
_STEP_RE = re.compile(r"^step_(\d+)$")
REPLACED = ".replaced"
"""Suffix of a step directory set aside while the same step is saved again."""


# ---- distributed helpers --------------------------------------------------------------

def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    d = _dist()
    return d.get_rank() if d else 0


def _world() -> int:
    d = _dist()
    return d.get_world_size() if d else 1


def _barrier() -> None:
    d = _dist()
    if d:
        d.barrier()


def _parallel_sizes() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 1
    return ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()


# ---- RNG state ------------------------------------------------------------------------

def rng_state() -> dict:
    """Every RNG this process draws from, in a form `torch.load(weights_only=True)` reads."""
    import numpy as np

    py = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]),
                  int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "tracker": None,
    }
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        tracker = get_cuda_rng_tracker()
        if tracker.is_initialized():
            state["tracker"] = {k: v.clone() for k, v in tracker.get_states().items()}
    except ImportError:  # pragma: no cover - megatron-core is a hard dependency
        pass
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np

    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if state.get("tracker") is not None:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states(state["tracker"])


# ---- the checkpointer -----------------------------------------------------------------

@contextlib.contextmanager
def _unwrapped(actor):
    """The actor with its bare GPTModel (Megatron's DDP wrapper would prefix every
    sharded key with 'module.'); parameters are shared, so loading in place is seen
    by the wrapper too."""
    wrapped = actor.model
    actor.model = mcore_ckpt.unwrap(wrapped)
    try:
        yield actor
    finally:
        actor.model = wrapped


class Checkpointer:
    """Save / find / load training checkpoints under `<out_dir>/checkpoints/`."""

    def __init__(self, out_dir: str, keep_last: int = 2):
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0, got {keep_last}")
        self.root = os.path.join(os.path.abspath(out_dir), "checkpoints")
        self.keep_last = keep_last

    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"step_{step}")

    # ---- save ------------------------------------------------------------------------
    def save(self, step: int, actor, optimizer, state: dict, *, tokenizer_from: Optional[str] = None,
             rank_state: Any = None) -> str:
        """Collective. Write checkpoint `step` and point `latest` at it; returns its path.

        state: JSON-serialisable trainer state (same on every rank; rank 0 writes it);
        `step` is stored in it. rank_state: optional per-rank object (torch.save)."""
        final = self.step_dir(step)
        partial = final + ".partial"
        rank, world = _rank(), _world()
        if rank == 0:
            os.makedirs(self.root, exist_ok=True)
            for name in os.listdir(self.root):  # debris of crashed saves
                if name.endswith(".partial"):
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
            os.makedirs(partial)
        _barrier()
        with _unwrapped(actor):
            actor.save(os.path.join(partial, MODEL_DIR), tokenizer_from=tokenizer_from)
        torch.save(optimizer.state_dict(), os.path.join(partial, f"optim_rank{rank}.pt"))
        torch.save(rng_state(), os.path.join(partial, f"rng_rank{rank}.pt"))
        if rank_state is not None:
            torch.save(rank_state, os.path.join(partial, f"extra_rank{rank}.pt"))
        _barrier()
        if rank == 0:
            tp, pp = _parallel_sizes()
            full_state = dict(state, step=step)
            with open(os.path.join(partial, TRAINER_STATE), "w", encoding="utf-8") as f:
                json.dump(full_state, f, indent=2)
            files = sorted(n for n in os.listdir(partial) if n != MANIFEST)
            write_text(os.path.join(partial, MANIFEST), json.dumps(
                {"format": FORMAT, "step": step, "world_size": world, "tp": tp, "pp": pp,
                 "files": files}, indent=2))
            if os.path.exists(final):  # re-saving a step (e.g. a rerun): set the old one aside,
                aside = final + REPLACED  # removed once the tracker names the new one (a crash
                if os.path.exists(aside):  # in between resumes from it: resolve)
                    shutil.rmtree(aside)
                os.replace(final, aside)
            os.replace(partial, final)
            write_text(os.path.join(self.root, TRACKER), f"{step}\n")
            for name in os.listdir(self.root):
                if name.endswith(REPLACED):
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
            self._prune(keep=step)
            log.info("checkpoint %s written", final)
        _barrier()
        return final

    def complete_steps(self) -> list[int]:
        """Steps of complete checkpoint directories, ascending."""
        if not os.path.isdir(self.root):
            return []
        steps = []
        for name in os.listdir(self.root):
            m = _STEP_RE.match(name)
            if m and os.path.isfile(os.path.join(self.root, name, MANIFEST)):
                steps.append(int(m.group(1)))
        return sorted(steps)

    def _prune(self, keep: int) -> None:
        if self.keep_last == 0:
            return
        steps = [s for s in self.complete_steps() if s != keep]
        for s in steps[: max(0, len(steps) - (self.keep_last - 1))]:
            shutil.rmtree(self.step_dir(s), ignore_errors=True)

    # ---- find ------------------------------------------------------------------------
    def latest_step(self) -> Optional[int]:
        """The step `latest` names, or None when there is no tracker."""
        path = os.path.join(self.root, TRACKER)
        if not os.path.isfile(path):
            return None
        text = open(path, encoding="utf-8").read().strip()
        if not text.isdigit():
            raise CheckpointError(f"{path}: corrupt checkpoint tracker (expected a step number, got {text!r})")
        return int(text)

    def resolve(self, resume: str) -> Optional[str]:
        """The checkpoint directory to resume from, or None to start fresh.

        resume: 'none'; 'auto' (the step in `latest`; without a tracker the newest
        complete step directory, if any); or a checkpoint directory path."""
        if resume == "none":
            return None
        if resume == "auto":
            step = self.latest_step()
            if step is None:
                steps = self.complete_steps()
                if not steps:
                    return None
                log.warning("%s has no '%s' tracker; resuming from the newest complete checkpoint "
                            "step_%d", self.root, TRACKER, steps[-1])
                step = steps[-1]
            path = self.step_dir(step)
            if not os.path.exists(path) and os.path.isdir(path + REPLACED):
                # a crash while re-saving this step, between setting the old directory aside
                # and renaming the new one: the old one is still complete
                log.warning("%s is missing; resuming from %s (a re-save of that step was "
                            "interrupted)", path, path + REPLACED)
                path += REPLACED
            verify_complete(path, f"{os.path.join(self.root, TRACKER)} names step {step}, but")
            return path
        path = os.path.abspath(resume)
        verify_complete(path, "train.resume:")
        return path

    # ---- load ------------------------------------------------------------------------
    def load(self, path: str, actor, optimizer=None, *, load_rng: bool = True) -> dict:
        """Collective. Restore the actor (and optimizer, RNG) from checkpoint `path`;
        returns the trainer state (with `step`, and `_rank_state` when one was saved).

        Megatron's mixed-precision optimizers keep fp32 master copies of the weights;
        they are refreshed from the loaded model (`reload_model_params`) before the
        optimizer state is loaded."""
        manifest = verify_complete(path, "cannot resume:")
        rank, world = _rank(), _world()
        tp, pp = _parallel_sizes()
        for key, ours in (("world_size", world), ("tp", tp), ("pp", pp)):
            if manifest.get(key) != ours:
                raise CheckpointError(f"{path}: written with {key}={manifest.get(key)} but this run has "
                                      f"{key}={ours}; optimizer and RNG states are per rank")
        with _unwrapped(actor):
            actor.load(os.path.join(path, MODEL_DIR))
        if optimizer is not None:
            reload = getattr(optimizer, "reload_model_params", None)
            if callable(reload):
                reload()
            optimizer.load_state_dict(_torch_load(os.path.join(path, f"optim_rank{rank}.pt")))
        if load_rng:
            set_rng_state(_torch_load(os.path.join(path, f"rng_rank{rank}.pt")))
        with open(os.path.join(path, TRAINER_STATE), encoding="utf-8") as f:
            state = json.load(f)
        extra = os.path.join(path, f"extra_rank{rank}.pt")
        if os.path.isfile(extra):
            state["_rank_state"] = torch.load(extra, weights_only=False)
        _barrier()
        log.info("resumed from %s (step %d)", path, state["step"])
        return state


def _torch_load(path: str):
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def verify_complete(path: str, context: str = "") -> dict:
    """The manifest of checkpoint directory `path`; CheckpointError unless complete."""
    pre = f"{context} " if context else ""
    if path.rstrip("/").endswith(".partial"):
        raise CheckpointError(f"{pre}{path} is a partial checkpoint (an interrupted save); it is never loaded")
    if not os.path.isdir(path):
        raise CheckpointError(f"{pre}checkpoint directory {path} does not exist")
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        raise CheckpointError(f"{pre}{path} is not a complete checkpoint ({MANIFEST}, written last, is missing)")
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{mpath}: corrupt manifest ({e.msg})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mpath}: unknown checkpoint format {manifest.get('format')!r} (expected {FORMAT})")
    missing = [n for n in manifest.get("files", []) if not os.path.exists(os.path.join(path, n))]
    if missing:
        raise CheckpointError(f"{pre}{path} is incomplete: {', '.join(missing)} missing")
    if not os.path.isfile(os.path.join(path, MODEL_DIR, mcore_ckpt.META_FILE)):
        raise CheckpointError(f"{pre}{path} is incomplete: {MODEL_DIR}/{mcore_ckpt.META_FILE} missing")
    return manifest
