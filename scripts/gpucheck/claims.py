"""One table per claim of the paper, written from the check's own points, and the crossover.

Claims (DESIGN.md's list, as the GPU check can test them on random-weight targets with
injected acceptance):

1. verification, not drafting, dominates energy on dense models (measured phase shares);
2. the saving shrinks as the batch grows;
3. block drafters at large batch turn the saving into a loss;
4. low acceptance raises J/token;
5. conversation accepts less than code (the recorded distributions that were INJECTED);
6. a tighter latency target costs energy (lowest J/token meeting each p99 TPOT target).

Every table ends with a verdict line computed from its rows, and says which energy figures it
holds (measured by which counter, or MODELLED). The crossover is the batch where a drafter's
J/token reaches the plain decoder's: measured (log-interpolated between the batches run) and
predicted by the roofline with the run's ceilings at the point's observed tau.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from gpucheck.outputs import energy_label

Point = dict[str, Any]


def _ok(points: Sequence[Point]) -> list[Point]:
    return [p for p in points if "error" not in p and p.get("j_per_token") is not None]


def _baseline(points: Sequence[Point], arch: str, batch: int) -> Point | None:
    return next((p for p in points if (p["arch"], p["batch"], p["k"]) == (arch, batch, 0) and not p.get("eager_of")),
                None)


def saving(p: Point, points: Sequence[Point]) -> float | None:
    """1 - J/token / the plain decoder's at the same target and batch (accounting.energy_saving)."""
    from refspec.energy.accounting import energy_saving

    base = _baseline(points, p["arch"], p["batch"])
    return None if base is None else energy_saving(p["j_per_token"], base["j_per_token"])


def _series(points: Sequence[Point]) -> dict[tuple[str, str, str], list[Point]]:
    """(arch, drafter label, corpus) -> its k > 0 points by batch (graph runner points only)."""
    out: dict[tuple[str, str, str], list[Point]] = {}
    for p in points:
        if p["k"] and not p.get("eager_of"):
            out.setdefault((p["arch"], p["drafter_label"], p["corpus"]), []).append(p)
    return {key: sorted(v, key=lambda p: p["batch"]) for key, v in out.items()}


def _pct(x: float | None) -> str:
    return "    n/a" if x is None else f"{100 * x:+6.1f}%"


def claim1(points: Sequence[Point]) -> str:
    rows = [f"{'arch':<14} {'batch':>5} {'drafter':<10} {'corpus':<12} {'draft A':>7} {'verify A':>8} "
            f"{'draft B':>7} {'verify B':>8}"]
    held = total = 0
    for p in points:
        s = p.get("phase_energy", {}).get("split")
        if not p["k"] or s is None:
            continue
        a, b = s["loops_share"], s["fit_share"]
        total += 1
        held += a["verify"] > a.get("draft", 0.0)
        rows.append(f"{p['arch']:<14} {p['batch']:>5} {p['drafter_label']:<10} {p['corpus']:<12} "
                    f"{a.get('draft', 0):>7.2f} {a['verify']:>8.2f} {b.get('draft', 0):>7.2f} {b['verify']:>8.2f}")
    rows.append(f"verdict: verify's share exceeds draft's at {held} of {total} points (A: phase-isolated loops; "
                f"B: non-negative fit over the loops' and the run's windows)")
    return "\n".join(rows)


def _batch_table(points: Sequence[Point], keep: Any, verdict: Any) -> str:
    batches = sorted({p["batch"] for p in points})
    rows = [f"{'arch':<14} {'drafter':<10} {'corpus':<12} " + " ".join(f"{'b' + str(b):>7}" for b in batches)]
    verdicts = []
    for (arch, label, corpus), series in _series(points).items():
        if not keep(label):
            continue
        by_batch = {p["batch"]: saving(p, points) for p in series}
        rows.append(f"{arch:<14} {label:<10} {corpus:<12} " + " ".join(_pct(by_batch.get(b)) for b in batches))
        verdicts.append(verdict([by_batch[b] for b in sorted(by_batch) if by_batch[b] is not None]))
    rows.append(f"verdict: holds for {sum(v for v in verdicts if v is not None)} of "
                f"{sum(v is not None for v in verdicts)} series (saving = 1 - J/token / plain J/token at that batch)")
    return "\n".join(rows)


