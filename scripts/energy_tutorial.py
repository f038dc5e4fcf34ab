"""The numbers of docs/tutorial.md: a simulated energy counter under a modelled Llama-3.1-8B server.

Run ``python3 scripts/energy_tutorial.py``; it prints named blocks (``== name ==``) that the
tutorial quotes verbatim, and ``tests/test_tutorial.py`` runs it and compares them.

The server is played by :func:`serve` below rather than the engine, so the run is deterministic,
takes seconds on a laptop and needs no GPU: each step is a draft phase (K forwards of an
EAGLE-style head), a verify phase (one forward of K + 1 tokens per row) and a commit, with the
shapes a Llama-3.1-8B target would run on an H200; finished requests are refilled by a prefill.
Each phase goes through the same path as under the engine: a
:class:`~refspec.energy.phases.MeteredPhase` of the meter, the forwards recorded inside it, a
:class:`~refspec.energy.phases.PhaseEvent` to the ledger (wrapped so counter reads are recorded),
then :func:`refspec.energy.accounting.account` on the ledger as read back from disk.
"""
from __future__ import annotations

import math
import random
import tempfile
from pathlib import Path
from typing import Callable

from refspec.config import ModelArgs
from refspec.energy.accounting.headline import Accounting, account
from refspec.energy.accounting.text import format_closure
from refspec.energy.attribution import Loop
from refspec.energy.ledger.counter_records import counter_ledger
from refspec.energy.ledger.events import MeteredPhase, PhaseEvent
from refspec.energy.ledger.read import read_ledger
from refspec.energy.ledger.writer import Ledger
from refspec.energy.model.architectures import arch
from refspec.energy.model.hardware import H200_SXM
from refspec.energy.model.work import ForwardShape, record_forward
from refspec.energy.simulated import SimulatedMeter

TARGET: ModelArgs = arch("llama-3.1-8b")
BATCH, PROMPT, BUDGET, ACCEPT = 16, 256, 128, 0.7
PHASES = ("prefill", "draft", "verify")
LOOP_S = 5.0
"""Modelled seconds each phase-isolated loop runs (50 counter periods)."""


def _verify(rows: int, k: int, context: int) -> ForwardShape:
    return ForwardShape(args=TARGET, rows=rows, tokens_per_row=k + 1, context_tokens=rows * (context + k + 1),
                        dtype_bytes=2)


def _head(rows: int, context: int) -> ForwardShape:
    """One forward of an EAGLE-1-style head: a decoder layer of the target, fc of 2E -> E, the LM head."""
    fc = 2 * TARGET.hidden_size ** 2
    return ForwardShape(args=TARGET, rows=rows, tokens_per_row=1, context_tokens=rows * (context + 1), dtype_bytes=2,
                        layers=1, extra_weight_bytes=2 * fc, extra_flops=2 * fc * rows)


def _prefill(rows: int) -> ForwardShape:
    return ForwardShape(args=TARGET, rows=rows, tokens_per_row=PROMPT, context_tokens=rows * PROMPT, dtype_bytes=2,
                        lm_head_tokens=rows)


