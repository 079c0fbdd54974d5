"""Training checkpoints: exact round trip, atomic tracker, keep-last, refusal of
partial / incomplete / mismatched checkpoints."""

from __future__ import annotations

import copy
import json
import os
import random
import shutil

import numpy as np
import pytest
import torch

from megatron_tlt.checkpoint import Checkpointer, verify_complete
from megatron_tlt.errors import CheckpointError


def _arch(**kw):
    from megatron_tlt.models.arch import ModelArch

    base = dict(family="llama", vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128)
    base.update(kw)
    return ModelArch(**base)


@pytest.fixture(scope="module")
def parallel():
    from megatron_tlt.models import mcore

    mcore.init_parallel(1, 1, seed=3)


def _actor_and_opt(arch=None, seed=0):
    from megatron_tlt.models.actor import Actor, MicroBatch, lm_loss
    from megatron_tlt.models.optim import OptimSettings, build_optimizer

    actor = Actor(arch or _arch(), init_seed=seed)
    opt = build_optimizer(actor, OptimSettings(lr=1e-2))
    mb = MicroBatch.make_dummy(batch=2, seq=8, seed=seed)
    opt.zero_grad()
    actor.forward_backward([mb], lambda lg, m: lm_loss(lg, m, actor.arch))
    opt.step()  # non-empty Adam moments
    return actor, opt


def _params(actor):
    return {n: p.detach().clone() for n, p in actor.model.named_parameters()}


def test_round_trip_is_exact(parallel, tmp_path):
    actor, opt = _actor_and_opt()
    ck = Checkpointer(str(tmp_path), keep_last=2)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    path = ck.save(5, actor, opt, {"consumed_samples": 123, "note": "x"}, rank_state={"buffer": [1, 2]})
    assert path == os.path.join(str(tmp_path), "checkpoints", "step_5")
    assert open(os.path.join(ck.root, "latest")).read().strip() == "5"
    want_params = _params(actor)
    want_opt = copy.deepcopy(opt.state_dict())  # state_dict() holds the live tensors
    want_draws = (random.random(), np.random.rand(), torch.rand(3))

    # perturb everything the checkpoint holds
    with torch.no_grad():
        for p in actor.model.parameters():
            p.add_(1.0)
    for st in opt.opt.state.values():
        st["exp_avg"].add_(1.0)
    random.seed(9), np.random.seed(9), torch.manual_seed(9)

    state = ck.load(ck.resolve("auto"), actor, opt)
    assert state["step"] == 5 and state["consumed_samples"] == 123 and state["note"] == "x"
    assert state["_rank_state"] == {"buffer": [1, 2]}
    for n, p in actor.model.named_parameters():
        assert torch.equal(p, want_params[n]), n
    got_opt = opt.state_dict()
    for k, st in want_opt["state"].items():
        for name, t in st.items():
            assert torch.equal(got_opt["state"][k][name], t), (k, name)
    draws = (random.random(), np.random.rand(), torch.rand(3))
    assert draws[0] == want_draws[0] and draws[1] == want_draws[1] and torch.equal(draws[2], want_draws[2])


def test_keep_last_tracker_and_partial_dirs(parallel, tmp_path):
    actor, opt = _actor_and_opt()
    ck = Checkpointer(str(tmp_path), keep_last=2)
    assert ck.resolve("auto") is None and ck.resolve("none") is None
    # debris of a crashed save is never loaded, and is cleaned by the next save
    os.makedirs(os.path.join(ck.root, "step_9.partial", "model"))
    for step in (1, 2, 3):
        ck.save(step, actor, opt, {"consumed_samples": step})
    assert ck.complete_steps() == [2, 3] and not os.path.exists(os.path.join(ck.root, "step_9.partial"))
    assert ck.latest_step() == 3 and ck.resolve("auto").endswith("step_3")

    # a crash after the new directory is renamed but before the tracker moves: the tracker wins
    shutil.copytree(ck.step_dir(3), ck.step_dir(4))
    assert ck.resolve("auto").endswith("step_3")
    # no tracker at all: the newest complete directory
    os.remove(os.path.join(ck.root, "latest"))
    assert ck.resolve("auto").endswith("step_4")

    # a partial directory given explicitly, or named by the tracker, is refused
    partial = ck.step_dir(7) + ".partial"
    shutil.copytree(ck.step_dir(3), partial)
    with pytest.raises(CheckpointError, match="partial checkpoint"):
        ck.resolve(partial)
    os.remove(os.path.join(ck.step_dir(4), "manifest.json"))  # as if the manifest never got written
    with open(os.path.join(ck.root, "latest"), "w") as f:
        f.write("4\n")
    with pytest.raises(CheckpointError, match="names step 4.*manifest.json, written last, is missing"):
        ck.resolve("auto")
    os.remove(os.path.join(ck.step_dir(3), "optim_rank0.pt"))
    with pytest.raises(CheckpointError, match="incomplete: optim_rank0.pt missing"):
        verify_complete(ck.step_dir(3))

    keep_all = Checkpointer(str(tmp_path / "all"), keep_last=0)
    for step in (1, 2, 3):
        keep_all.save(step, actor, opt, {"consumed_samples": step})
    assert keep_all.complete_steps() == [1, 2, 3]


def test_other_model_shape_or_world_is_refused(parallel, tmp_path):
    actor, opt = _actor_and_opt()
    ck = Checkpointer(str(tmp_path))
    path = ck.save(1, actor, opt, {"consumed_samples": 0})
    bigger, bigger_opt = _actor_and_opt(_arch(hidden_size=64, head_dim=16))
    with pytest.raises(CheckpointError, match="hidden_size=32 but the model has hidden_size=64"):
        ck.load(path, bigger, bigger_opt)
    manifest = os.path.join(path, "manifest.json")
    data = json.load(open(manifest))
    data["world_size"] = 2
    json.dump(data, open(manifest, "w"))
    with pytest.raises(CheckpointError, match="world_size=2 but this run has world_size=1"):
        ck.load(path, actor, opt)


def test_resave_of_a_step_survives_a_crash(parallel, tmp_path, monkeypatch):
    """Saving a step that exists (a rerun) sets the old directory aside until the tracker
    names the new one. A crash between the two renames used to leave `latest` naming a
    step directory that no longer existed (the old one was removed first); now resolve
    resumes from the set-aside copy, and the next save removes it."""
    actor, opt = _actor_and_opt()
    ck = Checkpointer(str(tmp_path), keep_last=0)
    for step in (2, 4):
        ck.save(step, actor, opt, {"consumed_samples": step})
    real_replace = os.replace

    def crash_on_new_dir(src, dst):
        if src.endswith("step_4.partial"):
            raise KeyboardInterrupt("killed between the renames")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_new_dir)
    with pytest.raises(KeyboardInterrupt):
        ck.save(4, actor, opt, {"consumed_samples": 40})
    monkeypatch.setattr(os, "replace", real_replace)
    assert ck.latest_step() == 4 and not os.path.exists(ck.step_dir(4))
    path = ck.resolve("auto")
    assert path == ck.step_dir(4) + ".replaced"
    assert ck.load(path, actor, opt)["consumed_samples"] == 4  # the old step 4, complete
    ck.save(4, actor, opt, {"consumed_samples": 41})
    assert ck.resolve("auto") == ck.step_dir(4) and ck.complete_steps() == [2, 4]
    assert sorted(os.listdir(ck.root)) == ["latest", "step_2", "step_4"]
    assert ck.load(ck.resolve("auto"), actor, opt)["consumed_samples"] == 41
