"""``python -m refspec.eval roofline``: the batch x k prediction table, plots and CSV of the roofline model.

The model itself (hardware profiles, forward costs, one speculative step) is :mod:`refspec.energy.model.roofline`;
this module only turns its predictions into a table, PNG plots and a CSV. Every energy it shows is
modelled, never measured.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, Sequence

from refspec.energy.model.architectures import ARCHS, arch, dense_equivalent
from refspec.config import ModelArgs
from refspec.energy.model.roofline import EAGLE_HEAD, DrafterModel, compute_bound_batch, predict_step
from refspec.energy.model.hardware import HardwareProfile, get_profile
from refspec.energy.model.experts import expected_experts
from refspec.eval.outputs import atomic_target, check_output_dir, write_atomic
from refspec.eval.flags import EXIT_USAGE, OneLineParser, UsageError, int_list, integer, one_line, output_path


def _floats(flag: str, text: str) -> list[float]:
    """Comma-separated acceptance rates, each in [0, 1]."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} expects comma-separated numbers in [0, 1], got {text!r}") from None
    if not values or any(not (math.isfinite(v) and 0 <= v <= 1) for v in values):
        raise UsageError(f"{flag} expects comma-separated numbers in [0, 1] (e.g. {flag} 0.6,0.8), got {text!r}")
    return values


def _drafter(text: str) -> DrafterModel:
    if text == "eagle":
        return EAGLE_HEAD
    if text == "eagle3":
        return DrafterModel(name="eagle3-1layer", layers=1, fc_inputs=3)
    if text.startswith("fraction:"):
        try:
            f = float(text.split(":", 1)[1])
        except ValueError:
            f = math.nan
        if not (math.isfinite(f) and f > 0):
            raise UsageError(f"--drafter {text!r}: fraction:F needs a number F > 0 (e.g. fraction:0.1)")
        return DrafterModel(name=f"fraction-{f:g}", fraction=f)
    try:
        if text.startswith("block:"):
            return DrafterModel(name=f"block-{text[6:]}", args=arch(text[6:]), parallel=True)
        return DrafterModel(name=text, args=arch(text))
    except ValueError as exc:
        raise UsageError(f"--drafter {text!r}: {one_line(exc)}") from None


def loss_regions(target: ModelArgs, profile: HardwareProfile, *, k: int, context: int, acceptance: float,
                 drafter: DrafterModel | None = EAGLE_HEAD, dtype_bytes: int = 2,
                 max_batch: int = 4096) -> list[tuple[int, int]]:
    """Batch intervals ``[(first, last), ...]`` in 1..``max_batch`` where speculation with draft
    length ``k`` costs more energy per token than plain decoding (J/token at k above k = 0).

    A dense target loses only at large batch, once verification turns compute-bound. A
    mixture-of-experts target can also lose at small batch: B x (K+1) verified tokens route to
    more distinct experts than B decoded ones, so verification reads more weight bytes, until
    B alone already touches nearly every expert. Found on a grid of batches (powers of two
    and their midpoints) with each change of sign bisected to the exact batch.
    """
    if k <= 0:
        return []

    def loses(b: int) -> bool:
        kw = dict(batch=b, context=context, acceptance=acceptance, drafter=drafter, dtype_bytes=dtype_bytes)
        spec, plain = predict_step(target, profile, k=k, **kw), predict_step(target, profile, k=0, **kw)
        return spec.j_per_token > plain.j_per_token

    grid = sorted({b for p in range(max_batch.bit_length()) for b in (1 << p, 3 << p >> 1) if 1 <= b <= max_batch}
                  | {max_batch})
    marks = [(b, loses(b)) for b in grid]
    regions: list[tuple[int, int]] = []
    start = 1 if marks[0][1] else None
    for (lo, lo_loses), (hi, hi_loses) in zip(marks, marks[1:]):
        if lo_loses == hi_loses:
            continue
        while hi - lo > 1:  # loses(lo) != loses(hi): find the first batch of hi's sign
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if loses(mid) == lo_loses else (lo, mid)
        if hi_loses:
            start = hi
        else:
            regions.append((start, lo))
            start = None
    if start is not None:
        regions.append((start, max_batch))
    return regions