def serve(meter: SimulatedMeter, ledger: Callable[[PhaseEvent], None], seconds: float,
          k_of: Callable[[int], int], seed: int = 0) -> None:
    """Play a closed-loop server of ``BATCH`` slots for ``seconds`` of modelled time.

    ``k_of(step)`` is the draft length of each step. Each row accepts each draft with
    probability ``ACCEPT`` until its first rejection; a request leaves at its ``BUDGET`` tokens and
    the next is prefilled into its slot after the step.
    """
    rng = random.Random(seed)
    clock, step, next_id = 0.0, 0, BATCH
    slots = list(range(BATCH))
    left = [BUDGET - 1] * BATCH  # the prefill emits each request's first token
    context = [PROMPT] * BATCH

    def phase(name: str, step_: int, work: list[ForwardShape], **counts) -> None:
        nonlocal clock
        with MeteredPhase(meter, name) as ph:
            for shape in work:
                record_forward(shape)
        ledger(PhaseEvent(step=step_, phase=name, batch=BATCH, work=ph.work, measurement=ph.measurement,
                          clock_s=clock, **counts))
        clock += ph.measurement.time_s

    prefill_counts = dict(rows_active=BATCH, emitted=BATCH, emitted_per_row=(1,) * BATCH,
                          slot_requests=tuple(slots), arrivals_s=(0.0,) * BATCH, queued=10 ** 6)
    phase("prefill", -1, [_prefill(BATCH)], **prefill_counts)
    while clock < seconds:
        k, mean_ctx = k_of(step), sum(context) // BATCH
        common = dict(rows_active=BATCH, slot_requests=tuple(slots), queued=10 ** 6, k=k)
        phase("draft", step, [_head(BATCH, mean_ctx + i) for i in range(k)], drafted=BATCH * k, **common)
        phase("verify", step, [_verify(BATCH, k, mean_ctx)], verified=BATCH * (k + 1), **common)
        emitted, accepted = [], 0
        for row in range(BATCH):
            n = next((i for i in range(k) if rng.random() >= ACCEPT), k)  # drafts accepted before a rejection
            accepted += n
            emitted.append(min(n + 1, left[row]))  # and the bonus token, within the budget
            left[row] -= emitted[-1]
            context[row] += emitted[-1]
        phase("commit", step, [], accepted=accepted, emitted=sum(emitted), emitted_per_row=tuple(emitted), **common)
        done = [row for row in range(BATCH) if left[row] == 0]
        if done:
            new = [-1] * BATCH
            for row in done:
                slots[row], new[row], left[row], context[row], next_id = next_id, next_id, BUDGET - 1, PROMPT, next_id + 1
            phase("prefill", step, [_prefill(len(done))], rows_active=len(done), emitted=len(done),
                  emitted_per_row=tuple(int(n >= 0) for n in new), slot_requests=tuple(new),
                  arrivals_s=tuple(clock if n >= 0 else -1.0 for n in new), queued=10 ** 6)
        step += 1


def loops(meter: SimulatedMeter, seconds: float, context: int, k: int) -> dict[str, Loop]:
    """Each phase alone, repeated for ``seconds`` of modelled time at the run's shapes, read by the counter."""
    rows = {"prefill": 4}  # refills prefill a few rows: that loop is priced per row
    work = {"prefill": [_prefill(rows["prefill"])], "draft": [_head(BATCH, context + i) for i in range(k)],
            "verify": [_verify(BATCH, k, context)]}
    out = {}
    for name, shapes in work.items():
        start, calls = meter.counter.read(), 0
        while meter.counter.read().wall_s - start.wall_s < seconds:
            with MeteredPhase(meter, name):
                for shape in shapes:
                    record_forward(shape)
            calls += 1
        end = meter.counter.read()
        out[name] = Loop(energy_j=end.energy_j - start.energy_j, time_s=end.wall_s - start.wall_s, iterations=calls,
                         rows=rows.get(name))
    return out


