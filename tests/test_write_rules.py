"""The write rules of the eval commands, each with the case that broke it.

* A configuration's ledger runs count only with their record: an interruption anywhere from its
  first run to its record's append (the log line after it, a second lockstep batch) leaves them
  marked aborted, never complete without a record.
* ``--export-acceptance`` merges into its own earlier file (a resumed or second sweep keeps the
  configurations measured before) and refuses a file that is not one.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


from refspec.energy.ledger.read import read_ledger
from refspec.eval import cli
from test_eval_cli import QUIET, one_thread, tiny  # noqa: F401  (fixtures)


def _sweep(tiny, out: Path, *extra: str) -> list[str]:  # noqa: F811
    return ["sweep", "--model", str(tiny["model"]), "--corpus", str(tiny["prompts"]), "--batch", "1",
            "--drafter", "ngram", "--num-prompts", "1", "--max-new-tokens", "4", "--meter", "time", *QUIET,
            "--out", str(out), *extra]


def _complete_without_record(out: Path) -> set[str]:
    """Ledger runs marked complete that no record of ``out`` names (the state the rule forbids)."""
    ledger = read_ledger(out / "ledger.jsonl")
    runs = {r["run_id"] for r in ledger if r.get("kind") == "run"}
    named: set[str] = set()
    if (out / "records.jsonl").exists():
        named = {i for line in (out / "records.jsonl").read_text().splitlines() for i in json.loads(line)["run_ids"]}
    return runs - set(ledger.unfinished) - named


def test_an_interrupt_at_the_log_line_leaves_no_complete_run_without_record(tiny, tmp_path, monkeypatch):  # noqa: F811
    import refspec.eval.run as run_mod

    out = tmp_path / "out"
    real_info = run_mod.log.info

    def interrupt_after_the_tau_line(msg, *args, **kw):
        real_info(msg, *args, **kw)
        if "tau" in msg:  # the configuration's runs are complete in the ledger; its record is not appended yet
            raise KeyboardInterrupt

    monkeypatch.setattr(run_mod.log, "info", interrupt_after_the_tau_line)
    assert cli.main(_sweep(tiny, out, "--k", "2")) == cli.EXIT_INTERRUPTED
    ledger = read_ledger(out / "ledger.jsonl")
    assert ledger.unfinished and set(ledger.unfinished.values()) == {"aborted"}
    assert _complete_without_record(out) == set()


def test_an_interrupt_in_a_second_lockstep_batch_aborts_the_first(tiny, tmp_path, monkeypatch):  # noqa: F811
    from refspec.eval import pipeline

    out = tmp_path / "out"
    real = pipeline.serve

    def interrupt_batch_1(engine, requests, *, seed, **kw):
        if seed == 1:  # batch 0 (seed 0) completed and its run was ended; batch 1 is interrupted
            raise KeyboardInterrupt
        return real(engine, requests, seed=seed, **kw)

    monkeypatch.setattr(pipeline, "serve", interrupt_batch_1)
    args = _sweep(tiny, out, "--k", "0", "--schedule", "static", "--requests", "2")
    assert cli.main(args) == cli.EXIT_INTERRUPTED
    assert read_ledger(out / "ledger.jsonl").unfinished and _complete_without_record(out) == set()


def test_export_acceptance_merges_across_runs_into_one_file(tiny, tmp_path):  # noqa: F811
    from refspec.eval.injection import load_acceptance_models

    export = tmp_path / "acc.json"
    assert cli.main(_sweep(tiny, tmp_path / "a", "--k", "2", "--export-acceptance", str(export))) == 0
    assert cli.main(_sweep(tiny, tmp_path / "b", "--k", "3", "--export-acceptance", str(export))) == 0
    assert sorted(m.k for m in load_acceptance_models(export)) == [2, 3], "the first run's K=2 model was lost"
    assert cli.main(_sweep(tiny, tmp_path / "c", "--k", "3", "--export-acceptance", str(export))) == 0
    assert sorted(m.k for m in load_acceptance_models(export)) == [2, 3], "a re-measured K replaces its model"


def test_export_acceptance_refuses_a_file_it_did_not_write(tiny, tmp_path, capsys):  # noqa: F811
    other = tmp_path / "notes.json"
    other.write_text('{"mine": 1}\n')
    assert cli.main(_sweep(tiny, tmp_path / "a", "--k", "2", "--export-acceptance", str(other))) == 2
    assert other.read_text() == '{"mine": 1}\n' and not (tmp_path / "a").exists()
    assert "not a refspec.acceptance/1 file" in capsys.readouterr().err


def test_the_export_schema_check_matches_the_writer():
    from refspec.eval.cli_checks import ACCEPTANCE_SCHEMA
    from refspec.eval.injection import SCHEMA

    assert ACCEPTANCE_SCHEMA == SCHEMA


def test_a_closed_stdout_still_writes_every_file(tiny, tmp_path):  # noqa: F811
    """``... | head`` closes stdout before the table prints: the report, plots and records are still written."""
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "refspec.eval", *_sweep(tiny, out, "--k", "2")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    proc.stdout.close()  # the reader is gone before the first line
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "Broken pipe" not in err and "BrokenPipeError" not in err, err[-2000:]
    assert (out / "report.md").exists() and (out / "summary.json").exists() and list(out.glob("*.png"))


def test_nan_and_inf_in_a_record_never_reach_the_plots_as_a_traceback(tiny, tmp_path):  # noqa: F811
    """A record with NaN or inf in every figure (a hand edit, a broken counter) still gets a report, or one line."""
    out = tmp_path / "out"
    assert cli.main(_sweep(tiny, out, "--k", "0,2")) == 0
    lines = (out / "records.jsonl").read_text().splitlines()
    for bad in (float("nan"), float("inf")):
        rec = json.loads(lines[-1])
        rec.update({k: bad for k, v in rec.items() if isinstance(v, float)})
        (out / "records.jsonl").write_text("\n".join([*lines[:-1], json.dumps(rec)]) + "\n")
        proc = subprocess.run([sys.executable, "-m", "refspec.eval", "report", str(out)], capture_output=True,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
        assert proc.returncode in (0, 2) and "Traceback" not in proc.stderr, proc.stderr[-2000:]