def claim2(points: Sequence[Point]) -> str:
    def shrinks(s: list[float]) -> bool | None:
        return None if len(s) < 2 else s[-1] < s[0]
    return _batch_table(points, lambda label: True, shrinks)


def claim3(points: Sequence[Point]) -> str:
    def loss_at_large(s: list[float]) -> bool | None:
        return None if not s else s[-1] < 0

    turned = everywhere = 0
    for (_, label, _), series in _series(points).items():
        s = [x for x in (saving(p, points) for p in series) if x is not None]
        if label.startswith("block") and s:
            turned += s[0] > 0 > s[-1]
            everywhere += all(x <= 0 for x in s)
    return (_batch_table(points, lambda label: label.startswith("block"), loss_at_large)
            + f"\n(holds: a loss at the largest batch. Of those, {turned} turned a saving at the smallest batch into "
              f"a loss; {everywhere} lost at every batch, with no saving to lose)")


def _by_corpus(points: Sequence[Point]) -> dict[tuple[str, int, str], dict[str, Point]]:
    out: dict[tuple[str, int, str], dict[str, Point]] = {}
    for p in points:
        if p["k"] and not p.get("eager_of"):
            out.setdefault((p["arch"], p["batch"], p["drafter_label"]), {})[p["corpus"]] = p
    return out


def claim4(points: Sequence[Point]) -> str:
    rows = [f"{'arch':<14} {'batch':>5} {'drafter':<10} {'corpus':<12} {'tau':>5} {'J/token':>9}"]
    held = total = 0
    for (arch, batch, label), per in _by_corpus(points).items():
        for corpus, p in sorted(per.items()):
            rows.append(f"{arch:<14} {batch:>5} {label:<10} {corpus:<12} {p['tau_observed']:>5.2f} "
                        f"{p['j_per_token']:>9.4g}")
        if len(per) >= 2:
            lo, hi = min(per.values(), key=lambda p: p["tau_observed"]), max(per.values(), key=lambda p: p["tau_observed"])
            total += 1
            held += lo["j_per_token"] > hi["j_per_token"]
    rows.append(f"verdict: the lower-acceptance corpus costs more J/token at {held} of {total} (batch, drafter) pairs")
    return "\n".join(rows)


def claim5(points: Sequence[Point], acceptance: dict[str, Any]) -> str:
    rows = [f"{'drafter':<10} {'corpus':<12} {'recorded tau':>12} {'observed tau':>12}  source"]
    taus: dict[str, dict[str, float]] = {}
    for (arch, batch, label), per in sorted(_by_corpus(points).items()):
        for corpus, p in sorted(per.items()):
            if label in taus and corpus in taus[label]:
                continue
            taus.setdefault(label, {})[corpus] = p["tau_model"]
            rows.append(f"{label:<10} {corpus:<12} {p['tau_model']:>12.3f} {p['tau_observed']:>12.3f}  "
                        f"{p['accept_model']} ({p['accept_provenance']})")
    pairs = [t for t in taus.values() if "conversation" in t and "code" in t]
    rows.append(f"verdict: conversation < code in {sum(t['conversation'] < t['code'] for t in pairs)} of {len(pairs)} "
                f"drafters. ACCEPTANCE WAS INJECTED: these taus were recorded on {acceptance.get('source_model', '?')} "
                "and drawn here, not measured on the random-weight target")
    return "\n".join(rows)


def claim6(points: Sequence[Point], tpot_targets: int = 6) -> str:
    from refspec.energy.latency import cost_of_tighter_target, format_targets

    out = []
    for arch in sorted({p["arch"] for p in points}):
        for corpus in sorted({p["corpus"] for p in points if p["k"] and p["arch"] == arch}):
            recs = [{"batch": p["batch"], "drafter": p["drafter_label"], "k": p["k"], "tpot_p99_s": p["tpot_p99_s"],
                     "energy_per_token_j": p["j_per_token"]} for p in points
                    if p["arch"] == arch and (p["k"] == 0 or p["corpus"] == corpus) and not p.get("eager_of")
                    and p.get("tpot_p99_s")]
            if len(recs) < 2:
                continue
            tpots = sorted({r["tpot_p99_s"] for r in recs})
            targets = sorted({tpots[round(i * (len(tpots) - 1) / (tpot_targets - 1))] * 1.0001
                              for i in range(tpot_targets)})
            rows = cost_of_tighter_target(recs, targets)
            feasible = [r for r in rows if r["feasible"]]
            rising = all(b["energy_per_token_j"] >= a["energy_per_token_j"] for a, b in zip(feasible, feasible[1:]))
            out.append(f"{arch}, {corpus} (with the plain decoder's points):\n{format_targets(rows)}\n"
                       f"verdict: J/token {'never falls' if rising else 'falls somewhere'} as the target tightens "
                       f"({len(feasible)} feasible targets; p99 TPOT per row from the mean measured step time)")
    return "\n\n".join(out) or "no points with TPOT"