def _checked(args: argparse.Namespace) -> tuple[list[int], list[int], list[float]]:
    """Every flag's range (batch, k, acceptance, context, element size, --out) before any prediction."""
    batches = int_list("--batch", args.batch, low=1)
    ks = int_list("--k", args.k, low=0)
    accs = _floats("--acceptance", args.acceptance)
    integer("--context", args.context, low=1, high=10_000_000)
    integer("--dtype-bytes", args.dtype_bytes, low=1, high=8, fix="2 is bf16, 4 fp32")
    if args.out is not None:
        check_output_dir("--out", args.out)
    return batches, ks, accs


def prediction_table(target: ModelArgs, profile: HardwareProfile, *, batches: Sequence[int], ks: Sequence[int],
                     acceptances: Sequence[float], context: int, drafter: DrafterModel = EAGLE_HEAD,
                     dtype_bytes: int = 2) -> list[dict[str, Any]]:
    """Predictions for every (acceptance, k, batch), each with its saving vs k = 0 at that batch.

    Returns:
        Rows with keys acceptance, k, batch, tokens_per_row, tpot_ms, j_per_token, saving
        (1 - J/token / J/token at k = 0; negative = speculation costs energy), speedup
        (k = 0 TPOT / TPOT), verify_intensity, bound ("memory" or "compute"); for a
        mixture-of-experts target also experts_per_layer (expected distinct experts one MoE
        layer reads in the verify forward), dense_j_per_token and dense_saving (the same for
        :func:`~refspec.energy.model.architectures.dense_equivalent`, a dense model of equal active
        parameters).
    """
    rows = []
    dense = dense_equivalent(target) if target.is_moe else None
    for a in acceptances:
        for b in batches:
            kw = dict(batch=b, context=context, acceptance=a, drafter=drafter, dtype_bytes=dtype_bytes)
            base = predict_step(target, profile, k=0, **kw)
            dense_base = predict_step(dense, profile, k=0, **kw) if dense else None
            for k in ks:
                p = base if k == 0 else predict_step(target, profile, k=k, **kw)
                row = dict(acceptance=a, k=k, batch=b, tokens_per_row=p.tokens_per_row, tpot_ms=p.tpot_s * 1e3,
                           j_per_token=p.j_per_token, saving=1.0 - p.j_per_token / base.j_per_token,
                           speedup=base.tpot_s / p.tpot_s, verify_intensity=p.verify_cost.intensity,
                           bound="compute" if p.verify_compute_bound else "memory")
                if dense is not None:
                    d = dense_base if k == 0 else predict_step(dense, profile, k=k, **kw)
                    row.update(experts_per_layer=expected_experts(target.num_experts, target.num_experts_per_tok,
                                                                  b * (k + 1)),
                               dense_j_per_token=d.j_per_token,
                               dense_saving=1.0 - d.j_per_token / dense_base.j_per_token)
                rows.append(row)
    return rows


def loss_lines(target: ModelArgs, profile: HardwareProfile, *, ks: Sequence[int], acceptances: Sequence[float],
               context: int, drafter: DrafterModel = EAGLE_HEAD, dtype_bytes: int = 2,
               max_batch: int = 4096) -> list[str]:
    """One line per (acceptance, k > 0): the batches where speculation loses energy
    (:func:`~refspec.eval.roofline_cli.loss_regions`), each bound as B and B x (K+1) verified
    tokens; an MoE target's line names the experts per layer verification reads there and the
    dense equivalent's regions beside."""
    dense = dense_equivalent(target) if target.is_moe else None

    def spans(args: ModelArgs, a: float, k: int) -> str:
        regions = loss_regions(args, profile, k=k, context=context, acceptance=a, drafter=drafter,
                               dtype_bytes=dtype_bytes, max_batch=max_batch)
        if not regions:
            return f"no batch up to {max_batch}"
        out = []
        for lo, hi in regions:
            t = k + 1
            if hi >= max_batch:
                text = f"B >= {lo} (B(K+1) >= {lo * t})"
            else:
                text = f"B {lo}" + (f"..{hi}" if hi > lo else "") + f" (B(K+1) {lo * t}" + (
                    f"..{hi * t})" if hi > lo else ")")
            if args.is_moe and hi < max_batch:
                x, ke = args.num_experts, args.num_experts_per_tok
                text += (f" [verify reads {expected_experts(x, ke, hi * (k + 1)):.1f} of {x} experts/layer "
                         f"vs {expected_experts(x, ke, hi):.1f} decoding]")
            out.append(text)
        return ", ".join(out)

    lines = []
    for a in acceptances:
        for k in ks:
            if k == 0:
                continue
            line = f"  a={a:.2f} k={k}: speculation loses energy at {spans(target, a, k)}"
            if dense is not None:
                line += f"; dense equivalent: {spans(dense, a, k)}"
            lines.append(line)
    return lines


