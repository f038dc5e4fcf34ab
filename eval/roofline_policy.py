"""``python -m refspec.eval roofline --policy energy[:tpot_ms=T]``: the K the energy policy picks.

For each acceptance and batch of the roofline table, the K that :class:`refspec.policy_energy.EnergyPolicy`
would choose for a step of that many active rows at that context, every row accepting drafts
at the per-token rate a (its prior, nothing observed yet; no probe), from the ``--k`` list, and
what that K saves per token against plain decoding. Modelled, never measured.

With ``--mix A1+A2`` (:func:`mixed_rows`): a stream whose requests draft at per-token rate A1
or A2 with equal odds (code beside conversation, say), each step's B rows an independent draw
(binomial composition; one row alternates at batch 1). The policy knows each row's rate and
picks K per step for the rows it has; a fixed K serves every composition alike. Aggregate
J/token = expected step energy / expected step tokens, for the policy and every fixed K.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from refspec.config import ModelArgs
from refspec.energy.model.hardware import HardwareProfile
from refspec.energy.model.roofline import DrafterModel
from refspec.policy_energy import EnergyPolicy, RooflineStepCost, cheapest
from refspec.policy_protocol import StepView


def policy_rows(target: ModelArgs, profile: HardwareProfile, *, batches: Sequence[int], ks: Sequence[int],
                acceptances: Sequence[float], context: int, drafter: DrafterModel | None, dtype_bytes: int = 2,
                tpot_ms: float | None = None) -> list[dict[str, Any]]:
    """Per (acceptance, batch): the chosen ``k``, its ``j_per_token``, ``tpot_ms``, ``saving`` against
    K = 0 and ``meets`` (whether its predicted TPOT meets ``tpot_ms``; False: no K does, the fastest)."""
    ks = sorted(set(ks) | {0})
    cost = RooflineStepCost(target, profile, drafter=drafter, dtype_bytes=dtype_bytes, kv_bucket=1)
    rows = []
    for a in acceptances:
        for b in batches:
            policy = EnergyPolicy(k=max(ks), cost=cost, tpot_ms=tpot_ms, prior=a, ks=ks, optimism=0.0)
            view = StepView(step=0, batch=b, active=b, max_k=max(ks), length_bound=context + 1,
                            slot_requests=tuple(range(b)))
            opts = policy.options(view)
            best, plain = cheapest(opts, policy.tpot_s), next(o for o in opts if o.k == 0)
            rows.append(dict(acceptance=a, batch=b, k=best.k, j_per_token=best.j_per_token, tpot_ms=best.tpot_s * 1e3,
                             saving=1.0 - best.j_per_token / plain.j_per_token,
                             meets=tpot_ms is None or best.tpot_s * 1e3 <= tpot_ms))
    return rows


def mixed_rows(target: ModelArgs, profile: HardwareProfile, *, batches: Sequence[int], ks: Sequence[int],
               mix: tuple[float, float], context: int, drafter: DrafterModel | None, dtype_bytes: int = 2
               ) -> list[dict[str, Any]]:
    """Per batch: the policy's aggregate J/token on the mixed stream, every fixed K's, the best
    fixed K and ``vs_best`` (policy / best fixed - 1; negative: the policy saves)."""
    ks = sorted(set(ks) | {0})
    cost = RooflineStepCost(target, profile, drafter=drafter, dtype_bytes=dtype_bytes, kv_bucket=1)
    tokens = {(k, a): sum(a ** i for i in range(k + 1)) for k in ks for a in mix}  # per row per step
    rows = []
    for b in batches:
        energy = {k: cost(b, k, context + 1)[1] for k in ks}
        fixed_e, fixed_t, pol_e, pol_t = dict.fromkeys(ks, 0.0), dict.fromkeys(ks, 0.0), 0.0, 0.0
        for c in range(b + 1):  # c rows at the first rate
            p = math.comb(b, c) / 2 ** b
            step_tokens = {k: c * tokens[(k, mix[0])] + (b - c) * tokens[(k, mix[1])] for k in ks}
            for k in ks:
                fixed_e[k] += p * energy[k]
                fixed_t[k] += p * step_tokens[k]
            best = min(ks, key=lambda k: (energy[k] / step_tokens[k], k))
            pol_e, pol_t = pol_e + p * energy[best], pol_t + p * step_tokens[best]
        fixed = {k: fixed_e[k] / fixed_t[k] for k in ks}
        best_k = min(fixed, key=lambda k: (fixed[k], k))
        rows.append(dict(batch=b, policy=pol_e / pol_t, fixed=fixed, best_k=best_k,
                         vs_best=(pol_e / pol_t) / fixed[best_k] - 1.0))
    return rows


def format_mixed_table(rows: Sequence[dict[str, Any]], mix: tuple[float, float]) -> str:
    """One line per batch: every fixed K's J/token on the mixed stream, the policy's and its gain."""
    ks = sorted(rows[0]["fixed"])
    head = f"{'batch':>6} " + "".join(f"{'K=' + str(k):>11}" for k in ks) + f"{'policy':>11} {'vs best fixed K':>16}"
    lines = [f"mixed stream, per-token acceptance {mix[0]:g} or {mix[1]:g} per request with equal odds "
             f"(J/token, modelled):", head]
    for r in rows:
        lines.append(f"{r['batch']:>6} " + "".join(f"{r['fixed'][k]:>11.4g}" for k in ks)
                     + f"{r['policy']:>11.4g} {100 * r['vs_best']:>+8.2f}% (K={r['best_k']})")
    return "\n".join(lines)


def format_policy_table(rows: Sequence[dict[str, Any]], tpot_ms: float | None) -> str:
    """A grid: one line per acceptance, one column per batch, each cell ``K (saving vs K=0)``."""
    batches = sorted({r["batch"] for r in rows})
    accs = sorted({r["acceptance"] for r in rows})
    cell = {(r["acceptance"], r["batch"]): r for r in rows}
    target = f", TPOT target {tpot_ms:g} ms" if tpot_ms is not None else ""
    lines = [f"K the energy policy picks (least predicted J/token{target}; in brackets its J/token saving against "
             f"K=0, '!' where no K meets the target and the fastest is taken):",
             f"{'a':>5} " + "".join(f"{'B=' + str(b):>14}" for b in batches)]
    for a in accs:
        parts = []
        for b in batches:
            r = cell[(a, b)]
            parts.append(f"{r['k']:>3d} ({100 * r['saving']:+5.1f}%)" + ("!" if not r["meets"] else " "))
        lines.append(f"{a:>5.2f} " + "".join(f"{p:>14}" for p in parts))
    return "\n".join(lines)


__all__ = ["format_mixed_table", "format_policy_table", "mixed_rows", "policy_rows"]
