"""Tests of ``python -m refspec.eval``: run, sweep (resume, Slurm tasks), report, errors.

The fast tier runs the CLI in-process on a tiny random llama with a WordLevel tokenizer built
here (``tokenizer.json`` + ``tokenizer_config.json``, loaded by ``refspec.assets.tokenizer``) and a
prompt file of token words, so no asset is fetched. The ``real`` tier runs SmolLM2-135M with the
n-gram drafter on two built-in corpora.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from refspec.eval import cli
from refspec.eval.machine import auto_dtype, cpu_has_fast_bf16
from refspec.eval.record import RunRecord, fields_of_json
from refspec.eval.record_files import read_records
from refspec.energy.accounting.headline import pool_runs
from refspec.energy.accounting.text import format_closure
from refspec.energy.ledger.read import read_ledger

REQUIRED = ("model", "drafter", "k", "batch", "corpus", "dtype", "device", "tau", "run_tokens_per_s", "tpot_p50_s",
            "tpot_p99_s", "window_j_per_token", "run_j_per_token", "energy_source", "phase_energy_j", "baseline",
            "greedy_match_baseline", "versions", "requests_unique", "requests", "run_ids", "config_id")
QUIET = ["--no-progress", "--no-warmup"]


# ---- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the tiny model's matmuls are too small to share, and on a busy
    machine two spinning threads make each of them orders of magnitude slower."""
    import torch

    before = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # set_threads() keeps what the user set
        torch.set_num_threads(1)
        yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """A tiny llama directory with a tokenizer, and a prompt file of 5 prompts."""
    from tiny import save_hf, save_tokenizer

    root = tmp_path_factory.mktemp("tiny_eval")
    model = root / "model"
    model.mkdir()
    save_hf("llama", model)
    save_tokenizer(model)
    prompts = root / "prompts.jsonl"
    with open(prompts, "w") as fh:
        for i in range(5):
            words = " ".join(f"w{3 + (j * (i + 2)) % 20}" for j in range(10 + i))
            fh.write(json.dumps({"prompt": words, "kind": "code"}) + "\n")
    return {"model": model, "prompts": prompts, "root": root}


def _base(tiny: dict[str, Path]) -> list[str]:
    return ["--model", str(tiny["model"]), "--corpus", str(tiny["prompts"]), "--max-new-tokens", "6", *QUIET]


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().split("\n") if line.strip()]


@pytest.fixture(scope="module")
def run_dir(tiny, tmp_path_factory) -> Path:
    """One default-style run (ngram vs baseline, continuous, batch 4, 8 requests over 5 prompts) shared by several tests."""
    out = tmp_path_factory.mktemp("run")
    rc = cli.main([*_base(tiny), "--batch", "4", "--num-prompts", "5", "--requests", "8", "--latency-target", "10",
                   "--export-acceptance", str(out / "acceptance.json"), "--out", str(out)])
    assert rc == 0, "the run command failed on the tiny model"
    return out


# ---- run ------------------------------------------------------------------------------------------
def test_run_writes_every_file(run_dir):
    names = {p.name for p in run_dir.iterdir()}
    expected = {"summary.json", "records.jsonl", "ledger.jsonl", "report.md", "energy_vs_batch.png",
                "tau_by_corpus.png", "phase_energy.png", "latency_energy.png", "acceptance.json"}
    assert expected <= names, f"missing outputs: {sorted(expected - names)}"


