"""The paper's seven claims, each answered from the run's variants with a verdict and its sources.

A claim is a list of **checks**, each comparing two figures of the run. Every figure is the
mean over its repeats with a spread (half the range of the repeats); a difference smaller than
the two spreads together is *not resolved*, never a verdict, and so is a figure from fewer than
:data:`MIN_REPEATS` repeats (a half-range of two is no uncertainty) or from a run whose
steady-state window is invalid (each claim lists those under ``notes``). A claim

* **holds** when every check holds;
* **fails** when a check resolves the other way;
* is **not resolved** when no check fails but one could not be resolved (or had no points);
* is **not measurable here** when the hardware at hand cannot test it (claim 7: DVFS needs
  clock control, and this command only ever reads clocks).

Claim 3 (acceptance depends on text) is about acceptance, which random-weight targets cannot
show (it is injected): its checks read the tau table measured on this project's small real
model and the published per-corpus figures, and its sources say so.

Each claim names its **evidence** (:func:`evidence`): ``measured`` (its energy was read from a
counter), ``model consequence`` (its verdict follows from the roofline or from injected
figures: every energy modelled) or ``measured acceptance`` (it rests on acceptance measured on
real text).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from refspec.eval.paper.grid import NONE_SOURCE

Variant = dict[str, Any]
HOLDS, FAILS, UNRESOLVED, NOT_HERE = "holds", "fails", "not resolved", "not measurable here"
MEASURED, MODEL, MEASURED_ACCEPTANCE = "measured", "model consequence", "measured acceptance"
MIN_REPEATS = 3
"""Fewest repeats whose spread a verdict may rest on."""
TITLES = {
    1: "every weight is read once per step: batching shares the read across users, speculation across accepted tokens",
    2: "every drafted token is verified, accepted or not, so the saving depends on acceptance",
    3: "acceptance depends on text: conversation below code for every drafter, Romansh below English for trained ones",
    4: "on dense models verification, not drafting, dominates energy",
    5: "the saving shrinks with batch; block drafters at large batch cross the ridge and lose; low acceptance costs",
    6: "a tighter latency target met by speculation costs energy; larger batches without it lower J/token",
    7: "little headroom is left for latency-preserving DVFS",
}


def fig(v: Variant, name: str) -> tuple[float, float] | None:
    """(mean, spread) of a variant's figure; None when it has none, fewer than :data:`MIN_REPEATS` repeats,
    or an invalid steady-state window (the claim's ``notes`` say which)."""
    s = v.get("summary", {}).get(name)
    if not s or s.get("mean") is None or not math.isfinite(s["mean"]):
        return None
    if (s.get("n") or 0) < MIN_REPEATS or v.get("window_valid") is False:
        return None
    return s["mean"], s.get("spread") or 0.0


def compare(a: tuple[float, float] | None, b: tuple[float, float] | None) -> str:
    """``holds`` when a < b beyond both spreads, ``fails`` when a > b beyond them, else not resolved."""
    if a is None or b is None:
        return UNRESOLVED
    gap, spread = b[0] - a[0], a[1] + b[1]
    return HOLDS if gap > spread else FAILS if -gap > spread else UNRESOLVED


def check(text: str, verdict: str, **numbers: Any) -> dict[str, Any]:
    return {"check": text, "verdict": verdict, **numbers}


def combine(checks: Sequence[dict[str, Any]]) -> str:
    verdicts = [c["verdict"] for c in checks]
    if not verdicts:
        return UNRESOLVED
    return FAILS if FAILS in verdicts else UNRESOLVED if UNRESOLVED in verdicts else HOLDS


def _fmt(x: tuple[float, float] | None, scale: float = 1.0, unit: str = "") -> str:
    return "n/a" if x is None else f"{x[0] * scale:.4g} ± {x[1] * scale:.2g}{unit}"


def _plain(vs: Sequence[Variant], arch: str, batch: int) -> Variant | None:
    return next((v for v in vs if v["arch"] == arch and v["batch"] == batch and v["source"] == NONE_SOURCE), None)


def saving(v: Variant, vs: Sequence[Variant]) -> tuple[float, float] | None:
    """1 - J/token / plain J/token at the same target and batch, with its spread propagated."""
    base = _plain(vs, v["arch"], v["batch"])
    a, p = fig(v, "window_j_per_token"), base and fig(base, "window_j_per_token")
    if a is None or not p or p[0] <= 0:
        return None
    return 1 - a[0] / p[0], a[1] / p[0] + a[0] * p[1] / p[0] ** 2


def series(vs: Sequence[Variant]) -> dict[tuple[str, str, str, str], list[Variant]]:
    """(arch, drafter, source, corpus) -> its speculative variants by batch."""
    out: dict[tuple[str, str, str, str], list[Variant]] = {}
    for v in vs:
        if v["source"] != NONE_SOURCE:
            out.setdefault((v["arch"], v["drafter"], v["source"], v["corpus"]), []).append(v)
    return {key: sorted(s, key=lambda v: v["batch"]) for key, s in out.items()}


def crossing(points: Sequence[tuple[int, float]]) -> float | None:
    """First batch where a saving reaches 0, log-interpolated; None when it never does."""
    if points and points[0][1] <= 0:
        return float(points[0][0])
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if y0 > 0 >= y1:
            return math.exp(math.log(x0) + y0 / (y0 - y1) * (math.log(x1) - math.log(x0)))
    return None


# ---- the claims ---------------------------------------------------------------------------------
def claim1(vs: Sequence[Variant]) -> list[dict[str, Any]]:
    out = []
    for arch in sorted({v["arch"] for v in vs}):
        plain = sorted((v for v in vs if v["arch"] == arch and v["source"] == NONE_SOURCE), key=lambda v: v["batch"])
        for small, large in zip(plain, plain[1:]):
            a, b = fig(large, "window_j_per_token"), fig(small, "window_j_per_token")
            out.append(check(f"{arch}: plain J/token at batch {large['batch']} below batch {small['batch']}",
                             compare(a, b), **{f"batch_{large['batch']}": _fmt(a), f"batch_{small['batch']}": _fmt(b)}))
        b1 = min((v["batch"] for v in plain), default=None)
        base = _plain(vs, arch, b1) if b1 is not None else None
        for v in vs:
            if base and v["arch"] == arch and v["batch"] == b1 and v["source"] == "published":
                a, b = fig(v, "window_j_per_token"), fig(base, "window_j_per_token")
                out.append(check(f"{arch}: batch {b1}, {v['drafter']} at published acceptance (tau "
                                 f"{_fmt(fig(v, 'tau'))}) below plain J/token", compare(a, b),
                                 speculative=_fmt(a), plain=_fmt(b)))
    return out


def claim2(vs: Sequence[Variant]) -> list[dict[str, Any]]:
    out = []
    for v in vs:
        if v["source"] != "small":
            continue
        pub = next((w for w in vs if w["source"] == "published" and
                    (w["arch"], w["batch"], w["drafter"], w["corpus"]) == (v["arch"], v["batch"], v["drafter"],
                                                                           v["corpus"])), None)
        if pub is None:
            continue
        a, b = fig(pub, "window_j_per_token"), fig(v, "window_j_per_token")
        same = fig(pub, "verified_per_row_step"), fig(v, "verified_per_row_step")
        out.append(check(f"{v['arch']} batch {v['batch']} {v['drafter']}: same positions verified per row-step "
                         f"({_fmt(same[0])} and {_fmt(same[1])}); J/token lower at the higher acceptance",
                         compare(a, b), published=_fmt(a), small=_fmt(b), tau_published=_fmt(fig(pub, "tau")),
                         tau_small=_fmt(fig(v, "tau")), rejected_share_small=_fmt(fig(v, "rejected_share"))))
    return out


def claim3(table: dict[str, Any], published: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    out = []
    for row in table["rows"]:
        t = row["tau"]
        name = f"{row['drafter']} {row['shape']} K{row['k']} T{row['temperature']:g}"
        out.append(check(f"{name}: conversation below code ({t['conversation']} vs {t['code']})",
                         HOLDS if t["conversation"] < t["code"] else FAILS))
        if row["trained"]:
            out.append(check(f"{name}: Romansh below English ({t['romansh']} vs {t['english']})",
                             HOLDS if t["romansh"] < t["english"] else FAILS))
    for name, taus in published.items():
        out.append(check(f"{name} (published): conversation below code ({taus['conversation']} vs {taus['code']})",
                         HOLDS if taus["conversation"] < taus["code"] else FAILS))
    return out


def claim4(vs: Sequence[Variant]) -> list[dict[str, Any]]:
    out = []
    for v in vs:
        if v["source"] == NONE_SOURCE:
            continue
        d, r = fig(v, "share_draft"), fig(v, "share_verify")
        method = v.get("phase_method")
        verdict = UNRESOLVED if method in (None, "measured-total-only") else compare(d, r)
        out.append(check(f"{v['arch']} batch {v['batch']} {v['drafter']} ({v['source']}): verify's share of the "
                         f"energy above draft's ({method})", verdict, draft=_fmt(d), verify=_fmt(r)))
    return out


def claim5(vs: Sequence[Variant], profile: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The checks and the crossover of every series (measured saving and modelled ridge)."""
    out, crossovers = [], []
    for (arch, drafter, source, corpus), s in series(vs).items():
        pts = [(v["batch"], saving(v, vs)) for v in s]
        pts = [(b, x) for b, x in pts if x is not None]
        if len(pts) >= 2:
            (b0, s0), (b1, s1) = pts[0], pts[-1]
            out.append(check(f"{arch} {drafter} ({source}): saving at batch {b1} below batch {b0}", compare(s1, s0),
                             small_batch=_fmt(s0, 100, "%"), large_batch=_fmt(s1, 100, "%")))
        cross = crossing([(b, x[0]) for b, x in pts]) if len(pts) >= 2 else None
        note = ("one batch run" if len(pts) < 2 else "a loss at every batch run" if pts[0][1][0] <= 0 else
                "a saving at every batch run" if cross is None else "log-interpolated between the batches run")
        crossovers.append({"arch": arch, "drafter": drafter, "source": source, "corpus": corpus,
                           "crossover_batch": cross, "note": note, "savings": {b: x[0] for b, x in pts}})
        last = s[-1]
        inten = fig(last, "verify_intensity_modelled")
        if drafter.startswith("block") and source == "published" and pts:
            past = inten is not None and inten[0] > profile.ridge
            where = "past" if past else "below (the batches run never reach the compute-bound regime)"
            out.append(check(f"{arch} {drafter}: at its largest batch, {last['batch']}, verify runs {where} the ridge "
                             f"(modelled {_fmt(inten)} vs {profile.ridge:.0f} FLOP/B); there the saving is a loss",
                             compare(pts[-1][1], (0.0, 0.0)) if past else UNRESOLVED,
                             saving=_fmt(pts[-1][1], 100, "%"), crossover_batch=cross))
        if source == "small":
            for b, x in pts:
                out.append(check(f"{arch} {drafter} at low (small-model) acceptance, batch {b}: J/token above plain",
                                 compare(x, (0.0, 0.0)), saving=_fmt(x, 100, "%")))
    return out, crossovers


def claim6(vs: Sequence[Variant]) -> list[dict[str, Any]]:
    """At EQUAL batch: where speculation meets a tighter p99 TPOT than plain decoding, it costs more J/token;
    without speculation, the largest batch costs less J/token than the smallest.

    A premium across batches (speculation at batch 1 against plain decoding at batch 64) would be a batch
    effect; at one batch only speculation differs.
    """
    out = []
    for arch in sorted({v["arch"] for v in vs}):
        for v in sorted((v for v in vs if v["arch"] == arch and v["source"] == "published"),
                        key=lambda v: (v["batch"], v["drafter"], v["corpus"])):
            plain = _plain(vs, arch, v["batch"])
            ts, tp = fig(v, "tpot_p99_s"), plain and fig(plain, "tpot_p99_s")
            if plain is None or ts is None or tp is None or compare(ts, tp) != HOLDS:
                continue  # no plain run at this batch, or speculation does not meet a tighter target here
            a, b = fig(plain, "window_j_per_token"), fig(v, "window_j_per_token")
            out.append(check(f"{arch} batch {v['batch']}: {v['drafter']} meets a tighter p99 TPOT than plain "
                             f"decoding at the same batch ({_fmt(ts, 1e3, ' ms')} vs {_fmt(tp, 1e3, ' ms')}) and "
                             "costs more J/token", compare(a, b), speculative=_fmt(b), plain=_fmt(a)))
        plain = sorted((v for v in vs if v["arch"] == arch and v["source"] == NONE_SOURCE), key=lambda v: v["batch"])
        if len(plain) >= 2:
            a, b = fig(plain[-1], "window_j_per_token"), fig(plain[0], "window_j_per_token")
            out.append(check(f"{arch}: without speculation, batch {plain[-1]['batch']} costs less J/token than batch "
                             f"{plain[0]['batch']}", compare(a, b), larger_batch=_fmt(a), smaller_batch=_fmt(b)))
    return out


def claim7(vs: Sequence[Variant], clocks_read_only: bool) -> list[dict[str, Any]]:
    clocks = [v["sm_clock_mhz"] for v in vs if v.get("sm_clock_mhz")]
    seen = (f"SM clock under load {min(c['min'] for c in clocks):.0f}-{max(c['max'] for c in clocks):.0f} MHz, "
            "read passively") if clocks else "no SM clock reading on this hardware"
    why = "needs clock control: this command only reads clocks" if clocks_read_only else "no GPU clocks here"
    return [check(f"DVFS headroom at equal latency: {why}; {seen}", NOT_HERE)]


def evidence(n: int, vs: Sequence[Variant]) -> str:
    """What claim ``n``'s verdict rests on: a counter's energy, the model's arithmetic, or measured acceptance."""
    if n == 3:
        return MEASURED_ACCEPTANCE
    if n == 7:
        return "none (not measurable here)"
    return MEASURED if vs and all(v.get("measured") for v in vs) else MODEL


def _label(v: Variant) -> str:
    return f"{v['arch']} b{v['batch']} {v['drafter']} ({v['source']}, {v['corpus']})"


def notes(vs: Sequence[Variant]) -> list[str]:
    """The repeats behind a claim's figures, and every run whose window is invalid (its figures not compared)."""
    counts = sorted({(v.get("summary", {}).get("window_j_per_token") or {}).get("n") or 0 for v in vs})
    out = []
    if counts:
        few = f"; fewer than {MIN_REPEATS}: not compared (a half-range of so few is no uncertainty)" \
            if counts[0] < MIN_REPEATS else ""
        out.append(f"figures over {'/'.join(map(str, counts))} repeats each, spread = half their range{few}")
    bad = [f"{_label(v)}: {'; '.join(v.get('invalid_reasons') or ['invalid'])}" for v in vs
           if v.get("window_valid") is False]
    out += [f"window INVALID, figures not compared: {b}" for b in bad]
    if vs and not bad:
        out.append(f"every window valid ({len(vs)} variants)")
    return out


def evaluate(vs: Sequence[Variant], *, profile: Any, tau_table: dict[str, Any], published: dict[str, Any],
             clocks_read_only: bool, sources: Callable[[int], list[str]]) -> list[dict[str, Any]]:
    """Every claim: ``claim`` 1-7, ``title``, ``verdict``, ``evidence``, ``notes`` (repeats, window validity),
    ``figures`` (its checks) and ``sources``."""
    ok = [v for v in vs if "error" not in v]
    c5, cross = claim5(ok, profile)
    checks = {1: claim1(ok), 2: claim2(ok), 3: claim3(tau_table, published), 4: claim4(ok), 5: c5, 6: claim6(ok),
              7: claim7(ok, clocks_read_only)}
    out = []
    for n, cs in checks.items():
        verdict = NOT_HERE if n == 7 else combine(cs)
        figures: dict[str, Any] = {"checks": cs}
        if n == 5:
            figures["crossover"] = cross
        out.append({"claim": n, "title": TITLES[n], "verdict": verdict, "evidence": evidence(n, ok),
                    "notes": [] if n in (3, 7) else notes(ok), "figures": figures, "sources": sources(n)})
    return out


__all__ = ["evaluate", "evidence", "notes", "compare", "saving", "crossing", "fig", "HOLDS", "FAILS", "UNRESOLVED",
           "NOT_HERE", "TITLES", "MEASURED", "MODEL", "MEASURED_ACCEPTANCE", "MIN_REPEATS"]
