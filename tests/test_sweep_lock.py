"""Results never mix: an ``--out`` holds one sweep definition, one running invocation, and a ledger
that tells aborted runs from complete ones."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from refspec.energy.accounting.headline import pool_runs
from refspec.energy.ledger.read import finished, read_ledger, unfinished_runs
from refspec.energy.ledger.step_groups import AccountingError
from refspec.energy.ledger.writer import Ledger
from refspec.eval import cli
from refspec.eval.outputs import LOCK, claimed
import test_eval_cli
from test_eval_cli import QUIET

tiny, one_thread = test_eval_cli.tiny, test_eval_cli.one_thread  # the tiny model and one thread, as there


def _sweep(tiny, out: Path, budget: int = 4, *extra: str) -> list[str]:
    return ["sweep", "--model", str(tiny["model"]), "--corpus", str(tiny["prompts"]), "--batch", "1", "--k", "0,2",
            "--drafter", "ngram", "--num-prompts", "1", "--max-new-tokens", str(budget), "--meter", "time", *QUIET,
            "--out", str(out), *extra]


def _errors(err: str) -> list[str]:
    return [ln for ln in err.split("\n") if ln.startswith("error:")]


def test_changed_definition_is_refused_and_force_starts_a_subfolder(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(_sweep(tiny, out, 4)) == 0
    records = (out / "records.jsonl").read_text()
    meta = (out / "sweep.json").read_text()
    capsys.readouterr()
    assert cli.main(_sweep(tiny, out, 3)) == 2, "another budget into the same --out would mix two sweeps"
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1 and "holds a different sweep" in errors[0] and "--force" in errors[0]
    assert (out / "records.jsonl").read_text() == records and (out / "sweep.json").read_text() == meta
    assert cli.main(_sweep(tiny, out, 3, "--force")) == 0
    subs = [p for p in out.iterdir() if p.name.startswith("sweep-")]
    assert len(subs) == 1 and (subs[0] / "records.jsonl").exists(), "--force writes to a subfolder"
    assert (out / "records.jsonl").read_text() == records, "the first sweep's records are untouched"
    capsys.readouterr()
    assert cli.main(_sweep(tiny, out, 4)) == 0, "the same definition resumes"
    assert "2 configuration(s) were already done" in capsys.readouterr().out
    assert not (out / LOCK).exists(), "the lock is released after every run"


def test_a_second_concurrent_sweep_is_refused(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, "-m", "refspec.eval", *_sweep(tiny, out, 48)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (out / LOCK).exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (out / LOCK).exists(), "the first sweep holds the lock while it runs"
        assert cli.main(_sweep(tiny, out, 48)) == 2
        errors = _errors(capsys.readouterr().err)
        assert len(errors) == 1 and f"in use by another refspec run (pid {first.pid}" in errors[0]
    finally:
        _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-2000:]
    ids = [json.loads(line)["config_id"] for line in (out / "records.jsonl").read_text().split("\n") if line]
    assert len(ids) == 2 and len(set(ids)) == 2, "each configuration ran once, by the first sweep only"
    assert not (out / LOCK).exists()


def test_a_stale_lock_is_taken_over(tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    import socket

    (out / LOCK).write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname()}))
    assert cli.main(_sweep(tiny, out)) == 0, "a lock whose process is gone does not block"
    assert not (out / LOCK).exists()


def test_a_live_lock_blocks_and_nothing_is_created(tiny, tmp_path, capsys):
    out = tmp_path / "new" / "out"
    with claimed(out):  # this process holds it, as a concurrent run would
        assert cli.main(_sweep(tiny, out)) == 2
        assert "in use by another refspec run" in capsys.readouterr().err
        assert sorted(p.name for p in out.iterdir()) == [LOCK]
    assert not (tmp_path / "new").exists(), "a directory the run created and left empty is removed"


def test_interrupted_configuration_is_marked_aborted_and_never_counted(tiny, tmp_path, monkeypatch, capsys):
    import refspec.eval.run as run_mod

    out = tmp_path / "out"
    real = run_mod.serve_chunks
    calls = []

    def interrupt_second(*args, **kwargs):
        calls.append(1)
        gens = real(*args, **kwargs)
        if len(calls) == 2:  # Ctrl-C after its phases were written, before the record
            raise KeyboardInterrupt
        return gens

    monkeypatch.setattr(run_mod, "serve_chunks", interrupt_second)
    assert cli.main(_sweep(tiny, out)) == cli.EXIT_INTERRUPTED
    assert "1 of 2 configuration(s) saved" in capsys.readouterr().err, "the message counts what is on disk"
    assert not (out / LOCK).exists(), "Ctrl-C releases the lock"
    ledger = read_ledger(out / "ledger.jsonl")
    assert list(ledger.unfinished.values()) == ["aborted"]
    (aborted,) = ledger.unfinished
    with pytest.raises(AccountingError, match="did not finish"):
        pool_runs(ledger, [aborted])
    assert any(r["run_id"] == aborted and r["kind"] == "phase" for r in ledger), "its phases are on disk"
    assert all(r["run_id"] != aborted for r in finished(ledger)), "but totals over the file leave them out"
    monkeypatch.setattr(run_mod, "serve_chunks", real)
    assert cli.main(_sweep(tiny, out)) == 0
    assert list(read_ledger(out / "ledger.jsonl").unfinished) == [aborted], "the resumed run completed"
    assert "1 ledger run(s) did not finish (1 aborted)" in (out / "report.md").read_text()


def test_a_killed_run_has_no_end_record(tmp_path):
    path = tmp_path / "l.jsonl"
    Ledger(path, run_id="killed")._fh.flush()  # opened, never closed: as after SIGKILL
    with Ledger(path, run_id="done", mode="a"):
        pass
    assert unfinished_runs(read_ledger(path)) == {"killed": "killed"}


def _grid(tiny, out: Path) -> list[str]:
    return [*_sweep(tiny, out), "--batch", "1,2", "--num-prompts", "2"]


def _outcome(out: Path) -> dict[str, tuple]:
    lines = [json.loads(line) for line in (out / "records.jsonl").read_text().split("\n") if line]
    assert len(lines) == len({r["config_id"] for r in lines}), "no configuration recorded twice"
    return {r["config_id"]: (r["output_digest"], r["tau"], r["run_tokens"]) for r in lines}


@pytest.fixture(scope="module")
def uninterrupted(tiny, tmp_path_factory) -> dict[str, tuple]:
    out = tmp_path_factory.mktemp("uninterrupted") / "out"
    assert cli.main(_grid(tiny, out)) == 0
    return _outcome(out)


@pytest.mark.parametrize("point", [1, 2, 4])
def test_resuming_after_ctrl_c_at_any_configuration_equals_an_uninterrupted_sweep(tiny, tmp_path, monkeypatch,
                                                                                 uninterrupted, point):
    import refspec.eval.run as run_mod

    out = tmp_path / "out"
    real = run_mod.serve_chunks
    calls = []

    def interrupt_at(*args, **kwargs):
        calls.append(1)
        gens = real(*args, **kwargs)
        if len(calls) == point:
            raise KeyboardInterrupt
        return gens

    monkeypatch.setattr(run_mod, "serve_chunks", interrupt_at)
    assert cli.main(_grid(tiny, out)) == cli.EXIT_INTERRUPTED
    monkeypatch.setattr(run_mod, "serve_chunks", real)
    assert cli.main(_grid(tiny, out)) == 0
    assert _outcome(out) == uninterrupted, "same configurations, outputs, tau and counts"
    ledger = read_ledger(out / "ledger.jsonl")
    assert list(ledger.unfinished.values()) == ["aborted"], "exactly the interrupted run is marked"
    summary = json.loads((out / "summary.json").read_text())
    pooled = pool_runs(finished(ledger), [rid for r in summary for rid in r["run_ids"]])
    assert pooled.emitted == sum(r["run_tokens"] for r in summary), "the complete runs account for every record"


def test_a_killed_run_s_temporary_directory_is_removed_by_the_next_run(tmp_path, monkeypatch):
    import tempfile

    from refspec.eval.outputs import scratch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()
    left = tmp_path / f"refspec-eval-{gone.pid}-abc"
    left.mkdir()
    (left / "ledger.jsonl").write_text("{}\n")
    alive = tmp_path / f"refspec-eval-{os.getpid()}-def"
    alive.mkdir()
    with scratch() as tmp:
        assert tmp.name.startswith(f"refspec-eval-{os.getpid()}-")
    assert not left.exists() and alive.exists(), "only the dead run's directory goes"


def test_sigterm_mid_sweep_releases_the_lock_and_marks_the_run_aborted(tiny, tmp_path):
    import signal

    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "refspec.eval", *_sweep(tiny, out, 400)],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (out / "ledger.jsonl").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)  # as Slurm does at the time limit
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == cli.EXIT_INTERRUPTED, err[-2000:]
    assert not (out / LOCK).exists(), "the lock goes with the process"
    ledger = read_ledger(out / "ledger.jsonl")
    runs = {r["run_id"] for r in ledger if r["kind"] == "run"}
    kept = {rid for line in _lines_of(out / "records.jsonl") for rid in json.loads(line)["run_ids"]}
    assert runs - kept <= set(ledger.unfinished), "every run no record names is marked unfinished"


def _lines_of(path: Path) -> list[str]:
    return [line for line in path.read_text().split("\n") if line.strip()] if path.exists() else []


LONG = ["--max-new-tokens", "96"]  # long enough to be killed mid-sweep


@pytest.fixture(scope="module")
def uninterrupted_long(tiny, tmp_path_factory) -> dict[str, tuple]:
    out = tmp_path_factory.mktemp("uninterrupted_long") / "out"
    assert cli.main([*_grid(tiny, out), *LONG]) == 0
    return _outcome(out)


@pytest.mark.parametrize("after", [1, 3])
def test_resuming_after_sigkill_equals_an_uninterrupted_sweep(tiny, tmp_path, uninterrupted_long, after):
    import signal

    out = tmp_path / "out"
    grid = [*_grid(tiny, out), *LONG]
    proc = subprocess.Popen([sys.executable, "-m", "refspec.eval", *grid], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    records = out / "records.jsonl"
    deadline = time.monotonic() + 90
    while proc.poll() is None and time.monotonic() < deadline:
        if records.exists() and records.read_text().count("\n") >= after:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)  # no cleanup at all: the lock and an open ledger run stay behind
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL and (out / LOCK).exists(), "killed mid-sweep, its lock left behind"
    assert records.read_text().count("\n") < 4, "some configurations were still to run"
    assert cli.main(grid) == 0, "the stale lock is taken over and the sweep resumes"
    assert _outcome(out) == uninterrupted_long
    ledger = read_ledger(out / "ledger.jsonl")
    assert set(ledger.unfinished.values()) <= {"killed"}, "a killed run has no end record and is told apart"


def test_runs_whose_record_never_landed_are_marked_aborted(tiny, tmp_path, monkeypatch):
    import refspec.eval.run as run_mod

    out = tmp_path / "out"
    real = run_mod.append_record
    calls = []

    def interrupt_second(path, record):
        calls.append(record.stream.run_ids)
        if len(calls) == 2:  # the configuration's runs completed in the ledger; its record is lost
            raise KeyboardInterrupt
        real(path, record)

    monkeypatch.setattr(run_mod, "append_record", interrupt_second)
    assert cli.main(_sweep(tiny, out)) == cli.EXIT_INTERRUPTED
    assert sorted(read_ledger(out / "ledger.jsonl").unfinished) == sorted(calls[1])
    assert set(read_ledger(out / "ledger.jsonl").unfinished.values()) == {"aborted"}