def test_summary_has_one_object_per_configuration_with_the_required_fields(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [r["drafter"] for r in summary] == ["none", "ngram"], "baseline first, then the drafter"
    for r in summary:
        missing = [f for f in REQUIRED if f not in r]
        assert not missing, f"{r['config_id']} lacks {missing}"
        assert set(r) <= set(fields_of_json()), f"unknown record fields {sorted(set(r) - set(fields_of_json()))}"
    spec = summary[1]
    assert spec["requests_unique"] == 5 and spec["requests"] == 8 and spec["batches"] == 1, "8 requests, one run"
    assert spec["schedule"] == "continuous"
    assert spec["energy_source"].startswith("modelled:roofline(") and spec["energy_measured"] is False
    assert "modelled" in spec["energy_source_text"] and "not measured" in spec["energy_source_text"]
    assert spec["greedy_match_baseline"] is True, "fp32 greedy speculation must reproduce the baseline"
    assert spec["baseline"]["config_id"] == summary[0]["config_id"]
    assert spec["versions"]["refspec"] and spec["versions"]["torch"]
    assert set(spec["phase_energy_j"]) >= {"prefill", "draft", "verify", "commit"}


def test_record_figures_come_from_its_own_ledger_runs(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    ledger = read_ledger(run_dir / "ledger.jsonl")
    assert not ledger.corrupt
    all_ids = {r["run_id"] for r in ledger}
    for rec in summary:
        assert set(rec["run_ids"]) <= all_ids, "every run id of a record is in the ledger"
        phases = [r for r in ledger if r.get("kind") == "phase" and r["run_id"] in rec["run_ids"]]
        assert sum(r["energy_j"] for r in phases) == pytest.approx(rec["run_energy_j"], rel=1e-12)
        assert sum(r["emitted"] for r in phases) == rec["run_tokens"] <= rec["requests"] * 6


def test_record_figures_are_the_pooled_accounting_of_its_ledger_runs(run_dir):
    summary = json.loads((run_dir / "summary.json").read_text())
    ledger = read_ledger(run_dir / "ledger.jsonl")
    spec = summary[1]
    assert len(spec["run_ids"]) == 1, "a continuous stream is one ledger run"
    acc = pool_runs(ledger, spec["run_ids"])
    pairs = {"window_j_per_token": acc.window_j_per_token, "run_j_per_token": acc.j_per_token,
             "tau": acc.tau, "tpot_p50_s": acc.tpot_p50_s, "ttft_p99_s": acc.ttft_p99_s,
             "run_mean_active_rows": acc.mean_active_rows, "window_tokens": acc.window.tokens,
             "tpot_p99_s": acc.tpot_p99_s, "run_tokens_per_s": acc.tokens_per_s, "phase_share": acc.phase_share,
             "line_items_j": acc.line_items_j, "closes": acc.closes, "run_tokens": acc.emitted}
    for field, value in pairs.items():
        assert spec[field] == value, field
    # and directly from the raw phase records of the run
    phases = [r for r in ledger if r.get("kind") == "phase" and r["run_id"] in spec["run_ids"]]
    assert spec["run_j_per_token"] == pytest.approx(sum(r["energy_j"] for r in phases)
                                                       / sum(r["emitted"] for r in phases), rel=1e-12)


def test_report_prints_the_closure_line_of_every_configuration(run_dir):
    md = (run_dir / "report.md").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "## Closure" in md
    for r in summary:
        assert r["closes"] is True
        assert r["line_items_sum_j"] == pytest.approx(sum(r["line_items_j"].values()), rel=1e-12)
        assert r["line_items_sum_j"] == pytest.approx(r["run_energy_j"], rel=1e-9)
        line = format_closure(r["line_items_j"], r["line_items_sum_j"], r["run_energy_j"], r["closure_error_j"],
                              r["closes"], method=r.get("phase_energy_method"))
        assert line.endswith("-> OK") and f"`{line}`" in md, f"{r['config_id']}: closure line missing from report.md"


def test_report_states_source_licences_and_caveat(run_dir):
    md = (run_dir / "report.md").read_text()
    assert "modelled (not measured)" in md
    assert "CC-BY-NC-4.0" in md and "memorised" in md, "licences and the memorisation caveat"
    assert "Latency target" in md and "What tighter targets cost" in md
    assert "Every run in the ledgers completed." in md


def test_exported_acceptance_loads_and_injects(run_dir, tiny, tmp_path, capsys):
    from refspec.eval.injection import load_acceptance_models

    models = load_acceptance_models(run_dir / "acceptance.json")
    assert len(models) == 1 and models[0].drafter == "ngram" and models[0].k == 4
    assert models[0].provenance.kind == "measured"
    rc = cli.main([*_base(tiny), "--batch", "2", "--num-prompts", "2", "--accept-model",
                   str(run_dir / "acceptance.json"), "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "ACCEPTANCE INJECTED" in out, "the printed table must say acceptance was injected"
    spec = [r for r in json.loads((tmp_path / "summary.json").read_text()) if r["drafter"] != "none"][0]
    assert spec["acceptance_injected"] is True and spec["greedy_match_baseline"] is None
    assert "ACCEPTANCE INJECTED" in (tmp_path / "report.md").read_text()


def test_printed_table_names_the_energy_source(tiny, tmp_path, capsys):
    rc = cli.main([*_base(tiny), "--batch", "2", "--num-prompts", "2", "--meter", "time"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "tau" in out and "TPOT p99 ms" in out and "vs baseline" in out
    assert "not recorded (time-only meter)" in out, "a time-only run must say it has no energy"


# ---- sweep: resume, interruption, Slurm --------------------------------------------------------------
def _sweep_args(tiny: dict[str, Path], out: Path) -> list[str]:
    return ["sweep", *_base(tiny), "--batch", "1,2", "--k", "0,2", "--drafter", "ngram", "--num-prompts", "2",
            "--max-new-tokens", "4", "--out", str(out)]


def _ids(path: Path) -> list[str]:
    out = []
    for line in _lines(path):
        try:
            out.append(json.loads(line)["config_id"])
        except (json.JSONDecodeError, KeyError):
            pass
    return out


def test_sweep_resume_after_corruption_loses_and_duplicates_nothing(tiny, tmp_path, capsys):
    assert cli.main(_sweep_args(tiny, tmp_path)) == 0
    records = tmp_path / "records.jsonl"
    first = _ids(records)
    assert len(first) == 4 and len(set(first)) == 4, "k=0 runs once per batch: 2 baselines + 2 ngram"
    lines = _lines(records)
    # a crash mid-write: the last record is cut in half, plus a line of garbage
    records.write_text("\n".join(lines[:-1]) + "\n" + "{not json}\n" + lines[-1][: len(lines[-1]) // 2])
    capsys.readouterr()
    assert cli.main(_sweep_args(tiny, tmp_path)) == 0
    captured = capsys.readouterr()
    assert "corrupt" in captured.err, "corrupt lines are reported"
    assert "3 configuration(s) were already done" in captured.out
    loaded = read_records([records])
    assert sorted(r.config_id for r in loaded.records) == sorted(first), "nothing lost"
    assert loaded.duplicates == 0, "nothing duplicated"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary) == 4
    assert all(r["greedy_match_baseline"] for r in summary if r["drafter"] != "none")


def test_interrupted_sweep_keeps_finished_configurations(tiny, tmp_path, monkeypatch, capsys):
    import refspec.eval.sweep as sweep_mod

    real = sweep_mod.run_configuration
    calls: list[str] = []

    def flaky(session, cfg, **kw):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(cfg.config_id)
        return real(session, cfg, **kw)

    monkeypatch.setattr(sweep_mod, "run_configuration", flaky)
    assert cli.main(_sweep_args(tiny, tmp_path)) == cli.EXIT_INTERRUPTED
    assert "2 of 4 configuration(s) saved" in capsys.readouterr().err, "the count is what is on disk"
    assert _ids(tmp_path / "records.jsonl") == calls, "each finished configuration is on disk"
    monkeypatch.setattr(sweep_mod, "run_configuration", real)
    assert cli.main(_sweep_args(tiny, tmp_path)) == 0
    ids = _ids(tmp_path / "records.jsonl")
    assert len(ids) == 4 and len(set(ids)) == 4 and ids[:2] == calls, "the rerun adds only the missing two"


def test_slurm_tasks_write_their_own_records_and_report_merges(tiny, tmp_path, capsys):
    assert cli.main([*_sweep_args(tiny, tmp_path), "--print-sbatch"]) == 0
    script = (tmp_path / "sweep.sbatch").read_text()
    assert "#SBATCH --array=0-3" in script and "--task-index \"$SLURM_ARRAY_TASK_ID\"" in script
    assert "--print-sbatch" not in script.split("#SBATCH --output")[1]
    assert not (tmp_path / "records.jsonl").exists(), "--print-sbatch runs nothing"
    for task in (2, 3):  # plan order: b1 baseline, b1 ngram, b2 baseline, b2 ngram
        assert cli.main([*_sweep_args(tiny, tmp_path), "--task-index", str(task)]) == 0
    assert sorted(p.name for p in (tmp_path / "records").iterdir()) == ["task-2.jsonl", "task-3.jsonl"]
    assert (tmp_path / "ledgers" / "task-3.jsonl").exists()
    capsys.readouterr()
    assert cli.main(["report", str(tmp_path)]) == 0
    assert "merged 2 records file(s), 2 configuration(s)" in capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    spec = [r for r in summary if r["drafter"] == "ngram"]
    assert len(spec) == 1 and spec[0]["batch"] == 2
    assert spec[0]["baseline"] is not None, "report joins a task's record with the baseline another task ran"
    assert spec[0]["greedy_match_baseline"] is True
    assert (tmp_path / "report.md").exists() and (tmp_path / "energy_vs_batch.png").exists()


def test_report_command_renders_from_a_run_directory(run_dir, capsys):
    assert cli.main(["report", str(run_dir), "--latency-target", "5"]) == 0
    out = capsys.readouterr().out
    assert "ngram k4 b4" in out and "energy_vs_batch.png" in out


# ---- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, message", [
    (["--batch", "x"], "invalid int value"),
    (["--bogus-flag"], "unrecognized arguments"),
    (["--corpus", "no-such-corpus"], "--corpus 'no-such-corpus' is unknown"),
    (["--corpus", "/nonexistent/prompts.jsonl"], "cannot read prompt file"),
    (["--drafter", "no-such-drafter"], "--drafter 'no-such-drafter' is unknown; available"),
    (["--accept-model", "/nonexistent/acc.json"], "no such file"),
    (["--meter", "bogus"], "--meter 'bogus' is unknown"),
    (["--tree"], "--tree is EAGLE-2"),
    (["--dtype", "int3"], "--dtype 'int3' is unknown"),
    (["--k", "-1"], "--k must be an integer >= 0"),
    (["--latency-target", "0"], "--latency-target must be a finite number > 0"),
    (["--phase-loops-s", "1e9"], "--phase-loops-s must be a finite number >= 0 and <= 3600"),
    (["--phase-loops-s", "nan"], "--phase-loops-s must be a finite number >= 0 and <= 3600"),
    (["--threads", "0"], "--threads must be an integer >= 1"),
    (["--threads", "many"], "--threads expects a number or auto"),
])
def test_bad_flags_exit_2_without_traceback(tiny, extra, message, capsys):
    rc = cli.main([*_base(tiny), *extra])
    err = capsys.readouterr().err
    assert rc == 2, f"{extra} should be a usage error"
    assert message in err, f"expected {message!r} in: {err}"
    assert "Traceback" not in err


def test_unreadable_inputs_exit_2(tiny, tmp_path, capsys):
    bad_acc = tmp_path / "acc.json"
    bad_acc.write_text("{not json")
    no_tokenizer = tmp_path / "weights-only"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tokenizer / name).symlink_to(tiny["model"] / name)
    cases = [
        ["--model", str(tmp_path / "no-model"), "--corpus", str(tiny["prompts"]), *QUIET],
        ["--model", str(no_tokenizer), "--corpus", str(tiny["prompts"]), *QUIET],
        [*_base(tiny), "--accept-model", str(bad_acc)],
        ["report", str(tmp_path / "missing-dir")],
        ["report", str(tmp_path)],  # a directory without records
    ]
    for argv in cases:
        rc = cli.main(argv)
        err = capsys.readouterr().err
        assert rc == 2 and "error:" in err and "Traceback" not in err, f"{argv}: rc {rc}, {err}"


def test_drafter_without_a_trained_head_is_a_clear_error_before_any_run(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("REFSPEC_HOME", str(tmp_path / "home"))
    rc = cli.main([*_base(tiny), "--drafter", "eagle", "--batch", "1", "--num-prompts", "1",
                   "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "no eagle head" in err and "train" in err
    assert not (tmp_path / "o" / "records.jsonl").exists(), "nothing ran: no silent fallback, no wasted baseline"


def test_help_starts_with_every_command_one_line_each_and_run_has_its_own_help(capsys):
    from refspec.eval.cli_args import COMMANDS, PARSED, TOOLS

    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ")]
    assert listed == list(COMMANDS), "every command, in order, one line each"
    assert set(COMMANDS) == set(PARSED) | set(TOOLS), "every listed command is dispatched"
    assert len(out.splitlines()) < 30 and "docs/fields.md" in out and "docs/corpora.md" in out
    assert cli.main(["run", "--help"]) == 0
    run_help = capsys.readouterr().out
    assert "--drafter" in run_help and "--batch" in run_help and "CC-BY-NC-4.0" not in run_help


# ---- dtype ------------------------------------------------------------------------------------------
def test_auto_dtype_is_fp32_on_cpus_without_native_bf16():
    import torch

    plain = "flags\t\t: fpu sse2 avx2 fma\n"
    assert not cpu_has_fast_bf16(plain)
    assert auto_dtype(torch.device("cpu"), plain) == "fp32"
    assert auto_dtype(torch.device("cpu"), "flags\t: avx2 avx512f avx512_bf16\n") == "bf16"
    assert auto_dtype(torch.device("cpu"), "flags\t: avx2 amx_tile amx_bf16\n") == "bf16"
    assert auto_dtype(torch.device("cuda"), plain) == "bf16"


def test_the_evaluations_auto_dtype_is_fp32_on_every_cpu(monkeypatch):
    """``--dtype auto`` of run and sweep: fp32 on a CPU even with native bf16, so greedy requests equal the baseline."""
    import torch

    from refspec.eval import cli_plan, machine

    monkeypatch.setattr(machine, "cpu_has_fast_bf16", lambda *a: True)
    assert cli_plan._resolve_dtype("auto", torch.device("cpu")) == "fp32"
    assert cli_plan._resolve_dtype("auto", torch.device("cuda")) == "bf16"
    assert cli_plan._resolve_dtype("bfloat16", torch.device("cpu")) == "bf16", "--dtype says otherwise"


# ---- real tier ----------------------------------------------------------------------------------------
@pytest.mark.real
def test_smollm2_ngram_on_two_corpora(tmp_path, capsys):
    rc = cli.main(["--model", "smollm2-135m", "--drafter", "ngram", "--corpus", "code,conversation",
                   "--num-prompts", "2", "--batch", "2", "--max-new-tokens", "12", "--dtype", "fp32",
                   "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert sorted((r["corpus"], r["drafter"]) for r in summary) == [
        ("code", "ngram"), ("code", "none"), ("conversation", "ngram"), ("conversation", "none")]
    for r in summary:
        assert r["window_j_per_token"] > 0 and r["run_tokens_per_s"] > 0
        if r["drafter"] == "ngram":
            assert r["tau"] >= 1.0
            assert r["greedy_match_baseline"] is True, f"{r['corpus']}: fp32 greedy n-gram must match plain decoding"
    assert "code" in capsys.readouterr().out


def test_draft_model_without_a_pinned_sibling_asks_for_one_then_records_it(tiny, tmp_path, capsys):
    argv = [*_base(tiny), "--drafter", "draft-model", "--batch", "1", "--num-prompts", "1", "--meter", "time",
            "--no-baseline"]
    assert cli.main([*argv, "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --drafter draft-model needs --draft-model for "), err
    assert not (tmp_path / "a" / "records.jsonl").exists()
    assert cli.main([*argv, "--draft-model", "self:1", "--out", str(tmp_path / "b")]) == 0
    (record,) = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert record["config"]["drafter_options"] == {"draft_model": "self:1"}


def test_the_default_draft_is_the_pinned_qwen_sibling_only_for_larger_qwen_targets():
    from types import SimpleNamespace

    from refspec.drafters.draft_model import default_draft_model

    def target(family, layers, hidden):
        return SimpleNamespace(args=SimpleNamespace(family=family, num_layers=layers, hidden_size=hidden))

    assert default_draft_model(target("qwen2", 28, 1536)) == "qwen2.5-coder-0.5b", "Qwen2.5-Coder-1.5B"
    assert default_draft_model(target("qwen2", 24, 896)) is None, "the 0.5B itself would draft for itself"
    assert default_draft_model(target("llama", 30, 576)) is None, "SmolLM2: no pinned sibling"


def test_log_axes_over_less_than_a_decade_get_a_few_labels_that_do_not_overlap():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from refspec.eval.plots import legible_log

    fig, ax = plt.subplots(figsize=(5, 4))
    ax.plot([92.5, 110.0], [0.0275, 0.0325], "o")  # the default run's span: matplotlib labels its minor ticks
    ax.set_xscale("log")
    ax.set_yscale("log")
    legible_log(ax)
    fig.canvas.draw()
    for axis in (ax.xaxis, ax.yaxis):
        assert not [t for t in axis.get_minorticklabels() if t.get_text()], "minor ticks stay unlabelled"
        lo, hi = sorted(axis.get_view_interval())
        index = int(axis is ax.yaxis)  # a label's position along its own axis
        shown = [t for t in axis.get_majorticklabels() if t.get_text() and lo <= t.get_position()[index] <= hi]
        assert 2 <= len(shown) <= 6, [t.get_text() for t in shown]
        boxes = [t.get_window_extent() for t in shown]
        assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), "labels overlap"
    plt.close(fig)


def test_a_table_of_records_with_different_budgets_says_mixed_instead_of_quoting_one(run_dir):
    import dataclasses

    from refspec.eval.report import format_table

    records = [RunRecord.from_json(r) for r in json.loads((run_dir / "summary.json").read_text())]
    stream = dataclasses.replace(records[1].stream, max_new_tokens=3)  # as in a directory two sweeps wrote into
    records[1] = dataclasses.replace(records[1], stream=stream)
    table = format_table(records)
    assert "MIXED budgets up to 6 new tokens" in table and " / budgets up to 3 new tokens" in table
    assert "MIXED" not in format_table(records[:1])


def test_run_without_batch_and_corpus_runs_the_default_cells_and_either_flag_one_grid():
    from refspec.eval.cli_args import normalise_argv, parser
    from refspec.eval.cli_plan import build_plan

    def cells(*argv):
        configs = build_plan(parser().parse_args(normalise_argv(list(argv))), sweep=False).configs
        return sorted({(c.corpus, c.batch) for c in configs}), sorted({c.drafter for c in configs})

    assert cells() == ([("code", 1), ("conversation", 8)], ["ngram", "none"])
    assert cells("--batch", "8")[0] == [("code", 8), ("conversation", 8)]
    assert cells("--corpus", "conversation")[0] == [("conversation", 1)]
    assert cells("--corpus", "math", "--batch", "2", "--drafter", "eagle") == ([("math", 2)], ["eagle", "none"])
    assert cells("--drafter", "eagle", "--batch", "64") == ([("code", 64), ("conversation", 64)], ["eagle", "none"]), \
        "no command: run"
