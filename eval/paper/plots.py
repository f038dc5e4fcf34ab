"""At most four plots of the first profile's variants; every legend says measured (which counter) or
MODELLED, and acceptance INJECTED with its level."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from refspec.eval.outputs import atomic_target
from refspec.eval.paper.claims import fig, saving, series
from refspec.eval.paper.grid import NONE_SOURCE

Variants = list[dict[str, Any]]


def _axes(ax: Any, ylabel: str, logy: bool) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (concurrent requests)")
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6)


def _lines(ax: Any, vs: Variants, value: Callable[[dict[str, Any]], Any], plain: bool) -> None:
    groups = dict(series(vs))
    if plain:
        for arch in sorted({v["arch"] for v in vs}):
            groups[(arch, "none", NONE_SOURCE, "")] = sorted((v for v in vs if v["arch"] == arch and
                                                              v["source"] == NONE_SOURCE), key=lambda v: v["batch"])
    for i, ((arch, drafter, source, corpus), s) in enumerate(sorted(groups.items())):
        pts = [(v["batch"], value(v)) for v in s]
        pts = [(b, y) for b, y in pts if y is not None]
        if pts:
            label = f"{arch} {drafter}" + ("" if source == NONE_SOURCE else f" ({source} acceptance, {corpus})")
            ax.errorbar([b for b, _ in pts], [y[0] for _, y in pts], yerr=[y[1] for _, y in pts], capsize=2,
                        fmt="o" + ("--" if source == NONE_SOURCE else ":" if source == "small" else "-"),
                        color=f"C{i % 10}", label=label)


def _energy(ax: Any, vs: Variants) -> None:
    _lines(ax, vs, lambda v: fig(v, "window_j_per_token"), plain=True)
    _axes(ax, "J / output token (steady-state window)", True)


def _saving(ax: Any, vs: Variants) -> None:
    _lines(ax, vs, lambda v: (lambda s: None if s is None else (100 * s[0], 100 * s[1]))(saving(v, vs)), plain=False)
    ax.axhline(0.0, color="k", lw=0.8)
    _axes(ax, "energy saving vs plain decoding (%)", False)


def _phases(ax: Any, vs: Variants) -> None:
    pts = [v for v in vs if v["source"] != NONE_SOURCE and fig(v, "share_verify")]
    bottom = [0.0] * len(pts)
    for name in ("verify", "draft", "prefill", "commit", "unattributed"):
        ys = [(fig(v, f"share_{name}") or (0.0, 0.0))[0] for v in pts]
        ax.bar(range(len(pts)), ys, bottom=bottom, label=name)
        bottom = [a + b for a, b in zip(bottom, ys)]
    ax.set_xticks(range(len(pts)), [f"{v['arch'][:6]} b{v['batch']} {v['drafter']} {v['source'][:3]}" for v in pts],
                  rotation=90, fontsize=5)
    ax.set_ylabel("share of the run's energy (attributed per phase)")
    ax.legend(fontsize=6)


def _latency(ax: Any, vs: Variants) -> None:
    for i, arch in enumerate(sorted({v["arch"] for v in vs})):
        for v in vs:
            t, j = fig(v, "tpot_p99_s"), fig(v, "window_j_per_token")
            if v["arch"] != arch or t is None or j is None or v["source"] == "small":
                continue
            ax.errorbar(t[0] * 1e3, j[0], xerr=t[1] * 1e3, yerr=j[1], fmt="o" if v["k"] else "s", color=f"C{i}")
            ax.annotate(f"b{v['batch']} {v['drafter']}", (t[0] * 1e3, j[0]), fontsize=5)
    ax.set_xlabel("p99 TPOT (ms)")
    ax.set_ylabel("J / output token")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)


def make_plots(variants: Variants, out: Path, title: str) -> list[str]:
    """Four PNGs under ``out``; returns their names (none without a finished variant)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [v for v in variants if "error" not in v and v.get("summary")]
    if not ok:
        return []
    specs = [("energy_per_token.png", _energy), ("saving_vs_batch.png", _saving), ("phase_shares.png", _phases),
             ("latency_vs_energy.png", _latency)]
    names = []
    for name, draw in specs:
        f, ax = plt.subplots(figsize=(7.0, 4.8))
        draw(ax, ok)
        f.suptitle(title, fontsize=7)
        f.tight_layout()
        with atomic_target(out / name) as tmp:
            f.savefig(tmp, dpi=110, format="png")
        plt.close(f)
        names.append(name)
    return names


__all__ = ["make_plots"]
