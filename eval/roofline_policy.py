"""``python -m refspec.eval roofline --policy energy[:tpot_ms=T]``: the K the energy policy picks.

For each acceptance and batch of the roofline table, the K that :class:`refspec.policy_energy.EnergyPolicy`
would choose for a step of that many active rows at that context, every row accepting drafts
at the per-token rate a (its prior, nothing observed yet; no probe), from the ``--k`` list, and
what that K saves per token against plain decoding. Modelled, never measured.
"""
from __future__ import annotations

from typing import Any, Sequence

from refspec.config import ModelArgs
from refspec.energy.roofline import DrafterModel, HardwareProfile
from refspec.policy import StepView
from refspec.policy_energy import EnergyPolicy, RooflineStepCost, cheapest


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


__all__ = ["format_policy_table", "policy_rows"]
