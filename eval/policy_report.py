"""Speculation policies in the report: K over the run, J/token beside every fixed K, the frontier.

Reads records (:class:`refspec.eval.record.RunRecord`; the K a policy chose per step is their
``work.k_steps``, from the ledger's verify records) and the ledger's per-step K; computes no
energy: every J/token drawn is a record's (the steady-state window's, else the whole run's, as
the report ranks them).

* :func:`comparison_rows`: per corpus, batch and drafter, each policy's J/token beside the best
  fixed K (K = 0, the baseline, included) and every fixed K's;
* :func:`frontier`: per corpus and batch, the lowest J/token any run reached at a median TPOT
  at or under each target (the fixed-K runs and the policy runs with ``tpot_ms`` swept);
* :func:`policy_section`: the Markdown and the plots (``policy_k.png``, ``policy_energy.png``,
  and with ``frontier=True`` ``frontier.png``).
"""
from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping, Sequence

from refspec.eval.plots import energy_label, panels, save
from refspec.eval.record import RunRecord
from refspec.eval.report_text import config_label, j_run, shown_j

Stairs = Mapping[tuple[str, int], Sequence[tuple[float, float, str]]]


def k_by_step(ledgers: Sequence[Path], run_ids: set[str]) -> dict[str, list[tuple[int, int]]]:
    """``(step, K)`` of every decode step per run id, as the ledger recorded them."""
    from refspec.energy.ledger.read import read_ledger

    out: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for path in ledgers:
        if Path(path).is_file():
            for rec in read_ledger(path):
                if rec.get("kind") == "phase" and rec.get("phase") == "verify" and rec.get("run_id") in run_ids:
                    out[rec["run_id"]].append((int(rec["step"]), int(rec.get("k") or 0)))
    return {rid: sorted(steps) for rid, steps in out.items()}


def _j(r: RunRecord) -> float | None:
    """The J/token the report ranks by: the steady-state window's, else the whole run's."""
    j = shown_j(r)
    return j if j is not None else j_run(r)


def _cell(r: RunRecord) -> tuple[str, int]:
    return r.corpus, r.batch


def _continuous(r: RunRecord) -> bool:
    return (r.stream.schedule or "continuous") == "continuous"


