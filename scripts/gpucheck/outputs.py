"""Plots and the summary table. A line says what its figure is: measured (which counter) or
modelled (which roofline); acceptance is always labelled injected."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

Getter = Callable[[dict[str, Any]], Any]


def energy_label(points: list[dict[str, Any]]) -> str:
    """``measured (nvml-total-energy(gpu0))`` or ``MODELLED (roofline(...))`` for the points' energy."""
    sources = sorted({str(p["energy_source"]) for p in points})
    kind = "measured" if all(s.startswith("measured:") for s in sources) else "MODELLED"
    return f"{kind} ({', '.join(s.split(':', 1)[-1] for s in sources)})"


def _graph_points(points: list[dict[str, Any]], arch: str) -> list[dict[str, Any]]:
    return [p for p in points if "error" not in p and p["arch"] == arch]


def _by_config(points: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """``drafter corpus`` -> its points by batch (the plain decoder: ``none``)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for p in points:
        out.setdefault(p["drafter_label"] + (f" {p['corpus']}" if p["k"] else ""), []).append(p)
    return {key: sorted(v, key=lambda p: p["batch"]) for key, v in sorted(out.items())}


def _axes(ax: Any, ylabel: str, logy: bool) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (concurrent rows)")
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6)


def _energy_plot(ax: Any, points: list[dict[str, Any]], energy: str) -> None:
    for i, (name, pts) in enumerate(_by_config(points).items()):
        xs = [p["batch"] for p in pts]
        style = "-" if "code" not in name else ":"
        ax.plot(xs, [p["j_per_token"] for p in pts], "o" + style, color=f"C{i}", label=f"{name}: {energy}")
        ax.plot(xs, [p["predicted_j_per_token"] for p in pts], "x--", color=f"C{i}", alpha=0.5,
                label=f"{name}: modelled (roofline, run ceilings)")
    _axes(ax, "J / output token", True)


def _saving_plot(ax: Any, points: list[dict[str, Any]], crossover: list[dict[str, Any]], energy: str) -> None:
    from gpucheck.claims import saving

    for i, (name, pts) in enumerate((n, v) for n, v in _by_config(points).items() if not n.startswith("none")):
        pairs = [(p["batch"], saving(p, points)) for p in pts]
        pairs = [(b, 100 * s) for b, s in pairs if s is not None]
        if pairs:
            ax.plot(*zip(*pairs), "o-" if "code" not in name else "o:", color=f"C{i}", label=f"{name}: {energy}")
        for c in crossover:
            if f"{c['drafter']} {c['corpus']}" == name and c["predicted_batch"]:
                ax.axvline(c["predicted_batch"], color=f"C{i}", ls="--", alpha=0.4, lw=0.8)
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_title("dashed verticals: crossover predicted by the roofline (modelled)", fontsize=6)
    _axes(ax, "energy saving vs plain decoding (%)", False)


def _phase_plot(ax: Any, points: list[dict[str, Any]], energy: str) -> None:
    pts = [p for p in points if p["k"] and "split" in p.get("phase_energy", {})]
    labels = [f"b{p['batch']} {p['drafter_label']} {p['corpus'][:4]}" for p in pts]
    draft = [p["phase_energy"]["split"]["loops_share"].get("draft", 0.0) for p in pts]
    verify = [p["phase_energy"]["split"]["loops_share"]["verify"] for p in pts]
    ax.bar(range(len(pts)), verify, label=f"verify: {energy}, phase-isolated loops")
    ax.bar(range(len(pts)), draft, bottom=verify, label=f"draft: {energy}, phase-isolated loops")
    ax.set_xticks(range(len(pts)), labels, rotation=90, fontsize=5)
    ax.set_ylabel("share of decode-step energy")
    ax.legend(fontsize=6)


def _step_plot(ax: Any, points: list[dict[str, Any]], energy: str) -> None:
    for i, (name, pts) in enumerate(_by_config(points).items()):
        xs = [p["batch"] for p in pts]
        ax.plot(xs, [p["step_time_s"]["mean"] * 1e3 for p in pts], "o-", color=f"C{i}", label=f"{name}: measured (wall)")
        ax.plot(xs, [p["predicted_step_time_s"] * 1e3 for p in pts], "x--", color=f"C{i}", alpha=0.5,
                label=f"{name}: modelled (roofline)")
    _axes(ax, "decode step time (ms)", True)


def make_plots(points: list[dict[str, Any]], crossover: list[dict[str, Any]], out: Path, title: str) -> list[str]:
    """At most four PNGs under ``out`` for the first target's points; returns their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [p for p in points if "error" not in p and p.get("j_per_token") is not None]
    if not ok:
        return []
    arch = ok[0]["arch"]
    pts = _graph_points(ok, arch)
    energy = energy_label(pts)
    specs = [("energy_per_token.png", lambda ax: _energy_plot(ax, pts, energy)),
             ("saving_vs_batch.png", lambda ax: _saving_plot(ax, pts, crossover, energy)),
             ("phase_shares.png", lambda ax: _phase_plot(ax, pts, energy)),
             ("step_time_vs_roofline.png", lambda ax: _step_plot(ax, pts, energy))]
    files = []
    for name, draw in specs:
        fig, ax = plt.subplots(figsize=(7.0, 4.8))
        draw(ax)
        fig.suptitle(f"{arch} {title}\nacceptance INJECTED (recorded per corpus); energy {energy}", fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files.append(name)
    return files


def _num(x: Any, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else format(float("nan"), fmt)


def _where(p: dict[str, Any]) -> str:
    return f"{p.get('arch', '?'):<14} {p['batch']:>5} {p.get('drafter_label', p['k']):<10} {p.get('corpus') or '-':<12}"


HEAD = f"{'arch':<14} {'batch':>5} {'drafter':<10} {'corpus':<12}"


def summary_table(points: list[dict[str, Any]]) -> str:
    """One line per point; a failed point shows its error."""
    rows = [f"{HEAD} {'steps':>5} {'step ms':>9} {'roofline':>9} {'sheet':>9} {'ratio':>6} "
            f"{'tau':>5} {'J/tok':>8} {'J/tok net':>9} {'TPOT ms':>8} {'bound':>7}"]
    for p in points:
        if "error" in p:
            rows.append(f"{_where(p)} FAILED: {p['error'][:100]}")
            continue
        rows.append(f"{_where(p)} {p['steps']:>5} {p['step_time_s']['mean'] * 1e3:>9.3f} "
                    f"{p['predicted_step_time_s'] * 1e3:>9.3f} {p['datasheet_predicted_step_time_s'] * 1e3:>9.3f} "
                    f"{_num(p['measured_over_predicted'], '>6.2f')} {p['tau_observed']:>5.2f} "
                    f"{_num(p['j_per_token'], '>8.4f')} {_num(p['j_per_token_net'], '>9.4f')} "
                    f"{_num(p['tpot_s'] and p['tpot_s'] * 1e3, '>8.3f')} "
                    f"{'compute' if p['verify_compute_bound'] else 'memory':>7}")
    if any("error" not in p for p in points):
        rows.append("energy: " + energy_label([p for p in points if "error" not in p])
                    + "; roofline: modelled from the ceilings measured in this run, sheet: the data sheet's")
    return "\n".join(rows)


def phase_table(points: list[dict[str, Any]]) -> str:
    """Per point: the phase split of the isolated loops (A) and of the fit (B), the additivity
    residual, prefill J per call."""
    rows = [f"{HEAD} {'draft A':>8} {'verify A':>8} {'refill A':>8} {'draft B':>8} {'verify B':>8} "
            f"{'additivity':>10} {'fit resid':>9} {'prefill J':>10}"]
    for p in points:
        s = p.get("phase_energy", {}).get("split")
        if s is None:
            continue
        a, b = s["loops_share"], s["fit_share"]
        rows.append(f"{_where(p)} {a.get('draft', 0.0):>8.3f} {a['verify']:>8.3f} {a.get('prefill', 0.0):>8.3f} "
                    f"{b.get('draft', 0.0):>8.3f} {b['verify']:>8.3f} {s['additivity_residual']:>+10.1%} "
                    f"{s['fit_relative_residual']:>9.3f} {s['prefill_j_per_call']:>10.4g}")
    sources = sorted({p["phase_energy"]["split"]["energy_source"] for p in points
                      if "split" in p.get("phase_energy", {})})
    rows.append("phase energy: " + (energy_label([{"energy_source": s} for s in sources]) if sources else "none")
                + "; A = phase-isolated loops x calls per step (refill: serving's refill prefills, per row of the "
                "prefill loop), B = non-negative fit over their windows and the run")
    return "\n".join(rows)


def eager_table(points: list[dict[str, Any]]) -> str:
    """Graphs against eager at the points that ran both: step time and J/token each way."""
    rows = [f"{HEAD} {'runner':>13} {'step ms':>9} {'eager ms':>9} {'speedup':>7} {'J/tok':>8} {'eager J/tok':>11}"]
    for p in points:
        e = p.get("eager")
        if not e or "error" in e:
            continue
        g = e.get("graphs_static", p)
        rows.append(f"{_where(p)} {g['runner_mode']:>13} {g['step_time_s']['mean'] * 1e3:>9.3f} "
                    f"{e['step_time_s']['mean'] * 1e3:>9.3f} {e['graph_speedup']:>7.2f} "
                    f"{_num(g['j_per_token'], '>8.4f')} {_num(e['j_per_token'], '>11.4f')}")
    rows.append("eager: the same runner's bucketing and padding without capture, both static schedule (drafter "
                "heads run eagerly both ways); energy " + energy_label([p["eager"] for p in points if p.get("eager") and "error" not in p["eager"]]
                                                or [{"energy_source": "none"}]))
    return "\n".join(rows)
