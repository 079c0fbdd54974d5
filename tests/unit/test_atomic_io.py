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
