"""Roofline-predicted against measured step times on this CPU (``python -m refspec.eval bench roofline``).

For every (batch B, draft length K) the engine decodes random prompts with the ``ngram``
drafter (K = 0: plain decoding), so each step runs one target forward over K + 1 positions per
row, the shape a drafter of K tokens makes the target verify. The engine's own phase events
give, per step, the measured wall time of ``verify`` (the target forward) and of the whole
step (draft + verify + commit), and the exact :class:`~refspec.energy.model.work.ForwardShape` of the
verify forward. The roofline model (:mod:`refspec.energy.model.roofline`) turns that shape into a time on
the CPU profile measured in the same process (matrix-vector bandwidth, matmul peak), so the
comparison is like for like: same shapes, same machine, same moment.

Reported per cell: median measured verify and step times over the timed steps, the predicted
time, and ``measured / predicted``. Two error summaries follow: the raw model (the profile as
the meters use it: no per-forward overhead on a CPU), and the model plus a per-forward
overhead fitted by least squares on all cells (``measured ~ a * predicted + c``), which shows
how much of the error a constant dispatch cost explains. The n-gram drafter's own work is
not modelled (no forward), so the step comparison also shows what commit and drafting add.

Random prompts keep every row's context the same and acceptance near zero, so the verify
forward's shape, not the text, sets the time: this is a check of the cost model, not of a
drafter.
"""
from __future__ import annotations

import logging
import statistics
from pathlib import Path
from typing import Any, Sequence

import torch

from refspec.eval.outputs import atomic_target

log = logging.getLogger(__name__)


def _median_phase_times(gen, skip: int) -> tuple[float, float, Any]:
    """Median verify time, median step time (draft + verify + commit) and one verify shape."""
    verify: dict[int, float] = {}
    step: dict[int, float] = {}
    shape = None  # the verify forward's shape at the last timed step (the context grows by a few tokens)
    for e in gen.events:
        if e.step < skip:
            continue
        if e.phase in ("draft", "verify", "commit"):
            step[e.step] = step.get(e.step, 0.0) + e.measurement.time_s
        if e.phase == "verify":
            verify[e.step] = e.measurement.time_s
            shape = e.work
    if not verify:
        raise ValueError(f"no timed steps after skipping {skip}; raise --new-tokens")
    return statistics.median(verify.values()), statistics.median(step.values()), shape