def _plot(rows: list[dict[str, Any]], profile: HardwareProfile, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(11, 4.2))
    ks = sorted({r["k"] for r in rows})
    for i, k in enumerate(ks):
        sel = sorted((r for r in rows if r["k"] == k), key=lambda r: r["batch"])
        color = f"C{i}"
        bs = [r["batch"] for r in sel]
        ax_t.plot(bs, [r["tpot_ms"] for r in sel], "o-", color=color, label=f"k={k}")
        ax_e.plot(bs, [r["j_per_token"] for r in sel], "o-", color=color, label=f"k={k}")
        if "dense_j_per_token" in sel[0]:  # an MoE target: its dense equivalent dashed
            ax_e.plot(bs, [r["dense_j_per_token"] for r in sel], "--", color=color, lw=1)
        cross = profile.ridge / (k + 1)  # naive balance point: B (k + 1) = ridge
        for ax in (ax_t, ax_e):
            ax.axvline(cross, color=color, ls=":", lw=1)
    for ax, label in ((ax_t, "time per output token per user (ms)"), (ax_e, "energy per output token (J, modelled)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    dense = "; dashed: dense equivalent" if rows and "dense_j_per_token" in rows[0] else ""
    ax_e.legend(title=f"dotted: B(k+1) = ridge{dense}", fontsize=8, loc="upper right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with atomic_target(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def _format_table(rows: list[dict[str, Any]]) -> str:
    moe = bool(rows) and "dense_j_per_token" in rows[0]
    head = f"{'a':>5} {'k':>3} {'batch':>6} {'tok/step':>8} {'TPOT ms':>9} {'J/token':>10} {'saving':>8} " \
           f"{'speedup':>7} {'FLOP/B':>7} {'verify':>8}"
    if moe:
        head += f" {'experts/L':>9} {'dense J/tok':>11} {'dense sav':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        line = (f"{r['acceptance']:>5.2f} {r['k']:>3d} {r['batch']:>6d} {r['tokens_per_row']:>8.2f} "
                f"{r['tpot_ms']:>9.3f} {r['j_per_token']:>10.4g} {100 * r['saving']:>7.1f}% "
                f"{r['speedup']:>7.2f} {r['verify_intensity']:>7.1f} {r['bound']:>8}")
        if moe:
            line += (f" {r['experts_per_layer']:>9.1f} {r['dense_j_per_token']:>11.4g} "
                     f"{100 * r['dense_saving']:>8.1f}%")
        lines.append(line)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: print a prediction table, optionally write plots and a CSV."""
    args = _parser().parse_args(argv)
    try:
        batches, ks, accs = _checked(args)
        try:
            target = arch(args.model)
        except ValueError as exc:
            raise UsageError(f"--model {args.model!r}: {one_line(exc)}") from None
        try:
            profile = get_profile(args.gpu, args.dtype_bytes)
        except ValueError as exc:
            raise UsageError(f"--gpu {args.gpu!r}: {one_line(exc)}") from None
        drafter = _drafter(args.drafter)
        if 0 not in ks:
            ks = [0, *ks]
        if args.tp is not None:  # over tensor-parallel GPUs: refspec.eval.roofline_tp
            from refspec.eval.roofline_tp import tp_report

            print(tp_report(args.model, target, profile, tps=int_list("--tp", args.tp, low=1), batches=batches, ks=ks,
                            acceptances=accs, context=args.context, drafter=drafter, dtype_bytes=args.dtype_bytes,
                            out=args.out))
            return 0
        if args.policy is not None:  # the K the energy policy picks: refspec.eval.roofline_policy
            return _policy_report(args, target, profile, drafter, batches, ks, accs)
        rows = prediction_table(target, profile, batches=batches, ks=ks, acceptances=accs, context=args.context,
                                drafter=drafter, dtype_bytes=args.dtype_bytes)
    except (UsageError, ValueError) as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    active = (f" ({target.active_parameters() / 1e9:.2f} B active: {target.num_experts_per_tok} of "
              f"{target.num_experts} experts per token; beside a dense equivalent of "
              f"{dense_equivalent(target).num_parameters() / 1e9:.2f} B)" if target.is_moe else "")
    print(f"model {args.model}: {target.num_parameters() / 1e9:.2f} B params{active}; profile {profile.name}: "
          f"{profile.peak_flops / 1e12:.1f} TFLOP/s, {profile.bandwidth_Bps / 1e12:.2f} TB/s, ridge "
          f"{profile.ridge:.0f} FLOP/B; drafter {drafter.name}; context {args.context}")
    print(f"energy source: modelled:roofline({profile.name}) (static {profile.static_w:g} W, "
          f"{profile.pj_per_flop:g} pJ/FLOP, {profile.pj_per_byte:g} pJ/B)")
    for k in ks:
        b = compute_bound_batch(target, profile, k=k, context=args.context, dtype_bytes=args.dtype_bytes)
        print(f"  k={k}: verify turns compute-bound at batch {b if b else '> 65536'} "
              f"(naive B(k+1) = ridge: {profile.ridge / (k + 1):.0f})")
    print("where speculation loses energy per token (J/token above k=0 at the same batch):")
    for line in loss_lines(target, profile, ks=ks, acceptances=accs, context=args.context, drafter=drafter,
                           dtype_bytes=args.dtype_bytes):
        print(line)
    print(_format_table(rows))
    if args.out is not None:
        try:
            _write_outputs(args.out, rows, accs, profile, drafter, args)
        except OSError as exc:
            print(f"error: --out {args.out}: cannot write: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_USAGE
    return 0


def _policy_report(args: argparse.Namespace, target: ModelArgs, profile: HardwareProfile, drafter: DrafterModel,
                   batches: Sequence[int], ks: Sequence[int], accs: Sequence[float]) -> int:
    """``--policy energy[:tpot_ms=T]``: the K the energy policy picks per acceptance and batch."""
    from refspec.eval.roofline_policy import format_policy_table, policy_rows
    from refspec.policy import PolicySpecError, parse_policy

    try:
        spec = parse_policy(args.policy)
    except PolicySpecError as exc:
        raise UsageError(str(exc).replace("--spec-policy", "--policy")) from None
    if spec.kind != "energy":
        raise UsageError(f"--policy {args.policy!r}: the table shows the energy policy's choice; use energy or "
                         f"energy:tpot_ms=T (the fixed-rule policies need no prediction)")
    rows = policy_rows(target, profile, batches=batches, ks=ks, acceptances=accs, context=args.context,
                       drafter=None if drafter.free else drafter, dtype_bytes=args.dtype_bytes, tpot_ms=spec.tpot_ms)
    print(f"model {args.model} on {profile.name} (modelled), drafter {drafter.name}, context {args.context}, K from "
          f"{', '.join(map(str, ks))}")
    print(format_policy_table(rows, spec.tpot_ms))
    if args.mix is not None:
        from refspec.eval.roofline_policy import format_mixed_table, mixed_rows

        mix = _floats("--mix", args.mix.replace("+", ","))
        if len(mix) != 2:
            raise UsageError(f"--mix {args.mix!r}: two acceptance rates A1+A2, e.g. 0.8+0.3")
        print(format_mixed_table(mixed_rows(target, profile, batches=batches, ks=ks, mix=(mix[0], mix[1]),
                                            context=args.context, drafter=None if drafter.free else drafter,
                                            dtype_bytes=args.dtype_bytes), (mix[0], mix[1])))
    return 0


def _parser() -> argparse.ArgumentParser:
    """The command line of ``python -m refspec.eval roofline``."""
    parser = OneLineParser(
        prog="python -m refspec.eval roofline",
        description="Roofline prediction of time and energy per output token of speculative decoding "
                    "against batch size, for each draft length k. All energies are MODELLED from a hardware "
                    "profile (data-sheet peak and bandwidth, prior energy coefficients), never measured.",
        epilog="Model: a step is K draft forwards of the drafter plus one verify forward of K+1 tokens per row; "
               "each forward takes max(FLOPs/peak, bytes/bandwidth) + a launch overhead; energy = static W x time "
               "+ pJ/FLOP x FLOPs + pJ/byte x bytes. Tokens per step per row = (1 - a^(k+1)) / (1 - a) "
               "(Leviathan et al. 2023). 'saving' compares J/token with k=0 at the same batch (negative = loss); "
               "'verify' says whether the verify forward is memory- or compute-bound; the plots mark the naive "
               "balance point B(k+1) = ridge with dotted lines. Default drafter: an EAGLE-1/2-like head (one target "
               "decoder layer + 2E x E fc + the target's LM head, k sequential forwards).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="llama-3.1-8b",
                        help=f"target architecture: {', '.join(ARCHS)}, or a config.json path")
    parser.add_argument("--gpu", default="h200", help="hardware profile: h100, h200 or cpu (measured now)")
    parser.add_argument("--batch", default="1,2,4,8,16,32,64,128,256", help="comma-separated batch sizes")
    parser.add_argument("--k", default="0,1,3,7,15", help="comma-separated draft lengths (0 = no speculation)")
    parser.add_argument("--acceptance", default="0.6,0.8", help="comma-separated per-token acceptance rates a")
    parser.add_argument("--context", type=int, default=512, help="tokens in each row's KV cache")
    parser.add_argument("--drafter", default="eagle",
                        help="eagle (1-layer head + fc + LM head), eagle3 (3E fc), fraction:F (each draft forward "
                             "costs F x a target decode forward), an architecture name (draft model, k forwards), "
                             "or block:ARCH (one forward drafts k tokens)")
    parser.add_argument("--dtype-bytes", type=int, default=2, help="bytes per weight/KV element (2 = bf16)")
    parser.add_argument("--out", type=output_path, default=None, help="directory for PNG plots and a CSV table")
    parser.add_argument("--policy", default=None, metavar="energy[:tpot_ms=T]",
                        help="instead of the table, the K the energy speculation policy picks (from --k) per "
                             "acceptance and batch, and its saving against K=0")
    parser.add_argument("--mix", default=None, metavar="A1+A2",
                        help="with --policy: also a stream mixing requests of acceptance A1 and A2 (equal odds, "
                             "binomial per step): J/token of every fixed K and of the policy choosing K per step")
    parser.add_argument("--tp", default=None, metavar="N,...",
                        help="tensor-parallel GPUs, comma-separated (e.g. 1,2,4,8): each GPU's share of the weights, "
                             "two ring all-reduces per layer over the profile's NVLink, replicated drafters; prints "
                             "the crossovers per N and a table per (N, k, batch)")
    return parser


def _write_outputs(out: Path, rows: list[dict[str, Any]], accs: Sequence[float], profile: HardwareProfile,
                   drafter: DrafterModel, args: argparse.Namespace) -> None:
    """The table as CSV and one plot per acceptance rate in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    stem = f"roofline_{args.model.replace('/', '_')}_{profile.name}_ctx{args.context}"
    table = [list(rows[0]), *(r.values() for r in rows)]  # the header, then one line per row
    write_atomic(out / f"{stem}.csv", "".join(",".join(map(str, r)) + "\n" for r in table))
    for a in accs:
        path = out / f"{stem}_a{a:g}.png"
        _plot([r for r in rows if r["acceptance"] == a], profile,
              f"{args.model} on {profile.name} (modelled), context {args.context}, acceptance {a:g}, "
              f"drafter {drafter.name}", path)
        print(f"wrote {path}")
    print(f"wrote {out / f'{stem}.csv'}")


if __name__ == "__main__":
    sys.exit(main())