def run(directory: Path, name: str, *, period_ms: float, sample_ms: float, seconds: float,
        k_of: Callable[[int], int], with_loops: bool = False) -> Accounting:
    """One server run under a simulated counter, written to a ledger and accounted."""
    meter = SimulatedMeter(H200_SXM, time_source="model", period_s=period_ms / 1e3, sample_s=sample_ms / 1e3)
    path = directory / f"{name}.jsonl"
    with counter_ledger(meter, Ledger(path, run_id=name, meter_source=meter.source, idle_w=meter.idle_w)) as led:
        serve(meter, led, seconds, k_of)
        if with_loops:
            led.end_run()  # the server's end read and end record; the loops run after it
            measured = loops(meter, LOOP_S, PROMPT + BUDGET // 2, k_of(0))
            meter.abandon_run()  # the loops' own reads are theirs, not the run's
            for phase_name, loop in measured.items():
                led.ledger.write_loop(phase_name, loop, meter.source)
    return account(read_ledger(path, strict=True), min_window_s=20.0)


def _row(name: str, shares: dict[str, float] | None) -> str:
    return f"{name:<22}" + "".join(f"{'n/a' if shares is None else f'{100 * shares.get(p, 0.0):.1f}%':>10}"
                                    for p in PHASES)


def table(acc: Accounting) -> str:
    """True, naive and attributed phase shares of one run, and its figures."""
    a = acc.attribution or {}
    lines = [f"{'':<22}" + "".join(f"{p:>10}" for p in PHASES), _row("true (simulated)", acc.phase_share_true),
             _row("naive per-phase read", acc.phase_share_naive),
             _row("fit", a.get("fit_share") if a.get("fit_determined") else None)]
    if a.get("loops_share") is not None:
        lines.append(_row("loops", a["loops_share"]))
    lines.append(_row(f"used ({acc.phase_energy_method})", acc.phase_share if acc.phase_energy_method not in
                      (None, "measured-total-only") else None))
    se = max((a.get("fit_share_se") or {}).values(), default=float("nan"))
    fit = "determined" if a.get("fit_determined") else "undetermined"
    # the undetermined fit's own figures are left out: on a near-singular matrix they are arbitrary
    spread = f"up to {100 * se:.1f} points" if se < 1.0 else "over 100 points"
    lines.append(f"sub-windows {a['sub_windows']}, fit {fit} (share s.e. {spread}, condition "
                 f"~1e{math.floor(math.log10(a['fit_condition']))}), "
                 f"counter total {acc.total_energy_j:.1f} J vs true {a['true_total_j']:.1f} J "
                 f"({100 * a['total_error_vs_true']:+.2f}%)")
    if a.get("additivity_residual") is not None:
        agree = f"largest share difference from the fit {a['agreement']:.3f}, " if a.get("fit_determined") else ""
        lines.append(f"loops: {agree}additivity residual {100 * a['additivity_residual']:+.2f}%")
    lines.append(f"window {'valid' if acc.window_valid else 'INVALID: ' + str(acc.window_invalid_reason)}, "
                 f"J/token {acc.window_j_per_token:.4f} (window), {acc.j_per_token:.4f} (run)")
    lines.append(format_closure(acc.line_items_j, acc.line_items_sum_j, acc.total_energy_j, acc.closure_error_j,
                                acc.closes, acc.phase_energy_method))
    return "\n".join(lines)


def settings(directory: Path) -> str:
    """The naive per-phase read against the truth at three counter settings (P ms period, S ms sampled)."""
    lines = [f"{'P/S ms':<8}{'phase':<9}{'true':>8}{'naive':>8}{'naive off by':>14}   counter total vs true"]
    for period, sample in ((100, 25), (50, 50), (20, 20)):
        acc = run(directory, f"p{period}s{sample}", period_ms=period, sample_ms=sample, seconds=SETTING_S,
                  k_of=lambda s: 4)
        a = acc.attribution or {}
        for i, p in enumerate(PHASES):
            true, naive = acc.phase_share_true[p], acc.phase_share_naive[p]
            tail = f"   {100 * a['total_error_vs_true']:+.2f}%" if i == 0 else ""
            lines.append(f"{f'{period}/{sample}' if i == 0 else '':<8}{p:<9}{100 * true:>7.1f}%{100 * naive:>7.1f}%"
                         f"{100 * (naive / true - 1):>+13.0f}%{tail}")
    return "\n".join(lines)


RUN_S, SETTING_S, SHORT_S = 30.0, 10.0, 6.0
"""Modelled seconds of the main runs, of each counter setting, and of the short run."""


def blocks() -> dict[str, str]:
    """Every block the tutorial quotes, by name."""
    out = {"setup": (f"target llama-3.1-8b on {H200_SXM.name} (modelled), batch {BATCH}, prompts {PROMPT} tokens, "
                     f"budgets {BUDGET} tokens, per-draft acceptance {ACCEPT}; runs of {RUN_S:g} s, "
                     f"loops of {LOOP_S:g} s\ncounter: period 100 ms, sampled 25 ms of each; sub-windows of at "
                     f"least 10 periods")}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        out["fixed"] = table(run(d, "fixed", period_ms=100, sample_ms=25, seconds=RUN_S, k_of=lambda s: 4,
                                 with_loops=True))
        # a policy that changes K with the load: 2 or 6 drafts, each for 300 steps
        out["varied"] = table(run(d, "varied", period_ms=100, sample_ms=25, seconds=RUN_S,
                                  k_of=lambda s: (2, 6)[(s // 300) % 2]))
        out["settings"] = settings(d)
        out["short"] = table(run(d, "short", period_ms=100, sample_ms=25, seconds=SHORT_S, k_of=lambda s: 4))
    return out


def main() -> None:
    for name, text in blocks().items():
        print(f"== {name} ==\n{text}\n")


if __name__ == "__main__":
    main()
