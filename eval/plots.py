"""The report's plots (matplotlib, Agg), each drawn from configuration records as they are.

Every value drawn is a figure of a record (:class:`refspec.eval.record.RunRecord`), computed
by :mod:`refspec.energy.accounting`, or (active rows) the ledger's own per-step count; nothing
is averaged or divided here. Files, in the report directory:

* ``energy_vs_batch.png``: J per output token against batch per drafter and K, one panel per
  corpus, with the roofline prediction of the same configurations dashed;
* ``tau_by_corpus.png``: acceptance length tau per corpus per drafter and K, one marker per batch;
* ``phase_energy.png``: J per output token of each configuration, stacked by phase (a
  configuration whose split failed its gate: one hatched bar of its measured total, no phases);
* ``latency_energy.png``: p99 TPOT against J per output token, one panel per corpus, the
  p99 TPOT target drawn and the lowest-energy configuration meeting every target marked
  (:func:`refspec.energy.accounting.latency.choose`);
* ``window_vs_run.png``: J per output token over the steady-state window and over the whole
  run against batch, per corpus (records with serving window fields only);
* ``active_rows.png``: active rows per decode step as the ledger recorded them, per corpus and
  batch, the steady-state window shaded (the one plot that reads the ledger: raw counts).

Every figure says where its energy came from (measured by which counter, or modelled by which
roofline profile), and every injected-acceptance run is labelled as such.

The other report modules draw their plots with the same pieces: :func:`panels` (a grid of
axes), :func:`save` (title, write, free), :func:`energy_label` (the J/token axis label, saying
measured or MODELLED) and :func:`legible_log`.
"""
from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping, Sequence

from refspec.energy.accounting.split_gate import withheld
from refspec.eval.baseline import compared_j_per_token
from refspec.eval.outputs import atomic_target
from refspec.eval.record import RunRecord
from refspec.eval.report_text import (PHASE_ORDER, config_label, corpora, energy_sources, fmt, has_window, is_static,
                                      j_run, j_window, series_label, shown_j, sort_key, with_energy)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _suptitle(fig: Any, text: str) -> None:
    """A figure title wrapped to the figure's width, with room kept for it above the panels."""
    import textwrap

    width_chars = max(40, int(fig.get_figwidth() * 14))
    wrapped = textwrap.fill(text, width_chars)
    fig.suptitle(wrapped, fontsize=8)
    fig.tight_layout()  # matplotlib keeps room for the suptitle


def legible_log(ax: Any, x_ticks: Sequence[float] | None = None) -> None:
    """Plain-number labels on the log axes of ``ax``, never overlapping.

    Over less than a decade matplotlib labels every minor tick (9.25e1 ... 1.1e2 run into one
    line); there a few evenly spread major ticks are labelled instead, and minor ticks never are.
    ``x_ticks`` (e.g. the batch sizes run) replaces the x ticks.
    """
    from matplotlib import ticker

    plain = ticker.FuncFormatter(lambda v, _: f"{v:.3g}")
    for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
        if axis.get_scale() != "log":
            continue
        axis.set_minor_formatter(ticker.NullFormatter())
        axis.set_major_formatter(plain)
        if lo > 0 and hi / lo < 10:
            axis.set_major_locator(ticker.MaxNLocator(nbins=4, min_n_ticks=2))
    if x_ticks:
        ax.xaxis.set_major_locator(ticker.FixedLocator(sorted(set(x_ticks))))
        ax.xaxis.set_minor_locator(ticker.NullLocator())


def energy_label(records: Sequence[RunRecord], which: bool = False) -> str:
    """``J per output token (measured)``; ``which``: also say whose J/token the values are (window or run)."""
    measured = all(r.energy.energy_measured for r in records)
    text = "J per output token (" + ("measured" if measured else "MODELLED") + ")"
    if not which:
        return text
    windows = [has_window(r) and not is_static(r) for r in records]
    return text + ("\nsteady-state window" if all(windows) else "\nwhole run" if not any(windows)
                   else "\nwindow, else whole run (static or old records)")


def panels(n: int, width: float = 5.0, height: float = 4.0) -> tuple[Any, Any, list[Any]]:
    """``(pyplot, figure, n axes)``: a grid of at most three columns, the spare axes hidden."""
    plt = _plt()
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return plt, fig, flat[:n]


def _colors(records: Sequence[RunRecord]) -> dict[str, str]:
    names = sorted({series_label(r) for r in records}, key=lambda s: (not s.startswith("none"), s))
    return {name: f"C{i % 10}" for i, name in enumerate(names)}


