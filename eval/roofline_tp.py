"""``python -m refspec.eval roofline --tp 1,2,4,8``: the prediction table over tensor-parallel GPUs.

The model is :mod:`refspec.models.tp.interconnect` (each GPU's share, two ring all-reduces per
layer over the profile's link, replicated drafters); this module prints, per N, the weights one
GPU reads, the two crossovers of the verify forward, and one row per (acceptance, N, K, batch)
with its saving against K = 0 at the same N. Every figure is modelled.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from refspec.config import ModelArgs
from refspec.energy.model.hardware import HardwareProfile
from refspec.energy.model.roofline import DrafterModel
from refspec.models.tp.interconnect import crossovers, predict_tp_step, share_args


def tp_rows(target: ModelArgs, profile: HardwareProfile, *, tps: Sequence[int], batches: Sequence[int],
            ks: Sequence[int], acceptances: Sequence[float], context: int, drafter: DrafterModel,
            dtype_bytes: int = 2) -> list[dict[str, Any]]:
    """One row per (acceptance, N, K, batch): times in ms, J/token of all N GPUs, saving and
    speedup against K = 0 at the same N and batch.

    Raises:
        refspec.models.tp.plan.TPError: an N the model's heads cannot be shared by.
    """
    rows = []
    for a in acceptances:
        for tp in tps:
            for b in batches:
                kw = dict(tp=tp, batch=b, context=context, acceptance=a, drafter=drafter, dtype_bytes=dtype_bytes)
                base = predict_tp_step(target, profile, k=0, **kw)
                for k in ks:
                    p = base if k == 0 else predict_tp_step(target, profile, k=k, **kw)
                    v = p.verify
                    rows.append(dict(acceptance=a, tp=tp, k=k, batch=b, gb_per_gpu=p.weight_bytes_per_gpu / 1e9,
                                     allreduce_mb=v.tensor_bytes / 1e6, comm_ms=v.comm_s * 1e3,
                                     verify_ms=v.time_s * 1e3, comm_share=v.comm_s / v.time_s, bound=v.bound,
                                     tpot_ms=p.tpot_s * 1e3, j_per_token=p.j_per_token,
                                     saving=1.0 - p.j_per_token / base.j_per_token, speedup=base.tpot_s / p.tpot_s))
    return rows


def crossover_lines(target: ModelArgs, profile: HardwareProfile, *, tps: Sequence[int], ks: Sequence[int],
                    context: int, dtype_bytes: int = 2) -> list[str]:
    """Per N: weights per GPU and, per K, the batch where verify turns compute-bound and where
    compute plus all-reduce time outgrows the weight read."""
    lines = []
    for tp in tps:
        held = share_args(target, tp).num_parameters() * dtype_bytes  # the embedding whole, the LM head too
        lm_head = target.vocab_size * target.hidden_size * dtype_bytes
        parts = []
        for k in ks:
            cb, tb = crossovers(target, profile, tp=tp, k=k, context=context, dtype_bytes=dtype_bytes)
            parts.append(f"k={k}: compute-bound at B {cb if cb else '> 65536'}, "
                         f"compute + all-reduce outgrow the weight read at B {tb if tb else '> 65536'}")
        ar = f"{2 * target.num_layers} all-reduces per forward" if tp > 1 else "no collectives"
        lines.append(f"  tp={tp}: each GPU holds {held / 1e9:.1f} GB of weights (embedding and LM head "
                     f"replicated, {lm_head / 1e9:.2f} GB each), {ar}")
        lines += [f"    {p}" for p in parts]
    return lines


def format_tp_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width table."""
    head = (f"{'a':>5} {'tp':>3} {'k':>3} {'batch':>6} {'GB/GPU':>7} {'AR MB':>7} {'comm ms':>8} {'verify ms':>9} "
            f"{'comm':>5} {'verify':>7} {'TPOT ms':>8} {'J/token':>9} {'saving':>7} {'speedup':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['acceptance']:>5.2f} {r['tp']:>3d} {r['k']:>3d} {r['batch']:>6d} {r['gb_per_gpu']:>7.1f} "
                     f"{r['allreduce_mb']:>7.3f} {r['comm_ms']:>8.3f} {r['verify_ms']:>9.3f} "
                     f"{100 * r['comm_share']:>4.0f}% {r['bound']:>7} {r['tpot_ms']:>8.3f} {r['j_per_token']:>9.4g} "
                     f"{100 * r['saving']:>6.1f}% {r['speedup']:>7.2f}")
    return "\n".join(lines)


def tp_report(model: str, target: ModelArgs, profile: HardwareProfile, *, tps: Sequence[int], batches: Sequence[int],
              ks: Sequence[int], acceptances: Sequence[float], context: int, drafter: DrafterModel,
              dtype_bytes: int = 2, out: Path | None = None) -> str:
    """The whole printout (and ``out``/roofline_tp_*.csv when ``out`` is given)."""
    rows = tp_rows(target, profile, tps=tps, batches=batches, ks=ks, acceptances=acceptances, context=context,
                   drafter=drafter, dtype_bytes=dtype_bytes)
    head = [f"model {model}: {target.num_parameters() / 1e9:.2f} B params; profile {profile.name}: "
            f"{profile.peak_flops / 1e12:.0f} TFLOP/s, {profile.bandwidth_Bps / 1e12:.2f} TB/s HBM, link "
            f"{(profile.link_Bps or 0) / 1e9:.0f} GB/s each way + {profile.link_latency_s * 1e6:.0f} us per "
            f"all-reduce; drafter {drafter.name} (replicated on every GPU); context {context}",
            f"energy source: modelled:roofline({profile.name}) x N GPUs + {profile.link_pj_per_byte:g} pJ per link "
            f"byte; a ring all-reduce sends 2(N-1)/N x the tensor per GPU; the collectives add to the time",
            "crossovers of the verify forward:"]
    head += crossover_lines(target, profile, tps=tps, ks=ks, context=context, dtype_bytes=dtype_bytes)
    text = "\n".join(head) + "\n" + format_tp_table(rows)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"roofline_tp_{model.replace('/', '_')}_{profile.name}_ctx{context}.csv"
        with open(path, "w") as fh:
            fh.write(",".join(rows[0]) + "\n")
            fh.writelines(",".join(str(v) for v in r.values()) + "\n" for r in rows)
        text += f"\nwrote {path}"
    return text


__all__ = ["tp_rows", "crossover_lines", "format_tp_table", "tp_report"]
