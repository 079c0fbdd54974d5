"""Offline drafter training: data from the target's own responses, packing, the loss
going down, acceptance going up, save/reload exactness, the command line."""

import json
import math
import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from spec_testutil import (VOCAB, make_engine, make_hf_model, one_thread, prompts,  # noqa: E402,F401
                           requests, run, spec_models)

from megatron_tlt.errors import TLTError  # noqa: E402
from megatron_tlt.spec.eagle import EagleProposer, attend  # noqa: E402
from megatron_tlt.spec.export import load_drafter  # noqa: E402
from megatron_tlt.spec.train_drafter import (DrafterTrainer, TrainSample, build_drafter,  # noqa: E402
                                             collect_samples, main, pack_samples, train)
from megatron_tlt.spec.tree import Strategy  # noqa: E402

FAM = "llama"


@pytest.fixture(scope="module")
def data(spec_models):
    engine = make_engine(spec_models[FAM], max_num_seqs=16, num_blocks=400)
    ps = [(i, p) for i, p in enumerate(prompts(VOCAB[FAM], [6] * 16, seed=7))]
    return engine, ps, collect_samples(engine, ps, max_new_tokens=40, progress=False)


def test_samples_and_packs(data):
    engine, ps, samples = data
    s = samples[0]
    assert s.tokens.numel() == 46 and s.features.shape == (45, engine.arch.hidden_size)
    packs = pack_samples(samples[:3], 100)
    assert [p.num_tokens for p in packs] == [88, 44]
    p = packs[0]
    assert p.segment_ids.tolist() == [0] * 44 + [1] * 44
    assert p.positions[:3].tolist() == [1, 2, 3] and p.positions[44] == 1
    assert torch.equal(p.tokens[:44], s.tokens[1:45])
    assert torch.equal(p.features[:44], s.features[:44])
    assert torch.equal(p.target_features[:44], s.features[1:45])
    chunks = pack_samples(samples[:1], 20)  # a long sample is split; positions continue
    assert [c.num_tokens for c in chunks] == [20, 20, 4] and chunks[1].positions[0] == 21
    r = TrainSample(tokens=s.tokens, features=s.features, loss_start=4)
    assert pack_samples([r], 100)[0].loss_mask.tolist() == [False] * 4 + [True] * 40


def test_training_lowers_loss_raises_acceptance_and_never_touches_the_target(data, spec_models):
    engine, ps, samples = data
    target = [t.clone() for t in engine.weights.tensors()]
    drafter = build_drafter(engine.arch, engine.weights, samples, seed=0)
    untrained = build_drafter(engine.arch, engine.weights, samples, seed=0)
    packs = pack_samples(samples, 256)
    trainer = DrafterTrainer(drafter, lr=3e-3)
    before = trainer.evaluate(packs)
    history = train(trainer, packs, 40, progress=False)
    after = trainer.evaluate(packs)
    assert after["loss"] < 0.85 * before["loss"] and after["top1"] > before["top1"]
    assert len(history) == 40 and all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    for t, ref in zip(engine.weights.tensors(), target):
        assert torch.equal(t, ref)
    reqs = requests(VOCAB[FAM], [6] * 16, prompt_seed=7, max_new_tokens=40)
    base, _ = run(spec_models[FAM], reqs, max_num_seqs=16, num_blocks=400)
    accepted = {}
    for name, dr in (("untrained", untrained), ("trained", drafter)):
        res, e = run(spec_models[FAM], reqs, lambda e, dr=dr: EagleProposer(dr), Strategy(depth=3),
                     max_num_seqs=16, num_blocks=400)
        assert [r.token_ids for r in res] == [r.token_ids for r in base]
        accepted[name] = e.spec_decoder.metrics.summary()["total"]["accepted"]
    assert accepted["trained"] > 2 * accepted["untrained"], accepted


