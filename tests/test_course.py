"""The course (``docs/course``): every notebook runs top to bottom, and its key figures are the library's.

Each notebook runs in a Jupyter kernel (nbclient) in its short test mode (``REFSPEC_COURSE_QUICK=1``:
fewer requests and tokens, the same lesson). Its cells tagged ``key`` print the lecture's key
figures; a check cell appended to the notebook recomputes them in the same kernel from the
library alone (the ledger read back and accounted by :func:`refspec.energy.accounting.headline.pool_runs`,
the roofline's predictions, the latency chooser) and prints them in the same format; the two
printouts must be equal line for line, so a notebook whose figures went stale, or were computed
by hand, fails. Notebooks that run SmolLM2 are in the ``real`` tier.

The lab API (:mod:`refspec.eval.lab`) is tested on a tiny random llama with a word-level tokenizer.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

COURSE = Path(__file__).resolve().parent.parent / "docs" / "course"
NOTEBOOKS = sorted(p.stem for p in COURSE.glob("*.ipynb"))
NEEDS_SMOLLM2 = {"00_ledger", "02_block_drafters", "03_low_acceptance", "04_text_acceptance",
                 "05_verification_dominates", "08_attribution_failures"}

_ACCOUNT = """
from refspec.energy.accounting.headline import pool_runs
from refspec.energy.ledger.read import read_ledger


def account(report):
    return pool_runs(read_ledger(report.ledger), list(report.run_ids))
"""

CHECKS = {
    "00_ledger": _ACCOUNT + """
acc = account(r)
print(f"J/token (run): {acc.j_per_token:.5f}")
print(f"J/token (window): {acc.window_j_per_token:.5f}")
print(f"tau: {acc.tau:.3f}")
print(f"verify share: {acc.phase_share['verify']:.1%}")
""",
    "01_batch_effect": """
from refspec.energy.model.architectures import arch
from refspec.energy.model.hardware import get_profile
from refspec.energy.model.roofline import compute_bound_batch, predict_step

t, h = arch("llama-3.1-8b"), get_profile("h100")
p = {(b, k): predict_step(t, h, batch=b, k=k, context=512, acceptance=0.7) for b in (1, 64) for k in (0, 3)}
print(f"ridge of the h100: {h.ridge:.0f} FLOP/B")
print(f"plain J/token at batch 1: {p[1, 0].j_per_token:.4f}")
print(f"plain J/token at batch 64: {p[64, 0].j_per_token:.4f}")
print(f"saving at batch 1: {1 - p[1, 3].j_per_token / p[1, 0].j_per_token:.1%}")
print(f"saving at batch 64: {1 - p[64, 3].j_per_token / p[64, 0].j_per_token:.1%}")
print(f"verify (K=3) turns compute-bound at batch: {compute_bound_batch(t, h, k=3, context=512)}")
""",
    "02_block_drafters": _ACCOUNT + """
from refspec.energy.model.architectures import arch
from refspec.energy.model.hardware import get_profile
from refspec.energy.model.roofline import EAGLE_HEAD, DrafterModel, compute_bound_batch, predict_step
from refspec.eval.acceptance_models import acceptance_from_tau
from refspec.eval.roofline_cli import loss_regions

t, h = arch("llama-3.1-8b"), get_profile("h100")
blk = DrafterModel(name="block-5layer", layers=5, fc_inputs=5, parallel=True)
for name, d, k, a in (("EAGLE K=3, a=0.7", EAGLE_HEAD, 3, 0.7), ("block K=15, a=0.85", blk, 15, 0.85)):
    lost = loss_regions(t, h, k=k, context=512, acceptance=a, drafter=d)
    print(f"{name}: verify compute-bound from batch {compute_bound_batch(t, h, k=k, context=512)}, "
          f"loses from batch {lost[0][0] if lost else None}")
for b in (1, 64):
    s = predict_step(t, h, batch=b, k=15, context=512, acceptance=0.85, drafter=blk)
    p = predict_step(t, h, batch=b, k=0, context=512, acceptance=0.85)
    print(f"block saving at batch {b}: {1 - s.j_per_token / p.j_per_token:.1%}")
tau = account(block).tau
a = acceptance_from_tau(tau, 7)
lost = loss_regions(t, h, k=7, context=512, acceptance=a,
                    drafter=DrafterModel(name="block-1layer", layers=1, fc_inputs=3, parallel=True))
print(f"SmolLM2 block head, K=7, code: measured tau {tau:.3f}")
print(f"per-draft acceptance with that tau: {a:.3f}")
print(f"loses from batch: {lost[0][0] if lost else None}")
""",
    "03_low_acceptance": _ACCOUNT + """
