"""Reports written whole or not at all (eval --json, bench spec --json, demo's files, bench
rollout's JSON): a run killed mid-write keeps the previous file and leaves no temporary."""

import json
import os

import pytest

from megatron_tlt import atomic_io


def test_killed_write_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "report.json"
    atomic_io.write_json(str(path), {"run": 1})
    assert json.loads(path.read_text()) == {"run": 1}

    def killed(src, dst):
        raise KeyboardInterrupt("killed before the rename")

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        atomic_io.write_json(str(path), {"run": 2, "rows": list(range(1000))})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"run": 1}
    assert os.listdir(path.parent) == ["report.json"]
    atomic_io.write_text(str(path), "x\n")
    assert path.read_text() == "x\n"


def test_check_output_file_refuses_what_write_text_would_fail_on(tmp_path, monkeypatch):
    """check_output_file: the paths write_text fails on are refused up front (eval, bench
    spec and tools/rl_acceptance.py call it before their work); the ones it manages pass,
    a bare file name included (rl_acceptance's os.makedirs('') raised after hours of work)."""
    from megatron_tlt.errors import TLTError

    (tmp_path / "f").write_text("x")
    with pytest.raises(TLTError, match="is a directory, not a file"):
        atomic_io.check_output_file(str(tmp_path))
    with pytest.raises(TLTError, match=f"{tmp_path / 'f'} is a file, not a directory"):
        atomic_io.check_output_file(str(tmp_path / "f" / "deeper" / "r.json"))
    for ok in (tmp_path / "new" / "deeper" / "r.json", tmp_path / "f"):  # created, replaced
        atomic_io.check_output_file(str(ok))
        atomic_io.write_text(str(ok), "y")
        assert ok.read_text() == "y"
    monkeypatch.chdir(tmp_path)
    atomic_io.check_output_file("rl.json")
    atomic_io.write_text("rl.json", "z")
    assert (tmp_path / "rl.json").read_text() == "z"
    # a read-only directory (stood in for by os.access: root may write anywhere)
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "kept.json").write_text("{}")
    real_access = os.access
    monkeypatch.setattr(atomic_io.os, "access", lambda p, mode: str(p) != str(ro) and real_access(p, mode))
    with pytest.raises(TLTError, match="is not writable"):
        atomic_io.check_output_file(str(ro / "r.json"))
    with pytest.raises(TLTError, match="is not writable"):  # write_text renames into ro/
        atomic_io.check_output_file(str(ro / "kept.json"))
    # a caller that opens the file itself (tools/rl_acceptance.py) may write it in place
    atomic_io.check_output_file(str(ro / "kept.json"), renamed_into_place=False)