def test_checkpoint_reloads_to_identical_outputs(data, tmp_path):
    engine, ps, samples = data
    drafter = build_drafter(engine.arch, engine.weights, samples, draft_vocab_size=120, seed=1)
    packs = pack_samples(samples, 256)
    trainer = DrafterTrainer(drafter, lr=3e-3)
    train(trainer, packs, 3, progress=False)
    path = str(tmp_path / "ckpt")
    trainer.save_checkpoint(path)
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors", "optimizer.pt",
                                        "trainer_state.json"]
    loaded = load_drafter(path, engine.arch, engine.weights.embed, engine.weights.lm_head)
    assert torch.equal(loaded.draft_to_target, drafter.draft_to_target)
    p = packs[0]
    with torch.no_grad():
        drafter.eval()
        a = drafter.forward_packed(p.tokens, p.features, p.positions, p.segment_ids)
        b = loaded.forward_packed(p.tokens, p.features, p.positions, p.segment_ids)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # Resuming: the optimizer state and step come back too; one more step agrees exactly.
    resumed = DrafterTrainer(loaded, lr=3e-3)
    resumed.load_optimizer(path)
    assert resumed.step_count == 3
    m1, m2 = trainer.step(packs[1]), resumed.step(packs[1])
    assert m1["loss"] == m2["loss"]
    for k, v in drafter.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k