def _batch_panel(ax: Any, recs: Sequence[RunRecord], corpus: str, xlabel: str, ylabel: str,
                 legend_title: str, fontsize: int) -> None:
    """A corpus's log-log panel against batch: ticks at its batches, labels, grid and legend."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    legible_log(ax, x_ticks=[r.batch for r in recs if r.corpus == corpus])
    ax.set_title(corpus, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=fontsize, title=legend_title, title_fontsize=fontsize)


def save(plt: Any, fig: Any, path: Path, title: str | None = None) -> Path:
    """Title the figure (None: laid out as it is), write it to ``path`` atomically and free it."""
    if title is None:
        fig.tight_layout()
    else:
        _suptitle(fig, title)
    with atomic_target(path) as tmp:
        fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    return path


def series_by_batch(recs: Sequence[RunRecord], corpus: str) -> list[tuple[str, list[RunRecord]]]:
    """``corpus``'s records grouped per series (sorted by name), each series sorted by batch."""
    series: dict[str, list[RunRecord]] = defaultdict(list)
    for r in recs:
        if r.corpus == corpus:
            series[series_label(r)].append(r)
    return [(name, sorted(rows, key=lambda r: r.batch)) for name, rows in sorted(series.items())]


def plot_energy_vs_batch(records: Sequence[RunRecord], path: Path) -> Path | None:
    """J/token against batch per series, roofline predictions dashed, one panel per corpus."""
    recs = [r for r in records if compared_j_per_token(r) is not None]
    if not recs:
        return None
    corpus_names = corpora(recs)
    colors = _colors(recs)
    plt, fig, axes = panels(len(corpus_names))
    for ax, corpus in zip(axes, corpus_names):
        for name, rows in series_by_batch(recs, corpus):
            bs = [r.batch for r in rows]
            ax.plot(bs, [shown_j(r) for r in rows], "o-", color=colors[name], label=name)
            bad = [r for r in rows if r.window is not None and r.window.valid is False]  # invalid: a hollow marker
            if bad:
                ax.plot([r.batch for r in bad], [shown_j(r) for r in bad], "o", mfc="white", color=colors[name],
                        label=f"{name}: window invalid")
            pred = [(r.batch, r.roofline["j_per_token"]) for r in rows if r.roofline]
            if pred:
                ax.plot([b for b, _ in pred], [e for _, e in pred], "x--", color=colors[name], alpha=0.6, lw=1)
        _batch_panel(ax, recs, corpus, "batch", energy_label(recs, which=True), "solid: run; dashed: roofline", 7)
    return save(plt, fig, path, "Energy per output token vs batch (" + "; ".join(energy_sources(recs)) + ")")


