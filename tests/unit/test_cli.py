"""The `megatron-tlt` entry point: parsing, lazy dispatch, one-line errors, exit codes.

The last section checks the test helpers of tests/conftest.py (torchrun launcher),
which every distributed test relies on.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from megatron_tlt import cli
from megatron_tlt.config import format_config, load_config
from megatron_tlt.errors import CheckpointError, ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ["train", "sft", "generate", "convert", "export-drafter", "bench", "demo"]


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.pop("RANK", None)
    return subprocess.run(
        [sys.executable, "-m", "megatron_tlt", *args],
        cwd=str(cwd or REPO_ROOT), env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def assert_one_line_error(proc: subprocess.CompletedProcess, startswith: str = "error: ") -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith(startswith)]
    assert len(errors) == 1 and lines[-1] == errors[0], proc.stderr
    return errors[0]


@pytest.fixture
def fake_module(monkeypatch):
    """Install a module object under `name` so that the CLI dispatches to it."""

    def install(name: str, **attrs) -> types.ModuleType:
        module = types.ModuleType(name)
        for key, value in attrs.items():
            setattr(module, key, value)
        monkeypatch.setitem(sys.modules, name, module)
        return module

    return install


# ------------------------------------------------------------------- subprocess


def test_help_lists_every_command():
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    for command in COMMANDS:
        assert command in proc.stdout


def test_bench_and_demo_help_lists_their_own_flags():
    """`bench rollout --help`, `bench spec --help` and `demo --help` printed only the parent
    parser's usage (`[-h] [--json FILE] {rollout,spec,e2e}`, `demo [-h]`), none of the flags
    the README documents."""
    for args, flags in ((("bench", "rollout", "--help"), ("--batch-sizes", "--compare-attr")),
                        (("bench", "spec", "--help"), ("--model", "--drafters")),
                        (("demo", "--help"), ("--out-dir", "--n N"))):
        proc = run_cli(*args)
        assert proc.returncode == 0, proc.stderr
        assert all(f in proc.stdout for f in flags), (args, proc.stdout)
    proc = run_cli("bench", "--help")
    assert proc.returncode == 0 and "{rollout,spec,e2e}" in proc.stdout
    proc = run_cli("bench")
    assert proc.returncode == 2 and "name a benchmark: rollout, spec or e2e" in proc.stderr


def test_version():
    proc = run_cli("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("megatron-tlt ")


def test_unknown_config_key_is_one_line_exit_2(tmp_path):
    proc = run_cli("train", "rollout.temprature=0.7", f"train.out_dir={tmp_path / 'run'}")
    line = assert_one_line_error(proc)
    assert line == "error: unknown config key 'rollout.temprature' (did you mean 'rollout.temperature'?)"
    assert not (tmp_path / "run").exists(), "nothing may be written before the config is valid"


def test_seq_length_beyond_the_model_fails_before_conversion(tmp_path):
    """`train` on the built-in tiny default model (1024 positions) with model.seq_length
    2048 (the defaults' value until session 43): the engine's max_model_len error came
    after the HF -> mcore conversion and named no config key."""
    proc = run_cli("train", "model.seq_length=2048", f"train.out_dir={tmp_path / 'run'}")
    line = assert_one_line_error(proc)
    assert line.startswith("error: model.seq_length (2048) exceeds the model's max_position_embeddings (1024, ")
    assert not (tmp_path / "run" / "init_mcore").exists()


@pytest.mark.parametrize("setting, expected", [
    ("rollout.spec=adaptive", "error: rollout.spec=adaptive is not available in this build yet; use off, ngram or eagle"),
    ("rollout.spec=eagle", "error: rollout.spec=eagle needs rollout.drafter (a drafter directory written by "
                           "python -m megatron_tlt.spec.train_drafter)"),
    ("rollout.drafter=/no/such/drafter", "error: drafter directory not found: /no/such/drafter"),
    ("train.resume=/no/such/ckpt", None),
])
def test_spec_and_resume_settings_fail_before_conversion(tmp_path, setting, expected):
    """Settings checkable from the config alone were refused only after the HF -> mcore
    conversion and the model loads (17-32 s on the tiny model; a whole conversion at 7B)."""
    extra = ["rollout.spec=eagle"] if "drafter=" in setting else []
    proc = run_cli("train", setting, *extra, f"train.out_dir={tmp_path / 'run'}")
    line = assert_one_line_error(proc)
    assert line == expected if expected else "/no/such/ckpt" in line, line
    assert not (tmp_path / "run" / "init_mcore").exists(), "work started"


def test_missing_config_file_is_one_line_exit_2(tmp_path):
    missing = tmp_path / "missing.yaml"
    line = assert_one_line_error(run_cli("sft", "--config", str(missing)))
    assert line == f"error: config file {str(missing)!r} not found"


def test_convert_missing_checkpoint_dir_is_one_line_exit_2(tmp_path):
    pytest.importorskip("megatron_tlt.convert")
    missing = tmp_path / "no_such_hf_dir"
    proc = run_cli("convert", "hf-to-mcore", "--hf", str(missing), "--out", str(tmp_path / "out"))
    line = assert_one_line_error(proc)
    assert str(missing) in line
    assert not (tmp_path / "out").exists()


def test_example_config_is_valid():
    cfg = load_config(str(REPO_ROOT / "examples" / "tiny_cpu.yaml"), [])
    assert cfg.parallel.tp == cfg.parallel.pp == cfg.parallel.dp == 1
    assert cfg.model.dtype == "float32"


# ---------------------------------------------------------------------- in-process


def test_train_loads_prints_and_saves_config_then_dispatches(tmp_path, fake_module, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    seen = []
    fake_module("megatron_tlt.rl.loop", main=lambda cfg: seen.append(cfg))
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("rollout:\n  temperature: 0.5\n")
    out_dir = tmp_path / "run"
    rc = cli.main(["train", "--config", str(cfg_file), "rollout.top_k=5", f"train.out_dir={out_dir}"])
    assert rc == 0
    (cfg,) = seen
    assert cfg.rollout.temperature == 0.5 and cfg.rollout.top_k == 5
    assert format_config(cfg) in capsys.readouterr().out
    assert load_config(str(out_dir / "config.yaml"), []) == cfg


def test_out_dir_that_is_a_file_is_one_clear_error(tmp_path, fake_module, capsys, monkeypatch):
    """train.out_dir naming a file was a FileExistsError traceback, exit 1."""
    monkeypatch.delenv("RANK", raising=False)
    fake_module("megatron_tlt.rl.loop", main=lambda cfg: 0)
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert cli.main(["train", f"train.out_dir={afile}"]) == 2
    assert capsys.readouterr().err.strip() == f"error: train.out_dir {str(afile)!r} is a file, not a directory"
    assert afile.read_text() == "x"


def test_sft_on_nonzero_rank_does_not_write(tmp_path, fake_module, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    seen = []
    fake_module("megatron_tlt.sft", main=lambda cfg: seen.append(cfg) or 0)
    assert cli.main(["sft", f"train.out_dir={tmp_path / 'run'}"]) == 0
    assert len(seen) == 1
    assert not (tmp_path / "run").exists()
    assert capsys.readouterr().out == ""


def test_missing_module_is_not_available(fake_module, monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "megatron_tlt.bench", None)  # import fails as if absent
    assert cli.main(["bench", "rollout", "--json", str(tmp_path / "b.json")]) == 2
    assert capsys.readouterr().err.strip() == "megatron-tlt bench: not available in this build yet"
    # a module that exists but lacks the function is not available either
    fake_module("megatron_tlt.demo")
    assert cli.main(["demo"]) == 2
    assert capsys.readouterr().err.strip() == "megatron-tlt demo: not available in this build yet"
    # train: config is checked first, then availability; nothing is written
    monkeypatch.setitem(sys.modules, "megatron_tlt.rl.loop", None)
    assert cli.main(["train", f"train.out_dir={tmp_path / 'run'}"]) == 2
    assert capsys.readouterr().err.strip() == "megatron-tlt train: not available in this build yet"
    assert not (tmp_path / "run").exists()


def test_missing_dependency_inside_a_module_propagates(tmp_path, monkeypatch):
    pkg = tmp_path / "tlt_fake_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "broken.py").write_text("import tlt_no_such_dependency_xyz\n\ndef main(args):\n    return 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="tlt_no_such_dependency_xyz"):
        cli._resolve("x", "tlt_fake_pkg.broken:main")
    with pytest.raises(cli.NotAvailable):
        cli._resolve("x", "tlt_fake_pkg.absent:main")


def test_user_errors_are_one_line_exit_2(fake_module, capsys):
    def raise_checkpoint_error(args):
        raise CheckpointError("checkpoint /ckpt/step_3 is partial:\n  missing metadata.json")

    fake_module("megatron_tlt.demo", main=raise_checkpoint_error)
    assert cli.main(["demo"]) == 2
    err = capsys.readouterr().err
    assert err == "error: checkpoint /ckpt/step_3 is partial: missing metadata.json\n"

    def raise_config_error(args):
        raise ConfigError("parallel.tp (3) must divide the world size (4)")

    fake_module("megatron_tlt.demo", main=raise_config_error)
    assert cli.main(["demo"]) == 2
    assert capsys.readouterr().err == "error: parallel.tp (3) must divide the world size (4)\n"


def test_bugs_keep_their_traceback(fake_module):
    def buggy(args):
        raise RuntimeError("a bug")

    fake_module("megatron_tlt.demo", main=buggy)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["demo"])


def test_keyboard_interrupt_exits_130(fake_module):
    def interrupted(args):
        raise KeyboardInterrupt

    fake_module("megatron_tlt.demo", main=interrupted)
    assert cli.main(["demo"]) == 130


def test_return_code_is_passed_through(fake_module):
    fake_module("megatron_tlt.demo", main=lambda args: 3)
    assert cli.main(["demo"]) == 3
    fake_module("megatron_tlt.demo", main=lambda args: None)
    assert cli.main(["demo"]) == 0


def test_convert_arguments_reach_the_functions(fake_module):
    calls = []
    fake_module(
        "megatron_tlt.convert",
        hf_to_mcore=lambda hf, out, tp, pp: calls.append(("hf", hf, out, tp, pp)),
        mcore_to_hf=lambda mcore, out: calls.append(("mcore", mcore, out)),
    )
    assert cli.main(["convert", "hf-to-mcore", "--hf", "A", "--out", "B", "--tp", "2"]) == 0
    assert cli.main(["convert", "mcore-to-hf", "--mcore", "C", "--out", "D"]) == 0
    assert calls == [("hf", "A", "B", 2, 1), ("mcore", "C", "D")]


def test_generate_defaults_and_passthrough(fake_module):
    seen = []
    from megatron_tlt.rollout.cli import add_generate_args

    fake_module("megatron_tlt.rollout.cli", main=lambda args: seen.append(args), add_generate_args=add_generate_args)
    fake_module("megatron_tlt.bench", main=lambda args: seen.append(args))
    assert cli.main(["generate", "--model", "M", "--prompts", "p.jsonl", "--out", "o.jsonl", "--top-k", "4"]) == 0
    args = seen.pop()
    assert (args.model, args.prompts, args.out, args.top_k, args.spec, args.n) == ("M", "p.jsonl", "o.jsonl", 4, "off", 1)
    # bench takes options it parses itself; other commands reject unknown options
    assert cli.main(["bench", "rollout", "--json", "r.json", "--batch-sizes", "1,32"]) == 0
    args = seen.pop()
    assert (args.what, args.json, args.extra) == ("rollout", "r.json", ["--batch-sizes", "1,32"])
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "--model", "M", "--prompts", "p", "--out", "o", "--bogus"])
    assert info.value.code == 2


# ------------------------------------------------------- conftest's torchrun helper


def test_run_torchrun_runs_ranks(tmp_path, run_torchrun):
    script = tmp_path / "allreduce.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch, torch.distributed as dist
            dist.init_process_group("gloo")
            t = torch.tensor([dist.get_rank() + 1.0])
            dist.all_reduce(t)
            print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item():g}")
            dist.destroy_process_group()
            """
        )
    )
    result = run_torchrun(script, 2, timeout=240)
    assert "rank 0 of 2 sum 3" in result.stdout and "rank 1 of 2 sum 3" in result.stdout


def test_run_torchrun_fails_the_test_on_error(tmp_path, run_torchrun):
    script = tmp_path / "fails.py"
    script.write_text("import sys\nprint('about to fail')\nsys.exit(3)\n")
    with pytest.raises(pytest.fail.Exception, match=r"(?s)exited [1-9].*about to fail"):
        run_torchrun(script, 1, timeout=240)


def test_free_port_is_bindable(free_port):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port))