def _write_prompts(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_command_line_end_to_end(spec_models, tmp_path):
    from megatron_tlt import cli
    d = spec_models["qwen2"]
    data = _write_prompts(tmp_path / "p.jsonl", [{"prompt_token_ids": p} for p in prompts(300, [5, 6, 7, 8], seed=3)])
    out = str(tmp_path / "drafter")
    rc = main(["--target", d, "--data", data, "--out", out, "--max-new-tokens", "12", "--steps", "4",
               "--batch-tokens", "32", "--draft-vocab", "64", "--no-progress"])
    assert rc == 0
    summary = json.loads(open(os.path.join(out, "train_summary.json")).read())
    assert summary["samples"] == 4 and summary["steps"] == 4
    cfg = json.loads(open(os.path.join(out, "config.json")).read())
    assert cfg["eagle_config"]["draft_vocab_size"] == 64 and cfg["num_hidden_layers"] == 1
    exported = str(tmp_path / "exported")
    assert cli.main(["export-drafter", "--ckpt", out, "--out", exported]) == 0
    assert sorted(os.listdir(exported)) == ["config.json", "model.safetensors"]
    with pytest.raises(TLTError, match="--steps must be >= 1"):
        main(["--target", d, "--data", data, "--out", out, "--steps", "0"])
    # refused before the target generates anything (they failed only after it, and the
    # fixed rerun then refused to resume the generated samples' settings)
    fresh = str(tmp_path / "fresh")
    for flags, message in ((["--draft-vocab", "0"], "--draft-vocab must be >= 1, got 0"),
                           (["--warmup-steps", "-1"], "--warmup-steps must be >= 0, got -1"),
                           (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0")):
        with pytest.raises(TLTError, match=message):
            main(["--target", d, "--data", data, "--out", fresh, "--steps", "2", "--max-new-tokens", "12",
                  *flags])
        assert not os.path.exists(fresh)


def test_tasks_with_the_tiny_tokenizer(tmp_path):
    from megatron_tlt.data.tokenizer import TINY_TOKENIZER_DIR
    d = str(tmp_path / "m")
    make_hf_model("llama", d, vocab_size=100, seed=1, tie=False)
    for f in os.listdir(TINY_TOKENIZER_DIR):
        shutil.copy(os.path.join(TINY_TOKENIZER_DIR, f), d)
    out = str(tmp_path / "dr")
    assert main(["--target", d, "--tasks", "arith,sort", "--num-prompts", "3", "--out", out,
                 "--max-new-tokens", "6", "--steps", "2", "--no-progress"]) == 0
    assert os.path.isfile(os.path.join(out, "model.safetensors"))
    with pytest.raises(TLTError, match="needs a tokenizer"):
        main(["--target", _no_tokenizer(tmp_path), "--tasks", "arith", "--out", out, "--no-progress"])


def _no_tokenizer(tmp_path):
    d = str(tmp_path / "bare")
    make_hf_model("llama", d, vocab_size=100, seed=1, tie=False)
    return d


def test_command_line_bfloat16_target(spec_models, tmp_path):
    """--dtype bfloat16: the target generates in bf16 (the rollout's dtype on a GPU), the
    drafter still trains in float32 over float32 copies of the head; the target's own
    tensors are not modified. float32_head: the same object for a float32 target, one copy
    for a tied head."""
    import types as _types

    from megatron_tlt.rollout.weights import load_hf
    from megatron_tlt.spec.train_drafter import float32_head
    d = spec_models["qwen2"]
    data = _write_prompts(tmp_path / "p.jsonl", [{"prompt_token_ids": p} for p in prompts(300, [5, 6], seed=4)])
    out = str(tmp_path / "drafter_bf16")
    assert main(["--target", d, "--data", data, "--out", out, "--max-new-tokens", "8", "--steps", "2",
                 "--batch-tokens", "32", "--dtype", "bfloat16", "--no-progress"]) == 0
    summary = json.loads(open(os.path.join(out, "train_summary.json")).read())
    assert summary["samples"] == 2 and math.isfinite(summary["after"]["loss"])
    _, w32 = load_hf(d)
    assert float32_head(w32) is w32
    _, w16 = load_hf(d, dtype=torch.bfloat16)
    before = w16.embed.clone()
    h = float32_head(w16)
    assert isinstance(h, _types.SimpleNamespace) and h.embed.dtype == torch.float32
    assert torch.equal(h.embed, w16.embed.float()) and torch.equal(w16.embed, before)
    assert (h.lm_head is h.embed) == (w16.lm_head is w16.embed)
    with pytest.raises(TLTError, match="dtype"):
        main(["--target", d, "--data", data, "--out", out, "--dtype", "int8", "--no-progress"])


def test_unrolled_steps_are_the_chain_the_drafter_drafts(data):
    """forward_unrolled: step 1 is forward_packed bit for bit; step s > 1 of row i equals a
    chain level computed as at rollout: the query (true token of pair i + s - 1, the
    drafter's own f of the step before, position + s - 1) attending to the step-1 K/V of
    the pairs <= i of its sample and to row i's earlier levels; rows whose pair i + s - 1
    lies in another sample are invalid. Control: the target's feature in place of the
    drafter's own f gives another step-2 output."""
    engine, _, samples = data
    d = build_drafter(engine.arch, engine.weights, samples, seed=1)
    pk = pack_samples(samples[:2], 4096)[0]
    tok, feats, pos, seg = pk.tokens, pk.features.float(), pk.positions, pk.segment_ids
    with torch.no_grad():
        out = d.forward_unrolled(tok, feats, pos, seg, 3)
        f1, lg1 = d.forward_packed(tok, feats, pos, seg)
        assert torch.equal(out[0][0], f1) and torch.equal(out[0][1], lg1)
        _, _, k1, v1 = d.layer_qkv(tok, d.fuse_features(feats), pos)
        first = int((seg == seg[0]).sum())
        for i in (0, 3, first - 3, first - 2, first - 1, first + 2):
            same = (seg == seg[i]) & (torch.arange(tok.numel()) <= i)
            keys, values, f = [k1[same]], [v1[same]], out[0][0][i:i + 1]
            for s in (1, 2):
                valid = i + s < tok.numel() and bool(seg[i + s] == seg[i])
                assert bool(out[s][2][i]) == valid
                if not valid:
                    break
                x, q, k, v = d.layer_qkv(tok[i + s:i + s + 1], f, pos[i:i + 1] + s)
                keys.append(k)
                values.append(v)
                kk, vv = torch.cat(keys), torch.cat(values)
                o = attend(q, kk, vv, torch.ones(1, kk.shape[0], dtype=torch.bool), d.scale)
                f = d.layer_out(x, o)
                torch.testing.assert_close(out[s][0][i:i + 1], f, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(out[s][1][i:i + 1], d.logits(f), atol=1e-4, rtol=1e-4)
        # control: step 2 fed the target's feature of pair i + 1 instead of f1
        i = 3
        x, q, k, v = d.layer_qkv(tok[i + 1:i + 2], d.fuse_features(feats[i + 1:i + 2]), pos[i:i + 1] + 1)
        kk, vv = torch.cat([k1[:i + 1], k]), torch.cat([v1[:i + 1], v])
        o = attend(q, kk, vv, torch.ones(1, i + 2, dtype=torch.bool), d.scale)
        assert not torch.allclose(out[1][0][i:i + 1], d.layer_out(x, o), atol=1e-3)


def test_unroll_trains_the_deeper_levels(data):
    """Seeded, same data and steps (deterministic): training with unroll=3 leaves the
    drafter with a lower loss at chain levels 2 and 3 (evaluated on its own features)
    than training with unroll=1, the control, which never trains those levels (here
    0.881 / 0.870 against 0.911 / 0.916 when written); every loss stays finite; unroll < 1
    is rejected."""
    engine, _, samples = data
    packs = pack_samples(samples, 256)
    res = {}
    for unroll in (1, 3):
        d = build_drafter(engine.arch, engine.weights, samples, seed=0)
        trainer = DrafterTrainer(d, lr=3e-3, unroll=unroll, seed=0)
        hist = train(trainer, packs, 60, progress=False)
        assert all(math.isfinite(h["loss_all"]) for h in hist)
        res[unroll] = DrafterTrainer(d, unroll=3).evaluate(packs)
    assert res[3]["loss_2"] < 0.99 * res[1]["loss_2"] and res[3]["loss_3"] < 0.99 * res[1]["loss_3"], res
    with pytest.raises(TLTError, match="unroll"):
        DrafterTrainer(build_drafter(engine.arch, engine.weights, samples), unroll=0)


class _Crash(Exception):
    pass


def test_a_cut_run_resumes_to_the_uninterrupted_result(spec_models, tmp_path, monkeypatch):
    """A run stopped after step 5 (checkpoints every 2 steps), run again with the same
    command: reads the target's responses back instead of generating them, restarts from
    the step-4 checkpoint, and ends with exactly the drafter of an uninterrupted run
    (torch.equal; feature noise on, several packs, so the generator state and the data
    order matter). Control: the same resume without the optimizer's state differs."""
    from safetensors.torch import load_file

    import megatron_tlt.spec.train_drafter as td
    d = spec_models["qwen2"]
    data = _write_prompts(tmp_path / "p.jsonl", [{"prompt_token_ids": p} for p in prompts(300, [5, 6, 7], seed=5)])

    def cmd(out, *extra):
        return ["--target", d, "--data", data, "--out", out, "--max-new-tokens", "10", "--steps", "7",
                "--batch-tokens", "12", "--feature-noise", "0.05", "--save-every", "2", "--no-progress",
                *extra]

    def weights(out):
        return load_file(os.path.join(out, "model.safetensors"))

    whole = str(tmp_path / "whole")
    assert main(cmd(whole)) == 0
    assert not os.path.exists(os.path.join(whole, ".train_state"))  # removed when done
    step = td.DrafterTrainer.step

    def crash_after(n):
        def cut(self, pack):
            if self.step_count == n:
                raise _Crash
            return step(self, pack)
        return cut

    def resumed(out, *, skip_optimizer=False):
        with monkeypatch.context() as m:
            m.setattr(td.DrafterTrainer, "step", crash_after(5))
            with pytest.raises(_Crash):
                main(cmd(out))
        state = os.path.join(out, ".train_state")
        assert sorted(os.listdir(state)) == ["args.json", "before.json", "ckpt", "samples.pt"]
        with monkeypatch.context() as m:
            m.setattr(td, "collect_samples", lambda *a, **k: pytest.fail("generated again"))
            if skip_optimizer:
                m.setattr(td.DrafterTrainer, "load_optimizer",
                          lambda self, path: setattr(self, "step_count", 4))
            assert main(cmd(out)) == 0
        return json.loads(open(os.path.join(out, "train_summary.json")).read())

    cut = str(tmp_path / "cut")
    summary = resumed(cut)
    assert summary["resumed_at_step"] == 4 and summary["steps"] == 7 and summary["packs"] > 2
    assert summary["before"] == json.loads(open(os.path.join(whole, "train_summary.json")).read())["before"]
    a, b = weights(whole), weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    control = str(tmp_path / "control")
    resumed(control, skip_optimizer=True)
    c = weights(control)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_resume_refuses_other_settings_and_no_resume_discards(spec_models, tmp_path, monkeypatch):
    import megatron_tlt.spec.train_drafter as td
    d = spec_models["qwen2"]
    data = _write_prompts(tmp_path / "p.jsonl", [{"prompt_token_ids": p} for p in prompts(300, [5, 6], seed=6)])
    out = str(tmp_path / "d")
    base = ["--target", d, "--data", data, "--out", out, "--max-new-tokens", "6", "--steps", "3",
            "--batch-tokens", "12", "--save-every", "1", "--no-progress"]

    def cut(self, pack):
        raise _Crash
    with monkeypatch.context() as m:
        m.setattr(td.DrafterTrainer, "step", cut)
        with pytest.raises(_Crash):
            main(base)
    with pytest.raises(TLTError, match=r"other settings \(lr: 0.001 there, 0.002 now\).*--no-resume"):
        main(base + ["--lr", "0.002"])
    assert main(base + ["--lr", "0.002", "--no-resume"]) == 0
    summary = json.loads(open(os.path.join(out, "train_summary.json")).read())
    assert summary["resumed_at_step"] is None and summary["steps"] == 3
    with pytest.raises(TLTError, match="--save-every must be >= 0"):
        main(base + ["--save-every", "-1"])


def test_resume_falls_back_to_the_previous_checkpoint(data, tmp_path):
    """A stop between the two renames of ResumeState.save leaves only ckpt.old: loaded."""
    from megatron_tlt.spec.train_drafter import ResumeState
    engine, ps, samples = data
    packs = pack_samples(samples[:4], 64)
    st = ResumeState(str(tmp_path), {"x": 1})
    assert st.open() is False and st.open() is True
    t = DrafterTrainer(build_drafter(engine.arch, engine.weights, samples, seed=0), lr=3e-3)
    train(t, packs, 2, progress=False)
    st.save(t)
    os.replace(os.path.join(st.dir, "ckpt"), os.path.join(st.dir, "ckpt.old"))
    fresh = DrafterTrainer(build_drafter(engine.arch, engine.weights, samples, seed=0), lr=3e-3)
    assert st.load(fresh) and fresh.step_count == 2
    assert all(torch.equal(v, t.drafter.state_dict()[k]) for k, v in fresh.drafter.state_dict().items())
    st.finish()
    assert not os.path.exists(st.dir)
    assert not ResumeState(str(tmp_path), {"x": 1}).load(fresh)


def test_epochs_set_the_steps_from_the_packs(spec_models, tmp_path):
    """Without --steps the run takes --epochs passes over its packs (20 by default, rounded
    up, at least one step); --steps and --epochs together, or a non-positive --epochs, are
    clear errors."""
    from megatron_tlt.spec.train_drafter import DEFAULT_EPOCHS, total_steps
    assert total_steps(51, None) == math.ceil(DEFAULT_EPOCHS * 51) and DEFAULT_EPOCHS == 20
    assert total_steps(3, 2.5) == 8 and total_steps(1, 0.01) == 1
    d = spec_models["qwen2"]
    data = _write_prompts(tmp_path / "p.jsonl", [{"prompt_token_ids": p} for p in prompts(300, [5, 6, 7], seed=7)])
    out = str(tmp_path / "d")
    base = ["--target", d, "--data", data, "--out", out, "--max-new-tokens", "6",
            "--batch-tokens", "12", "--no-progress"]
    assert main(base + ["--epochs", "1.5"]) == 0
    summary = json.loads(open(os.path.join(out, "train_summary.json")).read())
    assert summary["packs"] > 1 and summary["steps"] == math.ceil(1.5 * summary["packs"])
    with pytest.raises(TLTError, match="--steps or --epochs, not both"):
        main(base + ["--epochs", "2", "--steps", "3", "--no-resume"])
    with pytest.raises(TLTError, match="--epochs must be > 0"):
        main(base + ["--epochs", "0", "--no-resume"])


def test_lr_schedule_warms_up_and_decays_by_step():
    """lr_at: linear warm-up to --lr, then constant or a cosine down to a tenth at the last
    step (and flat after it); a function of the step alone (what a resumed run relies on);
    bad settings are clear errors."""
    from megatron_tlt.spec.train_drafter import lr_at
    assert [lr_at(s, 1.0, "constant", None, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = [lr_at(s, 2.0, "cosine", 104, 4) for s in range(110)]
    assert cos[:4] == [0.5, 1.0, 1.5, 2.0] and cos[4] == 2.0
    assert cos[54] == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))  # half way through the decay
    assert cos[104] == pytest.approx(0.2) and cos[109] == pytest.approx(0.2)
    assert all(a >= b for a, b in zip(cos[4:], cos[5:]))
    with pytest.raises(TLTError, match="total steps"):
        lr_at(0, 1.0, "cosine", None)
    with pytest.raises(TLTError, match="must be one of"):
        lr_at(0, 1.0, "linear", 10)


def test_trainer_steps_at_the_scheduled_rate(data):
    """DrafterTrainer sets each step's rate from lr_at (reported as the step's `lr`); a
    cosine run moves the weights less late than a constant one at the same --lr (control:
    the constant run's rate never changes)."""
    from megatron_tlt.spec.train_drafter import lr_at
    engine, ps, samples = data
    packs = pack_samples(samples[:4], 64)
    rates = {}
    for sched in ("constant", "cosine"):
        t = DrafterTrainer(build_drafter(engine.arch, engine.weights, samples), lr=3e-3,
                           lr_schedule=sched, total_steps=6, warmup_steps=2)
        rates[sched] = [t.step(packs[i % len(packs)])["lr"] for i in range(6)]
        assert rates[sched] == [lr_at(i, 3e-3, sched, 6, 2) for i in range(6)]
    assert rates["constant"][2:] == [3e-3] * 4
    assert rates["cosine"][5] < rates["cosine"][3] < 3e-3
    with pytest.raises(TLTError, match="total steps"):
        DrafterTrainer(build_drafter(engine.arch, engine.weights, samples), lr_schedule="cosine")


def test_resume_refuses_another_decay_length(spec_models, tmp_path, monkeypatch):
    """--steps / --epochs may change on resume only where they do not change the learning
    rates already applied: with the cosine schedule a run cut at step 3 of 6 and resumed
    with --steps 8 mixed two curves (accepted silently before); it is refused, naming the
    flags, and the same --steps resumes. With the constant schedule another --steps resumes."""
    import megatron_tlt.spec.train_drafter as td
    d = spec_models["qwen2"]
    data = _write_prompts(tmp_path / "p.jsonl", [{"prompt_token_ids": p} for p in prompts(300, [5, 6], seed=6)])

    def cut_run(out, *extra):
        base = ["--target", d, "--data", data, "--out", out, "--max-new-tokens", "6", "--batch-tokens", "12",
                "--save-every", "1", "--no-progress", *extra]
        step = td.DrafterTrainer.step

        def cut(self, pack):
            if self.step_count == 3:
                raise _Crash
            return step(self, pack)
        with monkeypatch.context() as m:
            m.setattr(td.DrafterTrainer, "step", cut)
            with pytest.raises(_Crash):
                main(base + ["--steps", "6"])
        return base

    base = cut_run(str(tmp_path / "cos"), "--lr-schedule", "cosine")
    with pytest.raises(TLTError, match=r"decays its learning rate \(cosine\) over 6 steps; --steps / --epochs "
                                       r"now give 8: give the same, or --no-resume"):
        main(base + ["--steps", "8"])
    assert main(base + ["--steps", "6"]) == 0
    out = str(tmp_path / "cos")
    assert json.loads(open(os.path.join(out, "train_summary.json")).read())["resumed_at_step"] == 3
    base = cut_run(str(tmp_path / "const"))
    assert main(base + ["--steps", "8"]) == 0


def test_top1_is_greedy_verifications_test_with_a_reduced_vocabulary(data):
    """With a reduced draft vocabulary, top1 compares the drafted token (in target ids) with
    the target's argmax over its whole vocabulary: the argmax over the draft rows alone
    counted drafts greedy verification rejects (the target's token outside the draft
    vocabulary) as hits."""
    import torch.nn.functional as F

    from megatron_tlt.spec.train_drafter import drafter_loss

    engine, _, samples = data
    drafter = build_drafter(engine.arch, engine.weights, samples, draft_vocab_size=24, seed=0)
    pack = pack_samples(samples, 4096)[0]
    with torch.no_grad():
        _, m = drafter_loss(drafter, pack)
        _, logits = drafter.forward_packed(pack.tokens, pack.features, pack.positions, pack.segment_ids)
        full = F.linear(pack.target_features, engine.weights.lm_head).argmax(-1)
        restricted = drafter.draft_to_target[F.linear(pack.target_features, drafter.head_weight()).argmax(-1)]
    drafted = drafter.draft_to_target[logits.argmax(-1)]
    mask = pack.loss_mask
    n = int(mask.sum())
    assert m["top1"] == pytest.approx(float(((drafted == full) & mask).sum()) / n, abs=1e-6)  # float32
    old = float(((drafted == restricted) & mask).sum()) / n
    assert old != m["top1"], "the test needs targets outside the draft vocabulary"
