"""train/hf_export.py's write_dir: an export is written beside its directory and moved in only when
complete, so a failure leaves the directory as it was and no partial sibling behind."""
from __future__ import annotations

import os

import pytest

from fullshard.train.hf_export import write_dir


def _files(path) -> dict:
    return {name: open(os.path.join(path, name)).read() for name in sorted(os.listdir(path))}


def _writer(fail: bool):
    def write(tmp: str) -> None:
        with open(os.path.join(tmp, "model.safetensors"), "w") as f:
            f.write("new")
        if fail:  # as a save_pretrained or PEFT merge raising after the first file
            raise RuntimeError("merge failed")
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write("{}")
    return write


def test_write_dir_complete_or_untouched(tmp_path):
    out = tmp_path / "hf"
    with pytest.raises(RuntimeError, match="merge failed"):
        write_dir(str(out), _writer(fail=True))
    assert os.listdir(tmp_path) == []  # neither DIR nor its partial sibling

    write_dir(str(out), _writer(fail=False))
    assert _files(out) == {"config.json": "{}", "model.safetensors": "new"}
    assert os.listdir(tmp_path) == ["hf"]

    # An existing DIR (a resumed run's earlier export, the user's own files): a failure keeps it as it was,
    # a success replaces the files it writes and keeps the others.
    (out / "model.safetensors").write_text("old")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="merge failed"):
        write_dir(str(out), _writer(fail=True))
    assert _files(out) == {"config.json": "{}", "model.safetensors": "old", "notes.txt": "mine"}
    write_dir(str(out), _writer(fail=False))
    assert _files(out) == {"config.json": "{}", "model.safetensors": "new", "notes.txt": "mine"}
    assert os.listdir(tmp_path) == ["hf"]
