"""How a command writes the file a user names (`paths.replaced`, `paths.check_writable`): whole or not at all, a
device written in place, and the reasons a path cannot be written, found before the work."""

import os

import pytest

from ling2.config import paths


def test_replaced_writes_whole_and_leaves_no_temporary(tmp_path):
    out = tmp_path / "deep" / "er" / "result.json"
    with paths.replaced(out) as f:
        f.write("new")
    assert out.read_text() == "new" and os.listdir(out.parent) == ["result.json"]


def test_a_failed_write_keeps_the_previous_file(tmp_path):
    out = tmp_path / "result.json"
    out.write_text("old")
    with pytest.raises(RuntimeError):
        with paths.replaced(out) as f:
            f.write("half")
            raise RuntimeError("the writer failed halfway")
    assert out.read_text() == "old" and os.listdir(tmp_path) == ["result.json"]


def test_a_device_is_written_in_place_not_replaced():
    with paths.replaced("/dev/null", "wb") as f:
        f.write(b"gone")
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")


def test_a_refused_write_is_an_oserror_and_keeps_the_previous_file(tmp_path, monkeypatch):
    """A file system that refuses the write: simulated by a temporary whose sync fails (a full disk shows up at
    write, flush or sync)."""
    out = tmp_path / "result.json"
    out.write_text("old")

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        with paths.replaced(out) as f:
            f.write("new")
    monkeypatch.undo()
    assert out.read_text() == "old" and os.listdir(tmp_path) == ["result.json"]


def test_check_writable(tmp_path):
    (tmp_path / "a_file").write_text("")
    paths.check_writable(tmp_path / "new" / "dirs" / "out.json")  # made when written
    paths.check_writable(tmp_path / "a_file")  # replaced
    with pytest.raises(ValueError, match="is a directory"):
        paths.check_writable(tmp_path)
    with pytest.raises(ValueError, match=r"a_file is not a directory"):
        paths.check_writable(tmp_path / "a_file" / "out.json")