from refspec.energy.model.hardware import get_profile
from refspec.energy.model.roofline import forward_cost
from refspec.energy.model.work import ForwardShape

for corpus, rep in runs.items():
    acc, plain = account(rep), account(rep.plain)
    saving = 1 - acc.window_j_per_token / plain.window_j_per_token
    print(f"{corpus}: drafts rejected {1 - acc.acceptance_rate:.1%}, "
          f"charged to rejected drafts {acc.rejected_share:.1%}, "
          f"J/token {acc.window_j_per_token:.5f} against plain {plain.window_j_per_token:.5f}, saving {saving:.1%}")
acc = account(runs["conversation"])
h = get_profile("h100")


def energy(positions):
    c = forward_cost(ForwardShape(args=smol.args, rows=1, tokens_per_row=positions,
                                  context_tokens=runs["conversation"].record.roofline["context"] + positions,
                                  dtype_bytes=smol.dtype_bytes))
    return h.energy_j(c, h.time_s(c))


avg = acc.verify_rejected_j / acc.rejected_positions
marg = energy(5) - energy(4)
print(f"average cost of a rejected position: {avg * 1e3:.3f} mJ")
print(f"marginal cost of the fifth position: {marg * 1e3:.4f} mJ")
print(f"marginal / average: {marg / avg:.1%}")
""",
    "04_text_acceptance": _ACCOUNT + """
for d in ("ngram", "eagle"):
    taus = [(c, account(runs[d, c]).tau) for c in ("code", "conversation", "english", "romansh")]
    print(f"{d}: " + ", ".join(f"{c} tau {tau:.3f}" for c, tau in taus))
""",
    "05_verification_dominates": _ACCOUNT + """
from refspec.energy.model.architectures import arch
from refspec.energy.model.hardware import get_profile
from refspec.energy.model.roofline import predict_step

for b, rep in runs.items():
    share = account(rep).phase_share
    print(f"SmolLM2 + EAGLE, batch {b}: draft {share['draft']:.1%}, verify {share['verify']:.1%}")
for b in (1, 256):
    p = predict_step(arch("llama-3.1-8b"), get_profile("h100"), batch=b, k=4, context=512, acceptance=0.7)
    print(f"llama-3.1-8b + EAGLE K=4: verify share at batch {b}: {p.verify_energy_j / p.step_energy_j:.1%}")
""",
    "06_latency_targets": """
from refspec.energy.accounting.latency import cost_of_tighter_target
from refspec.energy.model.architectures import arch
from refspec.energy.model.hardware import get_profile
from refspec.energy.model.roofline import predict_step

t, h = arch("llama-3.1-8b"), get_profile("h100")
recs = []
for b in [2 ** i for i in range(11)]:
    for k in (0, 1, 3, 7):
        p = predict_step(t, h, batch=b, k=k, context=512, acceptance=0.7)
        recs.append({"batch": b, "k": k, "drafter": "none" if k == 0 else "eagle", "tpot_p99_s": p.tpot_s,
                     "energy_per_token_j": p.j_per_token})
ok = [r for r in cost_of_tighter_target(recs, [0.03, 0.02, 0.015, 0.01, 0.008, 0.006, 0.005, 0.004, 0.003, 0.0025,
                                               0.002]) if r["feasible"]]
for what, r in (("loosest target", ok[0]), ("tightest target met", ok[-1])):
    print(f"{what} {r['target_s'] * 1e3:g} ms: {r['drafter']} k{r['k']} b{r['batch']}, "
          f"{r['energy_per_token_j']:.4f} J/token")
print(f"premium of the tightest target: {ok[-1]['energy_per_token_j'] / ok[0]['energy_per_token_j'] - 1:+.1%}")
""",
    "07_dvfs": """
from refspec.energy.model.architectures import arch
from refspec.energy.model.roofline import predict_step


def direct(batch, k, **assumptions):
    def at(f):
        return predict_step(arch("llama-3.1-8b"), at_clock(f, **assumptions), batch=batch, k=k, context=512,
                            acceptance=0.7)
    base = at(1980)
    ok = [(f, at(f)) for f in range(900, 1980, 90) if at(f).tpot_s <= base.tpot_s * 1.05]
    best = min([base.j_per_token] + [p.j_per_token for _, p in ok])
    return min((f for f, _ in ok), default=None), 1 - best / base.j_per_token