def plot_tau_by_corpus(records: Sequence[RunRecord], path: Path) -> Path | None:
    """tau of every configuration, grouped by corpus and offset by drafter and K (one marker per batch)."""
    recs = [r for r in records if not r.is_baseline and r.counts.tau is not None]
    if not recs:
        return None
    plt = _plt()
    names = sorted({series_label(r) for r in recs})
    colors = _colors(recs)
    corpus_names = corpora(recs)
    # width grows with the series but stays readable; the legend goes beside the axes
    fig, ax = plt.subplots(figsize=(min(13.0, max(5.0, 0.25 * len(corpus_names) * len(names) + 4)), 4.5))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        sel = [r for r in recs if series_label(r) == name]
        xs = [corpus_names.index(r.corpus) + (j - (len(names) - 1) / 2) * width for r in sel]
        ax.scatter(xs, [r.counts.tau for r in sel], color=colors[name], label=name, s=18)
        points: dict[tuple[float, float], list[int]] = defaultdict(list)
        for x, r in zip(xs, sel):  # batches at one tau share one label instead of printing over each other
            points[(x, round(float(r.counts.tau), 2))].append(r.batch)
        for (x, tau), batches in points.items():
            ax.annotate("b" + ",".join(map(str, sorted(batches))), (x, tau), fontsize=6, xytext=(3, 2),
                        textcoords="offset points")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(corpus_names)))
    ax.set_xlim(-0.6, len(corpus_names) - 0.4)  # room for the labels of the last corpus
    ax.set_xticklabels(corpus_names, rotation=20, fontsize=8)
    ax.set_ylabel("tau (accepted + 1 per verify step)")
    injected = " (includes INJECTED acceptance)" if any(r.acceptance_injected for r in recs) else ""
    ax.set_title("Acceptance length per corpus, one marker per batch" + injected, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=1 + len(names) // 16)
    ax.grid(True, axis="y", alpha=0.3)
    return save(plt, fig, path)


def _withheld(r: RunRecord) -> bool:
    return withheld(r.energy.phase_energy_method, r.energy.attribution) is not None


def plot_phase_energy(records: Sequence[RunRecord], path: Path) -> Path | None:
    """Stacked bars of J per output token by phase for every configuration; a configuration whose
    split failed its gate gets one hatched bar of its measured total and no phases."""
    recs = sorted((r for r in records if r.energy.phase_j_per_token or (_withheld(r) and r.run.j_per_token)),
                  key=sort_key)
    if not recs:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(recs) + 2), 4.5))
    bottom = [0.0] * len(recs)
    for i, phase in enumerate(PHASE_ORDER):
        vals = [float((r.energy.phase_j_per_token or {}).get(phase, 0.0)) for r in recs]
        if not any(vals):
            continue
        ax.bar(range(len(recs)), vals, bottom=bottom, label=phase, color=f"C{i}")
        bottom = [b + v for b, v in zip(bottom, vals)]
    # a counter's energy no phase was given (host time; all of it where the split was not resolved)
    rest = [float(r.energy.unattributed_energy_j or 0.0) / r.run.tokens if r.run.tokens and not _withheld(r) else 0.0
            for r in recs]
    if any(rest):
        ax.bar(range(len(recs)), rest, bottom=bottom, label="unattributed", color="0.75")
    total = [float(r.run.j_per_token) if _withheld(r) else 0.0 for r in recs]
    if any(total):
        ax.bar(range(len(recs)), total, label="measured total only (the split failed its gate)", color="white",
               edgecolor="0.3", hatch="//")
    ax.set_xticks(range(len(recs)))
    ax.set_xticklabels([f"{config_label(r)}\n{r.corpus}" for r in recs], rotation=70, fontsize=6)
    ax.set_ylabel(energy_label(recs) + " by phase")
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    methods = sorted({r.energy.phase_energy_method for r in recs if r.energy.phase_energy_method})
    split = f"; split {', '.join(methods)}" if methods else ""
    failed = sum(map(_withheld, recs))
    split += f"; {failed} split(s) withheld, reasons in report.md" if failed else ""
    return save(plt, fig, path, "Phase energy per output token (" + "; ".join(energy_sources(recs)) + split + ")")


