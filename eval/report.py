"""Reports of evaluation records: text tables, Markdown and PNG plots (matplotlib, Agg).

Input: configuration records (:data:`refspec.eval.records.RECORD_FIELDS`) from ``records.jsonl``
and any Slurm task files (:func:`refspec.eval.sweep.read_records`). Output, in the sweep
directory: ``report.md`` and four plots:

* ``energy_vs_batch.png``: J per output token against batch per drafter and K, one panel per
  corpus, with the roofline prediction of the same configurations dashed;
* ``tau_by_corpus.png``: acceptance length tau per corpus per drafter and K;
* ``phase_energy.png``: J per output token of each configuration, stacked by phase;
* ``latency_energy.png``: p99 TPOT against J per output token, one panel per corpus, the
  latency target drawn and the lowest-energy configuration meeting it marked
  (:func:`refspec.energy.latency.choose_config`).

Every figure says where its energy came from (measured by which counter, or modelled by which
roofline profile), and every injected-acceptance run is labelled as such.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

log = logging.getLogger(__name__)

PHASE_ORDER = ("prefill", "draft", "verify", "commit", "other")
TIGHTER = (1.0, 0.75, 0.5, 0.25)
"""Latency targets reported, as fractions of the given target."""


# ---- small formatting helpers ---------------------------------------------------------------
def _f(x: Any, spec: str, scale: float = 1.0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return format(float(x) * scale, spec)


def config_label(r: Mapping[str, Any]) -> str:
    """``none b8`` / ``ngram k4 b8`` (``tree`` and ``injected`` marked)."""
    if r.get("drafter") == "none":
        return f"none b{r['batch']}"
    tree = " tree" if r.get("tree") else ""
    inj = " INJECTED" if r.get("acceptance_injected") else ""
    return f"{r['drafter']}{tree} k{r['k']} b{r['batch']}{inj}"


def series_label(r: Mapping[str, Any]) -> str:
    """Drafter and K, the series a plot draws across batches."""
    if r.get("drafter") == "none":
        return "none (baseline)"
    return f"{r['drafter']}{' tree' if r.get('tree') else ''} k={r['k']}"


def _phases(r: Mapping[str, Any]) -> str:
    share = r.get("phase_share")
    if not share:
        return "n/a"
    return "/".join(f"{100 * share.get(p, 0.0):.0f}" for p in PHASE_ORDER[:4])


def _vs_baseline(r: Mapping[str, Any]) -> str:
    if r.get("drafter") == "none":
        return "(baseline)"
    saving, speed = r.get("energy_saving_vs_baseline"), r.get("speedup_vs_baseline")
    if saving is None and speed is None:
        return "no baseline"
    parts = []
    if saving is not None:
        parts.append(f"{-100 * saving:+.1f}% J/tok ({'saving' if saving >= 0 else 'loss'})")
    if speed is not None:
        parts.append(f"{speed:.2f}x tok/s")
    return ", ".join(parts)


def _match(r: Mapping[str, Any]) -> str:
    m = r.get("greedy_match_baseline")
    if m is None:
        return "-"
    if m:
        return "yes"
    return f"no ({r.get('greedy_rows_matching')}/{r.get('rows')} rows)"


def energy_sources(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """Distinct energy sources in words."""
    return sorted({str(r.get("energy_source_text") or r.get("energy_source")) for r in records})


def injection_lines(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """The injection label of every injected record (deduplicated)."""
    out = []
    for r in records:
        if r.get("acceptance_injected"):
            label = (r.get("injection") or {}).get("label") or "ACCEPTANCE INJECTED"
            if label not in out:
                out.append(label)
    return out


def _rows(records: Sequence[Mapping[str, Any]]) -> str:
    """``rows decoded: 4 at batch 1, 8 at batch 8``."""
    by_batch = {int(r["batch"]): r.get("rows") for r in records}
    return "rows decoded: " + ", ".join(f"{n} at batch {b}" for b, n in sorted(by_batch.items()))


def _sort_key(r: Mapping[str, Any]) -> tuple:
    return (str(r.get("corpus")), int(r.get("batch", 0)), r.get("drafter") != "none", str(r.get("drafter")),
            int(r.get("k", 0)))


# ---- the text table (CLI) ---------------------------------------------------------------------
def format_table(records: Sequence[Mapping[str, Any]]) -> str:
    """One fixed-width table of the records, grouped by corpus, with the energy source stated."""
    head = (f"{'configuration':<26}{'tau':>6}{'tok/s':>9}{'TPOT p50 ms':>13}{'TPOT p99 ms':>13}"
            f"{'J/token':>11}  {'prefill/draft/verify/commit %':<30}{'greedy=base':<13}vs baseline")
    lines: list[str] = []
    for line in injection_lines(records):
        lines.append(f"!! {line}")
    by_corpus: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for r in sorted(records, key=_sort_key):
        by_corpus[str(r.get("corpus"))].append(r)
    for corpus, rows in by_corpus.items():
        first = rows[0]
        lines.append(f"corpus {corpus}: model {first.get('model')}, {first.get('dtype')} on {first.get('device')}, "
                     f"{first.get('prompts_unique')} prompts ({_rows(rows)}), "
                     f"{first.get('max_new_tokens')} new tokens per row, "
                     f"{'greedy' if first.get('greedy') else 'temperature ' + str(first.get('temperature'))}")
        lines.append(head)
        lines.append("-" * len(head))
        for r in rows:
            lines.append(f"{config_label(r):<26}{_f(r.get('tau'), '.3f'):>6}{_f(r.get('tokens_per_s'), '.2f'):>9}"
                         f"{_f(r.get('tpot_p50_s'), '.1f', 1e3):>13}{_f(r.get('tpot_p99_s'), '.1f', 1e3):>13}"
                         f"{_f(r.get('energy_per_token_j'), '.4g'):>11}  {_phases(r):<30}{_match(r):<13}"
                         f"{_vs_baseline(r)}")
        lines.append("")
    srcs = energy_sources(records)
    lines.append("J/token source: " + "; ".join(srcs))
    if any(not r.get("energy_measured") for r in records) and any(r.get("energy_per_token_j") is not None
                                                                   for r in records):
        lines.append("  (modelled figures are estimates from the analytic model, not measurements)")
    if any(r.get("time_source") == "modelled" for r in records):
        lines.append("  time, tokens/s and TPOT are MODELLED by the roofline meter, not measured")
    lines.append("J/token counts every phase (prefill included) over emitted tokens: only accepted tokens count.")
    return "\n".join(lines)


# ---- latency targets --------------------------------------------------------------------------
def _with_energy(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in records if r.get("energy_per_token_j") is not None and r.get("tpot_p99_s") is not None]


def latency_choices(records: Sequence[Mapping[str, Any]], target_s: float) -> dict[str, dict[str, Any]]:
    """Per corpus: the chosen configuration at ``target_s`` and the cost of tighter targets."""
    from refspec.energy.latency import choose_config, cost_of_tighter_target

    out: dict[str, dict[str, Any]] = {}
    by_corpus: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for r in _with_energy(records):
        by_corpus[str(r["corpus"])].append(r)
    for corpus, rows in by_corpus.items():
        out[corpus] = {"chosen": choose_config(rows, target_s),
                       "tighter": cost_of_tighter_target(rows, [target_s * f for f in TIGHTER])}
    return out


# ---- plots ------------------------------------------------------------------------------------
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


def _energy_label(records: Sequence[Mapping[str, Any]]) -> str:
    measured = all(r.get("energy_measured") for r in records)
    return "J per output token (" + ("measured" if measured else "MODELLED") + ")"


def _corpora(records: Sequence[Mapping[str, Any]]) -> list[str]:
    return sorted({str(r["corpus"]) for r in records})


def _panels(n: int, width: float = 5.0, height: float = 4.0):
    plt = _plt()
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return plt, fig, flat[:n]


def _colors(records: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    names = sorted({series_label(r) for r in records}, key=lambda s: (not s.startswith("none"), s))
    return {name: f"C{i % 10}" for i, name in enumerate(names)}


def plot_energy_vs_batch(records: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """J/token against batch per series, roofline predictions dashed, one panel per corpus."""
    recs = [r for r in records if r.get("energy_per_token_j") is not None]
    if not recs:
        return None
    corpora = _corpora(recs)
    colors = _colors(recs)
    plt, fig, axes = _panels(len(corpora))
    for ax, corpus in zip(axes, corpora):
        series: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
        for r in recs:
            if r["corpus"] == corpus:
                series[series_label(r)].append(r)
        for name, rows in sorted(series.items()):
            rows = sorted(rows, key=lambda r: r["batch"])
            bs = [r["batch"] for r in rows]
            ax.plot(bs, [r["energy_per_token_j"] for r in rows], "o-", color=colors[name], label=name)
            pred = [(r["batch"], r["roofline"]["j_per_token"]) for r in rows if r.get("roofline")]
            if pred:
                ax.plot([b for b, _ in pred], [e for _, e in pred], "x--", color=colors[name], alpha=0.6, lw=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{corpus}", fontsize=10)
        ax.set_xlabel("batch")
        ax.set_ylabel(_energy_label(recs))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, title="solid: run; dashed: roofline", title_fontsize=7)
    _suptitle(fig, "Energy per output token vs batch (" + "; ".join(energy_sources(recs)) + ")")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_tau_by_corpus(records: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Grouped bars: tau (mean over batches) per corpus per drafter and K."""
    recs = [r for r in records if r.get("drafter") != "none" and r.get("tau") is not None]
    if not recs:
        return None
    plt = _plt()
    corpora = _corpora(recs)
    names = sorted({series_label(r) for r in recs})
    colors = _colors(recs)
    # width grows with the bars but stays readable; the legend goes beside the axes
    fig, ax = plt.subplots(figsize=(min(13.0, max(5.0, 0.25 * len(corpora) * len(names) + 4)), 4.5))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        vals = []
        for corpus in corpora:
            taus = [r["tau"] for r in recs if r["corpus"] == corpus and series_label(r) == name]
            vals.append(sum(taus) / len(taus) if taus else 0.0)
        ax.bar([i + (j - (len(names) - 1) / 2) * width for i in range(len(corpora))], vals, width,
               label=name, color=colors[name])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(corpora)))
    ax.set_xticklabels(corpora, rotation=20, fontsize=8)
    ax.set_ylabel("tau (accepted + 1 per verify step)")
    injected = " (includes INJECTED acceptance)" if any(r.get("acceptance_injected") for r in recs) else ""
    ax.set_title("Acceptance length per corpus" + injected, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=1 + len(names) // 16)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_phase_energy(records: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Stacked bars of J per output token by phase for every configuration."""
    recs = sorted((r for r in records if r.get("phase_energy_j") and r.get("emitted")), key=_sort_key)
    if not recs:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(recs) + 2), 4.5))
    bottom = [0.0] * len(recs)
    for i, phase in enumerate(PHASE_ORDER):
        vals = [float(r["phase_energy_j"].get(phase, 0.0)) / r["emitted"] for r in recs]
        if not any(vals):
            continue
        ax.bar(range(len(recs)), vals, bottom=bottom, label=phase, color=f"C{i}")
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(recs)))
    ax.set_xticklabels([f"{config_label(r)}\n{r['corpus']}" for r in recs], rotation=70, fontsize=6)
    ax.set_ylabel(_energy_label(recs) + " by phase")
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    _suptitle(fig, "Phase energy per output token (" + "; ".join(energy_sources(recs)) + ")")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency_energy(records: Sequence[Mapping[str, Any]], path: Path, target_s: float | None,
                        choices: Mapping[str, Mapping[str, Any]] | None) -> Path | None:
    """p99 TPOT against J/token per corpus; the target line and the chosen configuration marked."""
    recs = _with_energy(records)
    if not recs:
        return None
    corpora = _corpora(recs)
    colors = _colors(recs)
    plt, fig, axes = _panels(len(corpora))
    for ax, corpus in zip(axes, corpora):
        rows = [r for r in recs if r["corpus"] == corpus]
        for name in sorted({series_label(r) for r in rows}):
            sel = sorted((r for r in rows if series_label(r) == name), key=lambda r: r["batch"])
            ax.plot([1e3 * r["tpot_p99_s"] for r in sel], [r["energy_per_token_j"] for r in sel], "o-",
                    color=colors[name], label=name, alpha=0.8)
            for r in sel:
                ax.annotate(f"b{r['batch']}", (1e3 * r["tpot_p99_s"], r["energy_per_token_j"]), fontsize=6,
                            xytext=(3, 3), textcoords="offset points")
        if target_s is not None:
            ax.axvline(1e3 * target_s, color="r", ls="--", lw=1, label=f"target p99 {1e3 * target_s:g} ms")
            chosen = (choices or {}).get(corpus, {}).get("chosen")
            if chosen is not None:
                ax.plot([1e3 * chosen["tpot_p99_s"]], [chosen["energy_per_token_j"]], "*", ms=16, color="gold",
                        markeredgecolor="k", label=f"chosen: {config_label(chosen)}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("TPOT p99 (ms per token per user)")
        ax.set_ylabel(_energy_label(recs))
        ax.set_title(corpus, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    _suptitle(fig, "Latency-energy trade-off (" + "; ".join(energy_sources(recs)) + ")")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- Markdown -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Report:
    """What :func:`write_report` wrote."""

    markdown: Path
    plots: list[Path]


def _md_table(records: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["| configuration | tau | tokens/s | TPOT p50 ms | TPOT p99 ms | J/token | roofline J/token | "
             "prefill/draft/verify/commit % | greedy = baseline | vs baseline |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for r in records:
        pred = (r.get("roofline") or {}).get("j_per_token")
        lines.append(f"| {config_label(r)} | {_f(r.get('tau'), '.3f')} | {_f(r.get('tokens_per_s'), '.2f')} | "
                     f"{_f(r.get('tpot_p50_s'), '.1f', 1e3)} | {_f(r.get('tpot_p99_s'), '.1f', 1e3)} | "
                     f"{_f(r.get('energy_per_token_j'), '.4g')} | {_f(pred, '.4g')} | {_phases(r)} | {_match(r)} | "
                     f"{_vs_baseline(r)} |")
    return lines


def _latency_md(records: Sequence[Mapping[str, Any]], target_s: float | None,
                choices: Mapping[str, Mapping[str, Any]] | None) -> list[str]:
    from refspec.energy.latency import format_targets

    lines = ["## Latency target", ""]
    if target_s is None:
        return lines + ["No latency target given (`--latency-target SECONDS`, p99 TPOT); the plot shows the "
                        "trade-off without one.", ""]
    if not choices:
        return lines + ["No configuration has both energy and TPOT figures; nothing to choose.", ""]
    lines.append(f"Target: p99 TPOT <= {1e3 * target_s:g} ms per token per user. Chosen per corpus: the lowest J "
                 f"per output token among the configurations that meet it (refspec.energy.latency.choose_config).")
    lines.append("")
    for corpus, c in sorted(choices.items()):
        chosen = c["chosen"]
        if chosen is None:
            lines.append(f"- **{corpus}**: no configuration meets the target.")
        else:
            lines.append(f"- **{corpus}**: {config_label(chosen)} ({_f(chosen['energy_per_token_j'], '.4g')} J/token, "
                         f"p99 {_f(chosen['tpot_p99_s'], '.1f', 1e3)} ms)")
    lines.append("")
    lines.append("What tighter targets cost (targets of " + ", ".join(f"{f:g}x" for f in TIGHTER) +
                 " the given one; `vs loosest` is the energy premium over the given target's choice, "
                 "`spec vs plain` compares the choice with the best configuration without speculation):")
    lines.append("")
    for corpus, c in sorted(choices.items()):
        lines += [f"{corpus}:", "", "```", format_targets(c["tighter"]), "```", ""]
    return lines


def write_report(out_dir: Path, records: Sequence[Mapping[str, Any]], *, latency_target_s: float | None = None,
                 corrupt: Sequence[tuple[str, int, str]] = (), ledgers: Sequence[Path] = (),
                 title: str = "refspec evaluation") -> Report:
    """Write ``report.md`` and the plots into ``out_dir``.

    Args:
        out_dir: destination (the sweep directory).
        records: configuration records (comparison fields already attached).
        latency_target_s: p99 TPOT target in s, or None.
        corrupt: ``(file, line, reason)`` of records lines that were skipped.
        ledgers: ledger files behind the records.
        title: the report's heading.
    """
    from refspec.eval.corpora import licence_text

    out_dir.mkdir(parents=True, exist_ok=True)
    recs = sorted(records, key=_sort_key)
    choices = latency_choices(recs, latency_target_s) if latency_target_s is not None else None
    plots = [p for p in (
        plot_energy_vs_batch(recs, out_dir / "energy_vs_batch.png"),
        plot_tau_by_corpus(recs, out_dir / "tau_by_corpus.png"),
        plot_phase_energy(recs, out_dir / "phase_energy.png"),
        plot_latency_energy(recs, out_dir / "latency_energy.png", latency_target_s, choices),
    ) if p is not None]
    md = [f"# {title}", "",
          f"Generated {datetime.datetime.now().isoformat(timespec='seconds')} from {len(recs)} configurations.", ""]
    for line in injection_lines(recs):
        md += [f"> **{line}**", ""]
    models = sorted({f"{r.get('model')} ({r.get('dtype')}, {r.get('device')})" for r in recs})
    md += [f"Model: {', '.join(models)}.", "",
           "**Energy source**: " + "; ".join(energy_sources(recs)) + ".",
           "J/token counts every phase, prefill included, over emitted tokens (only accepted tokens count). "
           "The roofline column is the analytic prediction of a steady-state decode step (no prefill) with the "
           "per-draft acceptance that reproduces the run's tau; it is always modelled.", ""]
    if any(not r.get("energy_measured") for r in recs if r.get("energy_per_token_j") is not None):
        md += ["Modelled energy figures are estimates, not measurements: no energy counter was read.", ""]
    if any(r.get("time_source") == "modelled" for r in recs):
        md += ["**Times are modelled** (roofline meter in model mode): tokens/s and TPOT are not measured.", ""]
    md += ["## Results", ""]
    for corpus in _corpora(recs):
        rows = [r for r in recs if r["corpus"] == corpus]
        first = rows[0]
        md += [f"### {corpus}", "",
               f"{first.get('prompts_unique')} prompts ({_rows(rows)}; prompts repeat cyclically to fill whole "
               f"batches), {first.get('max_new_tokens')} new tokens per row, "
               f"{'greedy' if first.get('greedy') else 'temperature ' + str(first.get('temperature'))}.", ""]
        md += _md_table(rows) + [""]
    mismatched = [r for r in recs if r.get("greedy_match_baseline") is False]
    if mismatched:
        md += [f"{len(mismatched)} greedy configuration(s) differ from the baseline's output. In fp32 that is a "
               "near-tie flipped by a different GEMM shape or a bug; in bf16 near-ties flip routinely.", ""]
    md += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    md += _latency_md(recs, latency_target_s, choices)
    if corrupt:
        md += ["## Skipped records lines", ""] + [f"- {f}, line {n}: {why}" for f, n, why in corrupt] + [""]
    md += ["## Audit trail", "",
           "Every figure is computed from the ledger records of its configuration (run ids in each record): "
           + ", ".join(f"`{p.name}`" for p in ledgers) + ".", "",
           "Versions: " + ", ".join(f"{k} {v}" for k, v in (recs[0].get("versions") or {}).items()) + "." if recs
           else "", "",
           "## Corpora and licences", "", "```", licence_text(), "```", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(md))
    return Report(markdown=path, plots=plots)


__all__ = ["format_table", "write_report", "Report", "latency_choices", "config_label", "energy_sources",
           "injection_lines", "plot_energy_vs_batch", "plot_tau_by_corpus", "plot_phase_energy",
           "plot_latency_energy"]