def comparison_rows(records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """Per (corpus, batch, drafter) with a policy run: each policy's J/token, the best fixed K's
    (the baseline is K = 0) and ``vs_best`` = policy / best - 1 (negative: the policy beats every fixed K)."""
    rows = []
    usable = [r for r in records if _j(r) is not None and _continuous(r)]
    for r in sorted((r for r in usable if r.spec_policy != "fixed"), key=lambda r: (*_cell(r), r.drafter,
                                                                                    r.spec_policy)):
        same = [f for f in usable if _cell(f) == _cell(r) and f.spec_policy == "fixed"
                and f.stream.stream_digest == r.stream.stream_digest and f.meter == r.meter
                and (f.is_baseline or (f.drafter == r.drafter and f.tree == r.tree))]
        fixed = {f.k: _j(f) for f in same}
        if not fixed:
            continue
        best_k = min(fixed, key=lambda k: (fixed[k], k))
        rows.append({"corpus": r.corpus, "batch": r.batch, "drafter": r.drafter, "policy": r.spec_policy,
                     "k_max": r.k, "j": _j(r), "k_mean": r.work.k_mean, "tpot_p50_s": r.latency.tpot_p50_s,
                     "fixed": dict(sorted(fixed.items())), "best_k": best_k, "best_j": fixed[best_k],
                     "vs_best": _j(r) / fixed[best_k] - 1.0})
    return rows


def frontier(records: Sequence[RunRecord]) -> dict[tuple[str, int], list[tuple[float, float, str]]]:
    """Per (corpus, batch): the staircase ``(median TPOT s, J/token, label)`` of runs no other run
    beats on both (sorted by TPOT; each step is the lowest J/token at a TPOT target from there on)."""
    cells: dict[tuple[str, int], list[tuple[float, float, str]]] = defaultdict(list)
    for r in records:
        j, t = _j(r), r.latency.tpot_p50_s
        if j is not None and t is not None and _continuous(r):
            cells[_cell(r)].append((float(t), float(j), config_label(r)))
    out = {}
    for cell, points in cells.items():
        stairs, best = [], math.inf
        for t, j, label in sorted(points):
            if j < best:
                stairs.append((t, j, label))
                best = j
        out[cell] = stairs
    return dict(sorted(out.items()))


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def comparison_md(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The policy-versus-fixed-K table."""
    if not rows:
        return []
    ks = sorted({k for r in rows for k in r["fixed"]})
    head = ("| corpus | batch | drafter | policy | J/token | mean K | " + " | ".join(f"K={k}" for k in ks)
            + " | best fixed | policy vs best |")
    out = ["## Speculation policies beside every fixed K", "",
           "J/token of each policy run and of every fixed-K run on the same stream (K = 0 is the baseline; "
           "steady-state window, else whole run). 'policy vs best' < 0: the policy beat every fixed K.", "",
           head, "|" + "---|" * (8 + len(ks))]
    for r in rows:
        cells = " | ".join(f"{r['fixed'][k]:.4g}" if k in r["fixed"] else "" for k in ks)
        mean_k = "n/a" if r["k_mean"] is None else f"{r['k_mean']:.2f}"
        out.append(f"| {r['corpus']} | {r['batch']} | {r['drafter']} | {r['policy']} (K<={r['k_max']}) | "
                   f"{r['j']:.4g} | {mean_k} | {cells} | K={r['best_k']} | {_pct(r['vs_best'])} |")
    return out + [""]


def frontier_md(stairs: Stairs) -> list[str]:
    out = ["## Energy-latency frontier", "",
           "Per corpus and batch, the lowest J/token reachable at each median-TPOT target: from a target at or "
           "above a row's TPOT on, that row's J/token (until the next row's) is the least any run reached.", "",
           "| corpus | batch | TPOT p50 (ms) from | lowest J/token | run |", "|---|---|---|---|---|"]
    for (corpus, batch), points in stairs.items():
        out += [f"| {corpus} | {batch} | {1e3 * t:.3g} | {j:.4g} | {label} |" for t, j, label in points]
    return out + [""]


def plot_k_over_run(records: Sequence[RunRecord], ledgers: Sequence[Path], path: Path) -> Path | None:
    """K per decode step of each policy run (its first ledger run), one panel per corpus and batch."""
    recs = [r for r in records if r.spec_policy != "fixed" and r.stream.run_ids]
    series = k_by_step(ledgers, {r.stream.run_ids[0] for r in recs})
    recs = [r for r in recs if series.get(r.stream.run_ids[0])]
    if not recs:
        return None
    cells = sorted({_cell(r) for r in recs})
    plt, fig, axes = panels(len(cells), height=3.2)
    for ax, cell in zip(axes, cells):
        for i, r in enumerate(r for r in recs if _cell(r) == cell):
            steps = series[r.stream.run_ids[0]]
            ax.step([s for s, _ in steps], [k + 0.06 * i for _, k in steps], where="post", lw=1, color=f"C{i % 10}",
                    label=f"{config_label(r)}, mean K {r.work.k_mean or 0:.2f}")
        ax.set_title(f"{cell[0]}, batch {cell[1]}", fontsize=10)
        ax.set_xlabel("decode step")
        ax.set_ylabel("K chosen (ledger)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    return save(plt, fig, path, "K the speculation policy chose at each decode step (first run of each "
                "configuration; series offset slightly so they do not hide each other)")


def plot_policy_energy(rows: Sequence[Mapping[str, Any]], records: Sequence[RunRecord], path: Path) -> Path | None:
    """J/token against fixed K (K = 0 the baseline) with each policy's J/token as a level line."""
    if not rows:
        return None
    cells = sorted({(r["corpus"], r["batch"], r["drafter"]) for r in rows})
    plt, fig, axes = panels(len(cells), height=3.4)
    for ax, (corpus, batch, drafter) in zip(axes, cells):
        sel = [r for r in rows if (r["corpus"], r["batch"], r["drafter"]) == (corpus, batch, drafter)]
        fixed = sel[0]["fixed"]
        ax.plot(list(fixed), list(fixed.values()), "o-", color="C0", label="fixed K")
        for i, r in enumerate(sel):
            ax.axhline(r["j"], color=f"C{i + 1}", ls="--", lw=1.2, label=f"{r['policy']} ({_pct(r['vs_best'])})")
        ax.set_title(f"{corpus}, batch {batch}, {drafter}", fontsize=9)
        ax.set_xlabel("K (fixed; 0 = no drafter)")
        ax.set_ylabel(energy_label(records))
        ax.set_xticks(sorted(fixed))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, title="vs best fixed K", title_fontsize=6)
    return save(plt, fig, path, "J/token of each speculation policy (dashed) beside every fixed K")


def plot_frontier(stairs: Stairs, records: Sequence[RunRecord], path: Path) -> Path | None:
    """Per (corpus, batch): every run's (median TPOT, J/token) and the frontier staircase."""
    if not stairs:
        return None
    plt, fig, axes = panels(len(stairs), height=3.6)
    for ax, (cell, points) in zip(axes, stairs.items()):
        recs = [r for r in records if _cell(r) == cell and _j(r) is not None and r.latency.tpot_p50_s is not None]
        for r in recs:
            pol = r.spec_policy != "fixed"
            x = 1e3 * r.latency.tpot_p50_s
            ax.plot(x, _j(r), "D" if pol else "o", color="C1" if pol else "C0", ms=4, alpha=0.8)
            ax.annotate(config_label(r).replace(f" b{cell[1]}", ""), (x, _j(r)), fontsize=5, alpha=0.7)
        xs = [1e3 * t for t, _, _ in points]
        ax.step(xs + [max(1e3 * r.latency.tpot_p50_s for r in recs) * 1.05], [j for _, j, _ in points]
                + [points[-1][1]], where="post", color="k", lw=1.2)
        ax.set_title(f"{cell[0]}, batch {cell[1]}", fontsize=10)
        ax.set_xlabel("TPOT p50 (ms)")
        ax.set_ylabel(energy_label(records))
        ax.grid(True, alpha=0.3)
    return save(plt, fig, path, "Energy-latency frontier: the lowest J/token reachable at each median-TPOT target "
                "(black staircase) from fixed-K runs (circles) and policy runs (diamonds)")


def policy_section(records: Sequence[RunRecord], out_dir: Path, ledgers: Sequence[Path], *,
                   frontier_plot: bool = False) -> tuple[list[str], list[Path]]:
    """The report's policy Markdown and plots (nothing without a policy run, unless ``frontier_plot``)."""
    rows = comparison_rows(records)
    md, plots = comparison_md(rows), []
    if any(r.spec_policy != "fixed" for r in records):
        plots += [plot_k_over_run(records, ledgers, out_dir / "policy_k.png"),
                  plot_policy_energy(rows, records, out_dir / "policy_energy.png")]
    if frontier_plot:
        stairs = frontier(records)
        md += frontier_md(stairs)
        plots.append(plot_frontier(stairs, records, out_dir / "frontier.png"))
    return md, [p for p in plots if p is not None]


__all__ = ["comparison_rows", "frontier", "k_by_step", "policy_section"]
