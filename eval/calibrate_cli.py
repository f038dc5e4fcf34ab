"""``python -m refspec.eval calibrate``: this machine's CPU GEMM plan and the timings it was chosen
from; ``--force`` times the forms again (do it on a quiet machine: a calibration whose timing
rounds disagree is refused and nothing is cached, see :mod:`refspec.models.calibration`)."""
from __future__ import annotations

import logging
import sys
from typing import Sequence

from refspec.eval.flags import OneLineParser
from refspec.models import calibration as C


def format_plan(plan: C.GemmPlan, fresh: C.GemmPlan | None, dtypes: Sequence[str], path: str) -> str:
    """The plan of each dtype with its timings, or why it is missing (a refused calibration shows
    the timings it was refused on)."""
    m = plan.machine
    lines = [f"CPU GEMM plan for {m['cpu']} (torch {m['torch']}, {m['threads']} threads): {path}"]
    for d in dtypes:
        source = fresh if fresh is not None and d in fresh.forms else plan
        if d not in source.forms:
            lines.append(f"{d}: not calibrated (its products take the reference form, F.linear)")
            continue
        rounds = f"timing rounds differ by {100 * source.spread.get(d, 0.0):.0f}% (limit {100 * C.BUSY_SPREAD:.0f}%)"
        if not C.trusted(source, d):
            lines.append(f"{d}: REFUSED, {rounds}: the machine was busy; nothing was cached and {d} products "
                         "take the reference form (F.linear). Rerun with --force on a quiet machine.")
        else:
            lines.append(f"{d}: {' '.join(f'{b}={source.forms[d][b]}' for b in C.BUCKETS)} "
                         f"({'measured now' if source is fresh else 'cached'}; {rounds})")
        lines += _timing_table(source, d)
    return "\n".join(lines)


def _timing_table(plan: C.GemmPlan, d: str) -> list[str]:
    """Milliseconds per pass over the calibration matrices, best of the rounds, * = chosen."""
    t = plan.timings_s[d]
    forms = list(dict.fromkeys(f for b in C.BUCKETS for f in t.get(b, {})))
    out = ["  ms per pass over the timed matrices, best of the rounds (* chosen):",
           "  " + f"{'bucket':<8}{'rows':<12}" + "".join(f"{f:>10}" for f in forms)]
    for b in C.BUCKETS:
        row = t.get(b, {})
        cells = "".join(f"{'' if f not in row else ('*' if plan.forms[d][b] == f else '') + f'{1e3 * row[f]:.2f}':>10}"
                        for f in forms)
        out.append(f"  {b:<8}{','.join(map(str, C.BUCKET_ROWS[b])):<12}{cells}")
    curve = t.get("rows", {})
    if curve:
        out.append("  product cost by rows (chosen forms): "
                   + ", ".join(f"{r}: {1e3 * s:.2f} ms" for r, s in sorted(curve.items(), key=lambda kv: int(kv[0]))))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: print the plan (calibrating the dtypes not cached yet, every dtype with ``--force``);
    exit 1 when a calibration was refused, 2 on bad flags."""
    parser = OneLineParser(
        prog="python -m refspec.eval calibrate",
        description="Show the CPU GEMM plan refspec uses on this machine (which product form each dtype and row "
                    "count takes) and the timings it was chosen from. Dtypes without a cached plan are timed now; "
                    "--force times every dtype again. Run it on a quiet machine: when the timing rounds disagree "
                    "by more than the limit, the calibration is refused and nothing is cached.")
    parser.add_argument("--force", action="store_true", help="time the forms again even where a plan is cached")
    parser.add_argument("--dtype", default="fp32,bf16", help="comma-separated dtypes to show or calibrate "
                                                             "(fp32, bf16, fp16; default fp32,bf16)")
    args = parser.parse_args(argv)
    dtypes = tuple(d.strip() for d in args.dtype.split(",") if d.strip())
    bad = [d for d in dtypes if d not in C.DTYPES]
    if bad or not dtypes:
        print(f"error: --dtype {args.dtype!r}: use fp32, bf16 or fp16 (comma-separated)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from refspec.assets.registry import refspec_home
    from refspec.eval.runtime import set_threads

    set_threads()  # the plan is keyed by the thread count the tools run with
    home = refspec_home()
    plan = C.cached_plan(home)
    todo = tuple(d for d in dtypes if args.force or d not in plan.forms)
    fresh = C.calibrate(todo) if todo else None
    if fresh is not None:
        plan = C.adopt(home, plan, fresh)
    print(format_plan(plan, fresh, dtypes, str(C.plan_path(home, plan.machine))))
    return 1 if fresh is not None and not all(C.trusted(fresh, d) for d in todo) else 0