def plot_latency_energy(records: Sequence[RunRecord], path: Path, target_s: float | None,
                        choices: Mapping[str, Any] | None) -> Path | None:
    """p99 TPOT against J/token per corpus; the target line and the chosen configuration marked."""
    recs = with_energy(records)
    if not recs:
        return None
    corpus_names = corpora(recs)
    colors = _colors(recs)
    plt, fig, axes = panels(len(corpus_names))
    for ax, corpus in zip(axes, corpus_names):
        rows = [r for r in recs if r.corpus == corpus]
        for name in sorted({series_label(r) for r in rows}):
            sel = sorted((r for r in rows if series_label(r) == name), key=lambda r: r.batch)
            ax.plot([1e3 * r.latency.tpot_p99_s for r in sel], [shown_j(r) for r in sel], "o-",
                    color=colors[name], label=name, alpha=0.8)
            for r in sel:
                ax.annotate(f"b{r.batch}", (1e3 * r.latency.tpot_p99_s, shown_j(r)), fontsize=6,
                            xytext=(3, 3), textcoords="offset points")
        if target_s is not None:
            ax.axvline(1e3 * target_s, color="r", ls="--", lw=1, label=f"target p99 {1e3 * target_s:g} ms")
        choice = (choices or {}).get(corpus)
        chosen = None if choice is None else choice.chosen
        if chosen is not None:
            ax.plot([1e3 * chosen.latency.tpot_p99_s], [shown_j(chosen)], "*", ms=16, color="gold",
                    markeredgecolor="k", label=f"chosen (meets every target): {config_label(chosen)}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        legible_log(ax)
        ax.set_xlabel("TPOT p99 (ms per token per user)")
        ax.set_ylabel(energy_label(recs, which=True))
        ax.set_title(corpus, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    return save(plt, fig, path, "Latency-energy trade-off (" + "; ".join(energy_sources(recs)) + ")")


def plot_window_vs_run(records: Sequence[RunRecord], path: Path) -> Path | None:
    """J/token of the steady-state window (solid) and of the whole run (dashed) against batch, per corpus.

    Only records with serving window fields are drawn; the gap between the two lines is what
    ramp-up and drain add to a run's J/token. A static-schedule series draws its run line only.
    """
    recs = [r for r in records if has_window(r) and _finite(j_window(r)) and _finite(j_run(r))]
    if not recs:
        return None
    corpus_names = corpora(recs)
    colors = _colors(recs)
    plt, fig, axes = panels(len(corpus_names))
    for ax, corpus in zip(axes, corpus_names):
        for name, rows in series_by_batch(recs, corpus):
            bs = [r.batch for r in rows]
            if not any(is_static(r) for r in rows):  # a static series has no steady state: its run line only
                ax.plot(bs, [j_window(r) for r in rows], "o-", color=colors[name], label=f"{name}: window")
            ax.plot(bs, [j_run(r) for r in rows], "s--", color=colors[name], mfc="none", alpha=0.7,
                    label=f"{name}: run")
        _batch_panel(ax, recs, corpus, "batch (slots kept busy)", energy_label(recs),
                     "solid: steady-state window; dashed: whole run", 6)
    return save(plt, fig, path, "J/token over the steady-state window and over the whole run (ramp-up and drain "
                "included) (" + "; ".join(energy_sources(recs)) + ")")


def active_rows_by_step(ledgers: Sequence[Path], run_ids: set[str]) -> dict[str, list[tuple[int, int]]]:
    """``rows_active`` of each decode step as the ledger recorded it, per run id (prefill phases left out)."""
    from refspec.energy.ledger.read import read_ledger

    rows: dict[str, dict[int, int]] = defaultdict(dict)
    for path in ledgers:
        if not Path(path).is_file():
            continue
        for rec in read_ledger(path):
            rid = rec.get("run_id")
            if rec.get("kind") == "phase" and rid in run_ids and rec.get("phase") != "prefill" and rec["step"] >= 0:
                rows[rid][int(rec["step"])] = max(rows[rid].get(int(rec["step"]), 0), int(rec.get("rows_active", 0)))
    return {rid: sorted(steps.items()) for rid, steps in rows.items()}


def plot_active_rows(records: Sequence[RunRecord], ledgers: Sequence[Path], path: Path) -> Path | None:
    """Active rows over decode steps, one panel per corpus and batch, the steady-state window shaded.

    Drawn from the ledger's ``rows_active`` of each decode step of a configuration's first run
    and the record's ``window_first_step``/``window_last_step``; a record without them is skipped.
    """
    recs = [r for r in records if r.stream.run_ids and r.window is not None and r.window.first_step is not None]
    series = active_rows_by_step(ledgers, {r.stream.run_ids[0] for r in recs})
    recs = [r for r in recs if series.get(r.stream.run_ids[0])]
    if not recs:
        return None
    cells = sorted({(r.corpus, r.batch) for r in recs})
    colors = _colors(recs)
    plt, fig, axes = panels(len(cells), height=3.2)
    for ax, (corpus, batch) in zip(axes, cells):
        for r in (r for r in recs if (r.corpus, r.batch) == (corpus, batch)):
            steps = series[r.stream.run_ids[0]]
            c = colors[series_label(r)]
            ax.step([s for s, _ in steps], [n for _, n in steps], where="post", color=c, lw=1,
                    label=f"{series_label(r)}, mean {fmt(r.run.mean_active_rows, '.1f')}")
            ax.axvspan(r.window.first_step, r.window.last_step + 1, color=c, alpha=0.12)
        ax.set_ylim(0, batch * 1.08)
        ax.set_title(f"{corpus}, batch {batch}", fontsize=10)
        ax.set_xlabel("decode step")
        ax.set_ylabel("active rows (ledger)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, title="shaded: steady-state window", title_fontsize=6)
    return save(plt, fig, path,
                "Active rows per decode step (first run of each configuration); the steady-state window shaded")


def _finite(x: Any) -> bool:
    return x is not None and math.isfinite(float(x))


def write_plots(records: Sequence[RunRecord], out_dir: Path, target_s: float | None,
                choices: Mapping[str, Any] | None, ledgers: Sequence[Path] = ()) -> list[Path]:
    """Draw every plot into ``out_dir``; returns the files written (a plot without data is skipped)."""
    plots = (plot_energy_vs_batch(records, out_dir / "energy_vs_batch.png"),
             plot_tau_by_corpus(records, out_dir / "tau_by_corpus.png"),
             plot_phase_energy(records, out_dir / "phase_energy.png"),
             plot_latency_energy(records, out_dir / "latency_energy.png", target_s, choices),
             plot_window_vs_run(records, out_dir / "window_vs_run.png"),
             plot_active_rows(records, ledgers, out_dir / "active_rows.png"))
    return [p for p in plots if p is not None]


__all__ = ["panels", "save", "energy_label", "legible_log", "series_by_batch", "active_rows_by_step",
           "plot_energy_vs_batch", "plot_tau_by_corpus", "plot_phase_energy", "plot_latency_energy",
           "plot_window_vs_run", "plot_active_rows", "write_plots"]