def _crossing(xs: list[int], ys: list[float]) -> float | None:
    """First batch where ``ys`` (savings) reaches 0, log-interpolated; None when it never does."""
    if ys and ys[0] <= 0:
        return float(xs[0])
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if y0 > 0 >= y1:
            f = y0 / (y0 - y1)
            return math.exp(math.log(x0) + f * (math.log(x1) - math.log(x0)))
    return None


def predicted_crossover(arch: str, spec_name: str, k: int, tau: float, profile: Any, context: int) -> float | None:
    """Batch where the roofline's J/token of the drafter at ``tau`` reaches plain decoding's (1..1024)."""
    from gpucheck.grid import DrafterSpec, drafter_model, per_token_acceptance
    from refspec.energy.roofline import predict_step
    from refspec.models.random_models import arch_args

    model, spec = arch_args(arch), DrafterSpec(spec_name, k)
    a = per_token_acceptance(tau, k)
    xs = [2 ** i for i in range(11)]
    ys = [1 - predict_step(model, profile, batch=b, k=k, context=context, acceptance=a,
                           drafter=drafter_model(spec)).j_per_token
          / predict_step(model, profile, batch=b, k=0, context=context, acceptance=0.0).j_per_token for b in xs]
    return _crossing(xs, ys)


def crossover_table(points: Sequence[Point], profile: Any, context: int) -> tuple[str, list[dict[str, Any]]]:
    """Measured against predicted crossover batch per (arch, drafter, corpus)."""
    rows = [f"{'arch':<14} {'drafter':<10} {'corpus':<12} {'tau':>5} {'measured':>9} {'roofline':>9}"]
    data = []
    for (arch, label, corpus), series in _series(points).items():
        pairs = [(p["batch"], saving(p, points)) for p in series]
        pairs = [(b, s) for b, s in pairs if s is not None]
        if not pairs:
            continue
        tau = sum(p["tau_observed"] for p in series) / len(series)
        measured = _crossing([b for b, _ in pairs], [s for _, s in pairs])
        predicted = predicted_crossover(arch, series[0]["drafter"], series[0]["k"], tau, profile, context)
        data.append({"arch": arch, "drafter": label, "corpus": corpus, "tau": tau, "measured_batch": measured,
                     "predicted_batch": predicted, "batches_run": [b for b, _ in pairs]})
        fmt = (lambda x: "none" if x is None else f"{x:.1f}")
        rows.append(f"{arch:<14} {label:<10} {corpus:<12} {tau:>5.2f} {fmt(measured):>9} {fmt(predicted):>9}")
    rows.append("crossover: smallest batch whose J/token reaches the plain decoder's (log-interpolated between the "
                "batches run; 'none': saving at every batch run). roofline: the run's ceilings, the point's tau")
    return "\n".join(rows), data


def claim_tables(points: Sequence[Point], acceptance: dict[str, Any], profile: Any, context: int
                 ) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """Every claim's table (text) and the crossover data."""
    ok = _ok(points)
    label = energy_label(ok) if ok else "none"
    cross, data = crossover_table(ok, profile, context)
    tables = {"1 verification dominates energy": claim1(ok), "2 the saving shrinks with batch": claim2(ok),
              "3 block drafters at large batch: saving becomes a loss": claim3(ok),
              "4 low acceptance raises J/token": claim4(ok), "5 conversation accepts less than code": claim5(ok, acceptance),
              "6 tighter latency targets cost energy": claim6(ok), "crossover: measured vs roofline": cross}
    return {name: f"{text}\nenergy: {label}; acceptance INJECTED" for name, text in tables.items()}, data
