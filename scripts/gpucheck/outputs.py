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


def _lines(ax: Any, points: list[dict[str, Any]], y: Getter, y_pred: Getter | None, label: str) -> None:
    for i, k in enumerate(sorted({p["k"] for p in points})):
        pts = sorted((p for p in points if p["k"] == k), key=lambda p: p["batch"])
        xs = [p["batch"] for p in pts]
        ax.plot(xs, [y(p) for p in pts], "o-", color=f"C{i}", label=f"k={k} {label}")
        if y_pred is not None:
            ax.plot(xs, [y_pred(p) for p in pts], "x--", color=f"C{i}", alpha=0.7,
                    label=f"k={k} modelled (roofline, run ceilings)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def make_plots(points: list[dict[str, Any]], out: Path, title: str) -> list[str]:
    """At most four PNGs under ``out``; returns their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in points if "error" not in p]
    if not points:
        return []
    energy = energy_label(points)
    specs = [
        ("step_time_vs_roofline.png", lambda p: p["step_time_s"]["mean"] * 1e3,
         lambda p: p["predicted_step_time_s"] * 1e3, "step time (ms)", "measured (wall time)", True),
        ("energy_per_token.png", lambda p: p["j_per_token"], lambda p: p["predicted_j_per_token"],
         "J / output token", energy, True),
        ("measured_over_predicted.png", lambda p: p["measured_over_predicted"], None,
         "wall / roofline step time", "measured / modelled", False),
        ("tpot.png", lambda p: p["tpot_s"] * 1e3, None, "TPOT (ms / token / user)", "measured (wall time)", True),
    ]
    files = []
    for name, y, y_pred, ylabel, label, logy in specs:
        if any(y(p) is None for p in points):
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        _lines(ax, points, y, y_pred, label)
        ax.set_ylabel(ylabel)
        if logy:
            ax.set_yscale("log")
        ax.set_title(f"{title}\nacceptance INJECTED; energy {energy}", fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files.append(name)
    return files


def _num(x: Any, fmt: str) -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else format(float("nan"), fmt)


def summary_table(points: list[dict[str, Any]]) -> str:
    """One line per point; a failed point shows its error."""
    rows = [f"{'batch':>5} {'k':>3} {'steps':>5} {'step ms':>9} {'roofline':>9} {'sheet':>9} {'ratio':>6} "
            f"{'tau':>5} {'J/tok':>8} {'J/tok net':>9} {'TPOT ms':>8} {'bound':>7}"]
    for p in points:
        if "error" in p:
            rows.append(f"{p['batch']:>5} {p['k']:>3} FAILED: {p['error'][:100]}")
            continue
        rows.append(f"{p['batch']:>5} {p['k']:>3} {p['steps']:>5} {p['step_time_s']['mean'] * 1e3:>9.3f} "
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
    rows = [f"{'batch':>5} {'k':>3} {'draft A':>8} {'verify A':>8} {'draft B':>8} {'verify B':>8} "
            f"{'additivity':>10} {'fit resid':>9} {'prefill J':>10}"]
    for p in points:
        s = p.get("phase_energy", {}).get("split")
        if s is None:
            continue
        a, b = s["loops_share"], s["fit_share"]
        rows.append(f"{p['batch']:>5} {p['k']:>3} {a.get('draft', 0.0):>8.3f} {a['verify']:>8.3f} "
                    f"{b.get('draft', 0.0):>8.3f} {b['verify']:>8.3f} {s['additivity_residual']:>+10.1%} "
                    f"{s['fit_relative_residual']:>9.3f} {s['prefill_j_per_call']:>10.4g}")
    sources = sorted({p["phase_energy"]["split"]["energy_source"] for p in points
                      if "split" in p.get("phase_energy", {})})
    rows.append("phase energy: " + (energy_label([{"energy_source": s} for s in sources]) if sources else "none")
                + "; A = phase-isolated loops x calls per step, B = non-negative fit over their windows and the run")
    return "\n".join(rows)


def eager_table(points: list[dict[str, Any]]) -> str:
    """Graphs against eager at the points that ran both: step time and J/token each way."""
    rows = [f"{'batch':>5} {'k':>3} {'runner':>13} {'step ms':>9} {'eager ms':>9} {'speedup':>7} {'J/tok':>8} "
            f"{'eager J/tok':>11}"]
    for p in points:
        e = p.get("eager")
        if not e or "error" in e:
            continue
        rows.append(f"{p['batch']:>5} {p['k']:>3} {p['runner_mode']:>13} {p['step_time_s']['mean'] * 1e3:>9.3f} "
                    f"{e['step_time_s']['mean'] * 1e3:>9.3f} {e['graph_speedup']:>7.2f} "
                    f"{_num(p['j_per_token'], '>8.4f')} {_num(e['j_per_token'], '>11.4f')}")
    rows.append("eager: the same runners' bucketing and padding without capture; energy "
                + energy_label([p["eager"] for p in points if p.get("eager") and "error" not in p["eager"]]
                               or [{"energy_source": "none"}]))
    return "\n".join(rows)