def fit_overhead(predicted: Sequence[float], measured: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``measured ~ a * predicted + c`` with ``c >= 0``; returns ``(a, c)``."""
    n = len(predicted)
    if n < 2:
        raise ValueError("fitting needs at least two cells")
    mx, my = sum(predicted) / n, sum(measured) / n
    sxx = sum((x - mx) ** 2 for x in predicted)
    if sxx == 0:
        return my / mx if mx else 0.0, 0.0
    a = sum((x - mx) * (y - my) for x, y in zip(predicted, measured)) / sxx
    c = my - a * mx
    if c < 0:  # refit through the origin
        a, c = sum(x * y for x, y in zip(predicted, measured)) / sum(x * x for x in predicted), 0.0
    return a, c


def _errors(predicted: Sequence[float], measured: Sequence[float]) -> dict[str, float]:
    rel = [abs(p / m - 1.0) for p, m in zip(predicted, measured)]
    return {"median_abs_rel_error": statistics.median(rel), "max_abs_rel_error": max(rel),
            "mean_abs_rel_error": sum(rel) / len(rel)}


def check_roofline(model, *, batches: Sequence[int], ks: Sequence[int], prompt_len: int = 64,
                   new_tokens: int = 12, skip: int = 2, profile=None, seed: int = 0) -> dict[str, Any]:
    """Measure and predict one step per (batch, k) cell; see the module docstring.

    Args:
        model: a loaded :class:`~refspec.models.Transformer` (its dtype is the one timed).
        batches: batch sizes.
        ks: draft lengths (0 = plain decoding).
        prompt_len: tokens per random prompt.
        new_tokens: tokens generated per row (steps timed: about ``new_tokens - skip``).
        skip: first steps left out of the medians (allocation, caches warming).
        profile: a :class:`~refspec.energy.model.hardware.HardwareProfile`; default: this CPU, measured now
            for the model's dtype.
        seed: prompt generator seed.

    Returns:
        ``{"profile": {...}, "cells": [...], "raw": {...}, "fitted": {...}}``.
    """
    from refspec.energy.model.hardware import cpu_profile

    if new_tokens <= skip + 1:
        raise ValueError(f"new_tokens ({new_tokens}) must exceed skip + 1 ({skip + 1})")
    dtype_bytes = torch.finfo(model.dtype).bits // 8
    prof = profile if profile is not None else cpu_profile(dtype_bytes)
    vocab = model.args.vocab_size
    lo = min(100, vocab // 4)  # stay clear of special tokens at the low ids
    gen_ = torch.Generator().manual_seed(seed)
    cells: list[dict[str, Any]] = []
    for b in batches:
        prompts = [torch.randint(lo, vocab - lo, (prompt_len,), generator=gen_).tolist() for _ in range(b)]
        for k in ks:
            cell = _measure_cell(model, prompts, k, prof, new_tokens=new_tokens, skip=skip)
            cells.append(cell)
            log.info("B=%-3d K=%d  verify %.1f ms, step %.1f ms, roofline %.1f ms (measured/predicted %.2f)",
                     b, k, cell["measured_verify_ms"], cell["measured_step_ms"], cell["predicted_ms"],
                     cell["verify_ratio"])
    pred = [c["predicted_ms"] for c in cells]
    meas = [c["measured_verify_ms"] for c in cells]
    a, c0 = fit_overhead(pred, meas) if len(cells) > 1 else (1.0, 0.0)
    fitted = [a * p + c0 for p in pred]
    for cell, f in zip(cells, fitted):
        cell["fitted_ms"] = f
    return {"model": getattr(model.args, "model_type", "?"), "dtype_bytes": dtype_bytes,
            "threads": torch.get_num_threads(), "prompt_len": prompt_len, "new_tokens": new_tokens,
            "profile": {"name": prof.name, "bandwidth_GBps": prof.bandwidth_Bps / 1e9,
                        "peak_GFLOPs": prof.peak_flops / 1e9, "ridge_flop_per_byte": prof.ridge,
                        "benchmarked": prof.benchmarked},
            "cells": cells,
            "raw": {**_errors(pred, meas), "what": "roofline time of the verify forward, no overhead term"},
            "fitted": {**_errors(fitted, meas), "scale": a, "overhead_ms": c0,
                       "what": "measured ~ scale * roofline + overhead_ms, least squares over all cells"}}


def _measure_cell(model, prompts: list[list[int]], k: int, prof, *, new_tokens: int, skip: int) -> dict[str, Any]:
    """Median measured verify and step time of one (batch, k) cell against the roofline's verify time."""
    from refspec.drafters.ngram import NgramDrafter
    from refspec.engine import Engine, EngineConfig
    from refspec.energy.model.roofline import work_time_s

    b = len(prompts)
    # untrimmed: every step verifies K + 1 positions per row whatever the drafter found
    engine = Engine(model, NgramDrafter(trim=False) if k else None, config=EngineConfig(k=k))
    engine.generate(prompts, max_new_tokens=skip + 2)  # warm-up: allocations, first-touch pages
    gen = engine.generate(prompts, max_new_tokens=new_tokens)
    verify_s, step_s, shape = _median_phase_times(gen, skip)
    pred = work_time_s(shape, prof)
    return {"batch": b, "k": k, "tokens_per_forward": b * (k + 1), "measured_verify_ms": 1e3 * verify_s,
            "measured_step_ms": 1e3 * step_s, "predicted_ms": 1e3 * pred,
            "verify_ratio": verify_s / pred, "step_ratio": step_s / pred}


def plot_check(result: dict[str, Any], path: Path) -> Path:
    """Measured against predicted verify time per cell (log-log), one marker series per K."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    ks = sorted({c["k"] for c in result["cells"]})
    for k in ks:
        cs = [c for c in result["cells"] if c["k"] == k]
        ax.scatter([c["predicted_ms"] for c in cs], [c["measured_verify_ms"] for c in cs], label=f"K={k}")
        ax2.plot([c["batch"] for c in cs], [c["verify_ratio"] for c in cs], marker="o", label=f"K={k}")
    lo = min(min(c["predicted_ms"], c["measured_verify_ms"]) for c in result["cells"])
    hi = max(max(c["predicted_ms"], c["measured_verify_ms"]) for c in result["cells"])
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="measured = predicted")
    ax.set(xscale="log", yscale="log", xlabel="roofline-predicted verify forward (ms)",
           ylabel="measured verify forward (ms)", title=f"profile {result['profile']['name']}")
    ax.legend(fontsize=8)
    ax2.axhline(1.0, color="k", lw=1, ls="--")
    ax2.set(xscale="log", xlabel="batch", ylabel="measured / predicted",
            title=f"raw median |error| {100 * result['raw']['median_abs_rel_error']:.0f}%")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_target(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    return path


def format_check(result: dict[str, Any]) -> str:
    """The table and both error summaries as text."""
    p = result["profile"]
    lines = [f"profile {p['name']} (measured in this run): {p['bandwidth_GBps']:.1f} GB/s, "
             f"{p['peak_GFLOPs']:.0f} GFLOP/s, ridge {p['ridge_flop_per_byte']:.1f} FLOP/B",
             f"{'B':>4} {'K':>2} {'tok/fwd':>7} {'verify ms':>10} {'step ms':>9} {'roofline':>9} {'meas/pred':>9}"]
    for c in result["cells"]:
        lines.append(f"{c['batch']:>4} {c['k']:>2} {c['tokens_per_forward']:>7} {c['measured_verify_ms']:>10.2f} "
                     f"{c['measured_step_ms']:>9.2f} {c['predicted_ms']:>9.2f} {c['verify_ratio']:>9.2f}")
    r, f = result["raw"], result["fitted"]
    lines.append(f"raw roofline: median |error| {100 * r['median_abs_rel_error']:.1f}%, "
                 f"max {100 * r['max_abs_rel_error']:.1f}%")
    lines.append(f"with fitted overhead ({f['scale']:.2f} x roofline + {f['overhead_ms']:.2f} ms per forward): "
                 f"median |error| {100 * f['median_abs_rel_error']:.1f}%, max {100 * f['max_abs_rel_error']:.1f}%")
    return "\n".join(lines)