for prefix, kw in (("", {}), ("other assumptions, ", dict(v_min=0.85, bw_knee=1500))):
    for b, k in ((1, 0), (1, 3), (64, 0), (64, 3), (256, 3)):
        mhz, saving = direct(b, k, **kw)
        if prefix:
            print(f"other assumptions, batch {b} K={k}: headroom down to {mhz} MHz, saving {saving:.1%}")
        else:
            print(f"batch {b} K={k}: headroom down to {mhz} MHz, saving at equal latency {saving:.1%}")
""",
    "08_attribution_failures": _ACCOUNT + """
for name, rep in (("fine counter", r), ("slow counter", r_slow)):
    acc = account(rep)
    print(f"{name}: method {acc.phase_energy_method}")
    truth, share = acc.phase_share_true["verify"], (acc.phase_share or {}).get("verify")
    if name == "fine counter":
        shown = "not printed" if share is None else format(share, ".1%")
        print(f"{name}: verify true {truth:.1%}, naive {acc.phase_share_naive['verify']:.1%}, attributed {shown}")
        print(f"{name}: additivity residual {acc.attribution['additivity_residual']:+.1%}")
    else:
        print(f"{name}: verify true {truth:.1%}, attributed {'not printed' if share is None else format(share, '.1%')}")
        if acc.phase_share:
            error = max(abs(acc.phase_share[p] - t) for p, t in acc.phase_share_true.items())
            print(f"{name}: largest error of a phase's share {100 * error:.1f} points")
