"""The one writer, the one output-path check and the one directory lock every eval command uses."""
from __future__ import annotations

import os

import pytest

from refspec.eval.outputs import (LOCK, OutputError, append_line, atomic_target, check_output, check_output_dir,
                                  claimed, write_atomic)


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "a.json"
    write_atomic(path, "one\n")
    write_atomic(path, b"two\n")
    assert path.read_text() == "two\n" and sorted(p.name for p in path.parent.iterdir()) == ["a.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "a.txt"
    write_atomic(path, "old")
    with pytest.raises(RuntimeError), atomic_target(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed mid-write")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["a.txt"]


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_the_writer_never_replaces_anything_but_a_regular_file(tmp_path, kind):
    target = tmp_path / "elsewhere.txt"
    target.write_text("theirs")
    path = tmp_path / "out"
    {"symlink": lambda: path.symlink_to(target), "fifo": lambda: os.mkfifo(path), "directory": path.mkdir}[kind]()
    with pytest.raises(OutputError, match=kind if kind != "fifo" else "FIFO"):
        write_atomic(path, "mine")
    with pytest.raises(OutputError):
        append_line(path, "mine")
    assert target.read_text() == "theirs"


def test_the_check_refuses_an_input_another_output_and_a_held_directory(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("{}\n")
    with pytest.raises(OutputError, match="--per-request-metrics .* is an input"):
        check_output("--per-request-metrics", prompts, inputs=[prompts])
    with pytest.raises(OutputError, match="its own records.jsonl"):
        check_output("--export-acceptance", tmp_path / "records.jsonl", others=[tmp_path / "records.jsonl"])
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / LOCK).write_text('{"pid": 1, "host": "elsewhere"}')
    with pytest.raises(OutputError, match="in use by another refspec run"):
        check_output("--export-acceptance", tmp_path / "held" / "a.json")
    with pytest.raises(OutputError, match="is an existing file"):
        check_output_dir("--out", prompts)
    check_output("--export-acceptance", tmp_path / "new" / "a.json")  # a folder to be made is fine


def test_the_lock_is_held_for_the_body_refused_to_a_second_holder_and_released(tmp_path):
    out = tmp_path / "run"
    with claimed(out) as d:
        assert (d / LOCK).exists()
        (out / LOCK).write_text('{"pid": 1, "host": "elsewhere"}')  # as if another host's command held it
        with pytest.raises(OutputError, match="--out .* is in use"):
            with claimed(out):
                pass
        (out / LOCK).unlink()
    assert not out.exists(), "a directory this command made and left empty is removed"