""",
}
_MARK = "----- library check -----"


KERNEL = "refspec-tests"


def _kernel_of_this_python(root: Path) -> Path:
    """A Jupyter data folder whose kernel runs this interpreter (whatever other kernels are installed)."""
    spec = root / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({"argv": [sys.executable, "-m", "ipykernel_launcher", "-f",
                                                           "{connection_file}"],
                                                  "display_name": KERNEL, "language": "python"}))
    return root / "jupyter"


def _stream_text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream"
                   and o.get("name") == "stdout")


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.real] if n in NEEDS_SMOLLM2 else [])
                                  for n in NOTEBOOKS])
def test_notebook_runs_and_prints_the_librarys_figures(name, tmp_path, monkeypatch):
    """The notebook runs top to bottom in its test mode; its key cells print what the library computes."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(COURSE / f"{name}.ipynb", as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(f"print({_MARK!r})\n" + CHECKS[name]))
    monkeypatch.setenv("REFSPEC_COURSE_QUICK", "1")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the labs' folders
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    monkeypatch.setenv("JUPYTER_PATH", str(_kernel_of_this_python(tmp_path)))
    nbclient.NotebookClient(nb, timeout=600, kernel_name=KERNEL,
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    printed = [line for c in nb.cells[:-1] if "key" in c.metadata.get("tags", [])
               for line in _stream_text(c).splitlines()]
    expected = [line for line in _stream_text(nb.cells[-1]).split(_MARK, 1)[1].splitlines() if line]
    assert printed and printed == expected


# ---- the notebooks as files ---------------------------------------------------------------------
def test_committed_notebooks_are_built_from_their_sources():
    """``docs/course/build.py --check``: every notebook is its source's, without outputs."""
    out = subprocess.run([sys.executable, str(COURSE / "build.py"), "--check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert NOTEBOOKS == sorted(p.stem for p in (COURSE / "src").glob("*.py"))


def test_the_builder_refuses_a_source_it_cannot_read(tmp_path):
    sys.path.insert(0, str(COURSE))
    try:
        import build
    finally:
        sys.path.remove(str(COURSE))
    cells = build.cells("# %% [markdown]\n# # Title\n#\n# text\n\n# %% key\nprint(1)\n")
    assert [(c["cell_type"], c["source"], c["metadata"]) for c in cells] == [
        ("markdown", "# Title\n\ntext", {}), ("code", "print(1)", {"tags": ["key"]})]
    with pytest.raises(ValueError, match="must start with"):
        build.cells("# %% [markdown]\nnot a comment\n")
    with pytest.raises(ValueError, match="before the first cell marker"):
        build.cells("print(1)\n# %%\n")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_each_lecture_says_what_is_measured_and_what_a_gpu_changes(name):
    """Each lecture names measured / modelled / injected figures, says what a GPU run would change,
    has two or three exercises with answers in a collapsed block, a plot, key figures and a check."""
    nb = json.loads((COURSE / f"{name}.ipynb").read_text())
    text = "\n".join(c["source"] for c in nb["cells"] if c["cell_type"] == "markdown")
    code = "\n".join(c["source"] for c in nb["cells"] if c["cell_type"] == "code")
    assert "Measured, modelled or injected?" in text
    assert "## What a GPU run would change" in text
    exercises = text.split("## Exercises", 1)[1]
    assert "<details>" in exercises and "</details>" in exercises
    assert 2 <= sum(exercises.split("<details>")[0].count(f"\n{i}. ") for i in (1, 2, 3)) <= 3
    assert "plt." in code or "Image(" in code
    assert any("key" in c["metadata"].get("tags", []) for c in nb["cells"]) and name in CHECKS
    assert all(not c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")


# ---- the lab API on a tiny model ----------------------------------------------------------------


PROMPTS = [" ".join(f"w{3 + (j * (i + 2)) % 20}" for j in range(10 + i)) for i in range(4)]


@pytest.fixture(scope="module")
def tiny_lab(tmp_path_factory):
    """A lab of a tiny random llama, energy modelled on an H100, and one n-gram run compared with plain."""
    from tiny import save_hf, save_tokenizer

    from refspec.eval import lab

    model = tmp_path_factory.mktemp("tiny_lab_model")
    save_hf("llama", model)
    save_tokenizer(model)
    the_lab = lab.load(str(model), meter="roofline:h100", out=tmp_path_factory.mktemp("tiny_lab") / "runs")
    report = the_lab.run("ngram", k=3, batch=2, prompts=PROMPTS, requests=6, max_new_tokens=8, compare=True)
    return the_lab, report


def test_a_report_holds_the_accountings_figures(tiny_lab):
    from refspec.energy.accounting.headline import energy_saving, pool_runs
    from refspec.energy.ledger.read import read_ledger

    _, r = tiny_lab
    acc = pool_runs(read_ledger(r.ledger), list(r.run_ids))
    assert (r.tau, r.j_per_token_run, r.j_per_token_window, r.energy_j) == (
        acc.tau, acc.j_per_token, acc.window_j_per_token, acc.total_energy_j)
    assert r.phase_share == acc.phase_share and r.line_items_j == acc.line_items_j
    assert r.label == "ngram k3 b2" and r.batch == 2 and r.requests == 6 and len(r.per_request) == 6
    assert r.energy_source.startswith("modelled") and r.measured is False and r.time_source == "modelled"
    assert r.plain is not None and r.plain.drafter == "none" and r.plain.tau == 1.0
    assert r.saving_vs_plain == energy_saving(r.j_per_token_window, r.plain.j_per_token_window)
    assert sum(q.energy_j for q in r.per_request) + sum(r.named_items_j.values()) == pytest.approx(r.energy_j)
    assert r.split is None  # no counter: every phase's energy was given directly


def test_a_report_is_frozen_and_reads_as_a_summary(tiny_lab):
    _, r = tiny_lab
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.tau = 2.0  # type: ignore[misc]
    text = repr(r)
    assert text.splitlines()[0].startswith("ngram k3 b2 on ") and "record" not in text
    for needle in ("modelled (not measured)", "J/token: window", "tau ", "phases (share", "vs plain decoding: "):
        assert needle in text


def test_the_lab_writes_what_the_command_line_reads(tiny_lab):
    """records.jsonl and ledger.jsonl as ``run --out`` writes them; plain decoding runs once per setting."""
    from refspec.eval import cli
    from refspec.eval.record_files import read_records

    the_lab, r = tiny_lab
    before = read_records([the_lab.paths.records]).by_id
    again = the_lab.run("ngram", k=3, batch=2, prompts=PROMPTS, requests=6, max_new_tokens=8, compare=True)
    after = read_records([the_lab.paths.records])
    assert len(before) == 2 and len(after.by_id) == 2  # the plain run was not repeated
    assert again.plain is r.plain and again.run_ids != r.run_ids
    assert after.by_id[r.record.config_id].counts.tau == again.tau
    assert cli.main(["report", str(the_lab.out)]) == 0
    assert (the_lab.out / "report.md").exists()


def test_a_bad_setting_fails_before_anything_runs(tiny_lab, tmp_path):
    from refspec.drafting import DrafterError
    from refspec.eval import lab
    from refspec.eval.flags import UsageError

    the_lab, _ = tiny_lab
    lines = the_lab.paths.ledger.read_text().count("\n")
    with pytest.raises(DrafterError, match="unknown drafter"):
        the_lab.run("no-such-drafter", prompts=PROMPTS)
    with pytest.raises(UsageError, match="batch must be >= 1"):
        the_lab.run("ngram", k=2, batch=0, prompts=PROMPTS)
    with pytest.raises(UsageError, match="prompts"):
        the_lab.run("ngram", k=2, prompts="w3 w4")
    assert the_lab.paths.ledger.read_text().count("\n") == lines
    with pytest.raises(UsageError, match="--device"):
        lab.load("smollm2-135m", device="tpu", out=tmp_path)
