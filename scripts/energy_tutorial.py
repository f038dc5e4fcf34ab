"""The numbers of docs/tutorial.md: a simulated device under a modelled Llama-3.1-8B server.

Run ``python3 scripts/energy_tutorial.py``; it prints named blocks (``== name ==``) that the
tutorial quotes verbatim, and ``tests/test_tutorial.py`` runs it and compares them.

The server is played by :func:`serve` below rather than the engine, so the run is deterministic,
takes seconds on a laptop and needs no GPU: each step is a draft phase (K forwards of an
EAGLE-style head), a verify phase (one forward of K + 1 tokens per row) and a commit, with the
shapes a Llama-3.1-8B target would run on an H200; finished requests are refilled by a prefill.
Each phase goes through the same path as under the engine: a
:class:`~refspec.energy.ledger.events.MeteredPhase` of the meter, the forwards recorded inside it, a
:class:`~refspec.energy.ledger.events.PhaseEvent` to the ledger (wrapped so counter reads are recorded),
then :func:`refspec.energy.accounting.headline.account` and
:func:`refspec.energy.accounting.per_request.split_energy` on the ledger as read back from disk. The
meter is a :class:`~refspec.energy.meters.simulated.SimulatedMeter`: an H200-like device law of its own
(:mod:`refspec.energy.meters.device_law`) on the roofline's modelled clock.
"""
from __future__ import annotations

import dataclasses
import math
import random
import statistics
import tempfile
from pathlib import Path
from typing import Callable

from refspec.config import ModelArgs
from refspec.energy.accounting.headline import Accounting, account
from refspec.energy.model.architectures import arch
from refspec.energy.accounting.attribution import Loop
from refspec.energy.ledger.counter_records import counter_ledger
from refspec.energy.meters.device_law import DeviceLaw, gpu_law
from refspec.energy.model.hardware import H200_SXM
from refspec.energy.ledger.writer import Ledger
from refspec.energy.ledger.read import read_ledger
from refspec.energy.accounting.per_request import split_energy
from refspec.energy.model.work import ForwardShape, record_forward
from refspec.energy.ledger.events import MeteredPhase, PhaseEvent
from refspec.energy.model.roofline import work_time_s
from refspec.energy.meters.simulated import SimulatedMeter

TARGET: ModelArgs = arch("llama-3.1-8b")
BATCH, PROMPT, BUDGET, ACCEPT = 16, 256, 128, 0.7
PHASES = ("prefill", "draft", "verify", "commit")
LOOP_S = 5.0
"""Modelled seconds each loop runs (50 counter periods)."""
RUN_S, SETTING_S, SHORT_S = 30.0, 10.0, 6.0
"""Modelled seconds of the main runs, of each counter setting, and of the short run."""
LAW = gpu_law(H200_SXM)


def _verify(rows: int, k: int, context: int) -> ForwardShape:
    return ForwardShape(args=TARGET, rows=rows, tokens_per_row=k + 1, context_tokens=rows * (context + k + 1),
                        dtype_bytes=2)


def _head(rows: int, context: int, width: int = 1) -> ForwardShape:
    """One forward of an EAGLE-1-style head (a decoder layer of the target, fc of 2E -> E, the LM
    head) over ``width`` positions per row (the catch-up of the last step's, or one draft)."""
    fc = 2 * TARGET.hidden_size ** 2
    return ForwardShape(args=TARGET, rows=rows, tokens_per_row=width, context_tokens=rows * (context + width),
                        dtype_bytes=2, layers=1, extra_weight_bytes=2 * fc, extra_flops=2 * fc * rows * width)


def _draft(rows: int, k: int, context: int) -> list[ForwardShape]:
    """The catch-up of the last step's K + 1 positions, then K - 1 head forwards."""
    return [_head(rows, context, k + 1)] + [_head(rows, context + 1 + i) for i in range(k - 1)]


def _prefill(rows: int) -> ForwardShape:
    return ForwardShape(args=TARGET, rows=rows, tokens_per_row=PROMPT, context_tokens=rows * PROMPT, dtype_bytes=2,
                        lm_head_tokens=rows)


class SharedClock:
    """The clock of a time-shared device: each phase lasts its roofline time, and the host-bound
    phases (draft launches, commit) are stretched by loads of their own that drift between regimes
    of 0.5-2 s (other jobs on the host); the law's host gap passes before each phase."""

    def __init__(self, seed: int = 1) -> None:
        self.now_s, self._rng, self._until = 0.0, random.Random(seed), 0.0
        self._load = {"draft": 1.0, "commit": 1.0, "prefill": 1.0}

    def __call__(self) -> float:
        return self.now_s

    def run(self, name: str, work: list[ForwardShape]) -> None:
        """Advance over one phase of ``work`` (inside its meter bracket)."""
        if self.now_s >= self._until:
            self._until = self.now_s + self._rng.uniform(0.5, 2.0)
            self._load = {p: self._rng.uniform(1.0, 3.0) for p in self._load}
        seconds = work_time_s(work, H200_SXM) if work else LAW.bare_s
        self.now_s += seconds * self._load.get(name.rpartition(":")[2], 1.0)


def _phase(meter: SimulatedMeter, name: str, work: list[ForwardShape], shared: SharedClock | None = None
           ) -> MeteredPhase:
    if shared is not None:
        shared.now_s += LAW.gap_s
    with MeteredPhase(meter, name) as ph:
        for shape in work:
            record_forward(shape)
        if shared is not None:
            shared.run(name, work)
    return ph


def serve(meter: SimulatedMeter, ledger: Callable[[PhaseEvent], None], seconds: float,
          k_of: Callable[[int], int], seed: int = 0, shared: SharedClock | None = None) -> list[int]:
    """Play a closed-loop server of ``BATCH`` slots for ``seconds`` of modelled time.

    ``k_of(step)`` is the draft length of each step. Each row accepts each draft with
    probability ``ACCEPT`` until its first rejection; a request leaves at its ``BUDGET`` tokens and
    the next is prefilled into its slot after the step. ``shared``: the meter runs on this clock.
    Returns the rows of each refill.
    """
    rng = random.Random(seed)
    clock, step, next_id = 0.0, 0, BATCH
    slots = list(range(BATCH))
    left = [BUDGET - 1] * BATCH  # the prefill emits each request's first token
    context = [PROMPT] * BATCH

    def phase(name: str, step_: int, work: list[ForwardShape], **counts) -> None:
        nonlocal clock
        ph = _phase(meter, name, work, shared)
        ledger(PhaseEvent(step=step_, phase=name, batch=BATCH, work=ph.work, measurement=ph.measurement,
                          clock_s=clock, **counts))
        clock += ph.measurement.time_s

    refills: list[int] = []
    phase("prefill", -1, [_prefill(BATCH)], rows_active=BATCH, emitted=BATCH, emitted_per_row=(1,) * BATCH,
          slot_requests=tuple(slots), arrivals_s=(0.0,) * BATCH, queued=10 ** 6, row_lengths=(PROMPT,) * BATCH)
    while clock < seconds:
        k, mean_ctx = k_of(step), sum(context) // BATCH
        common = dict(rows_active=BATCH, slot_requests=tuple(slots), queued=10 ** 6, k=k,
                      row_lengths=tuple(c + k + 1 for c in context))
        phase("draft", step, _draft(BATCH, k, mean_ctx), drafted=BATCH * k, **common)
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
                slots[row], new[row], left[row], context[row] = next_id, next_id, BUDGET - 1, PROMPT
                next_id += 1
            refills.append(len(done))
            phase("prefill", step, [_prefill(len(done))], rows_active=len(done), emitted=len(done),
                  emitted_per_row=tuple(int(n >= 0) for n in new), slot_requests=tuple(new),
                  arrivals_s=tuple(clock if n >= 0 else -1.0 for n in new), queued=10 ** 6,
                  row_lengths=tuple(PROMPT if n >= 0 else 0 for n in new))
        step += 1
    return refills


def loops(meter: SimulatedMeter, seconds: float, context: int, k: int, refill: int,
          shared: SharedClock | None = None) -> dict[str, Loop]:
    """Each phase alone, and the whole step, repeated for ``seconds`` of modelled time at the
    run's shapes (``refill``: its median refill group), read by the counter at each loop's bounds only."""
    rows = {"prefill": refill}  # refills differ in rows: that loop is priced per row
    calls: dict[str, list[tuple[str, list[ForwardShape]]]] = {
        "prefill": [("prefill", [_prefill(rows["prefill"])])], "draft": [("draft", _draft(BATCH, k, context))],
        "verify": [("verify", [_verify(BATCH, k, context)])], "commit": [("commit", [])]}
    calls["step"] = calls["draft"] + calls["verify"] + calls["commit"]
    out = {}
    for name, body in calls.items():
        start, n, times = meter.counter.read(), 0, dict.fromkeys(p for p, _ in body)
        while meter.counter.read().wall_s - start.wall_s < seconds:
            for phase, work in body:
                ph = _phase(meter, f"loop:{phase}", work, shared)
                times[phase] = (times[phase] or 0.0) + ph.measurement.time_s
            n += 1
        end = meter.counter.read()
        out[name] = Loop(energy_j=end.energy_j - start.energy_j, time_s=end.wall_s - start.wall_s, iterations=n,
                         rows=rows.get(name), phase_time_s=times if name == "step" else None)
    return out


def run(directory: Path, name: str, *, period_ms: float, sample_ms: float, seconds: float,
        k_of: Callable[[int], int], loop_s: float | None = None, law: DeviceLaw = LAW,
        shared: SharedClock | None = None) -> tuple[Accounting, list]:
    """One server run under a simulated counter, written to a ledger; its accounting and records
    (on the modelled clock, or on ``shared`` with the law's power independent of the stretch)."""
    clock = dict(time_source="model") if shared is None else dict(time_source="wall_time", clock=shared)
    law = law if shared is None else dataclasses.replace(law, busy=0.0)
    meter = SimulatedMeter(H200_SXM, period_s=period_ms / 1e3, sample_s=sample_ms / 1e3, law=law, offset_s=0.0,
                           **clock)  # type: ignore[arg-type]
    path = directory / f"{name}.jsonl"
    with counter_ledger(meter, Ledger(path, run_id=name, meter_source=meter.source, idle_w=meter.idle_w)) as led:
        refills = serve(meter, led, seconds, k_of, shared=shared)
        if loop_s is not None:
            led.end_run()  # the server's end read and end record; the loops run after it
            measured = loops(meter, loop_s, PROMPT + BUDGET // 2, k_of(0), statistics.median(refills), shared)
            meter.abandon_run()  # the loops' own reads are theirs, not the run's
            for phase_name, loop in measured.items():
                led.ledger.write_loop(phase_name, loop, meter.source)
    records = read_ledger(path, strict=True)
    return account(records, min_window_s=20.0), records


def _row(name: str, shares: dict[str, float] | None) -> str:
    return f"{name:<22}" + "".join(f"{'n/a' if shares is None else f'{100 * shares.get(p, 0.0):.1f}%':>10}"
                                    for p in PHASES)


def table(acc: Accounting) -> str:
    """True, naive and attributed phase shares of one run (of the phases' energy), and its checks."""
    a = acc.attribution or {}
    used = acc.phase_energy_method not in (None, "measured-total-only")
    lines = [f"{'':<22}" + "".join(f"{p:>10}" for p in PHASES), _row("true (simulated)", acc.phase_share_true),
             _row("naive per-phase read", acc.phase_share_naive),
             _row("fit", a.get("fit_share") if a.get("fit_determined") else None)]
    if a.get("loops_share") is not None:
        lines.append(_row("loops", a["loops_share"]))
    lines.append(_row(f"used ({acc.phase_energy_method})", acc.phase_share if used else None))
    se = max((a.get("fit_share_se") or {}).values(), default=math.nan)
    if a.get("fit_condition") is None:
        lines.append(f"sub-windows {a['sub_windows']}: too few to fit a power per phase")
    else:
        fit = "determined" if a.get("fit_determined") else "undetermined"
        lines.append(f"sub-windows {a['sub_windows']}, fit {fit} (largest share s.e. {100 * se:.3g} percentage "
                     f"points, condition {a['fit_condition']:.2g})")
    lines.append(f"counter total {acc.total_energy_j:.1f} J vs true {a['true_total_j']:.1f} J "
                 f"({100 * a['total_error_vs_true']:+.2f}%); host time {a['host_s']:.3g} s at idle "
                 f"{acc.idle_w:g} W = {a['host_j']:.1f} J; unattributed {acc.unattributed_energy_j:.1f} J "
                 f"({100 * acc.unattributed_energy_j / acc.total_energy_j:.1f}% of the total, outside the shares)")
    if a.get("loops_share") is not None:
        agree = f"agreement with the fit {a['agreement']:.3f}; " if a.get("agreement") is not None else ""
        lines.append(f"loops: {agree}additivity residual {100 * a['additivity_residual']:+.2f}%, interaction "
                     f"residual {_pct(a.get('interaction_residual'))}"
                     + (f" (up to {a['interaction_points']:.1f} points of share)" if a.get("interaction_points") is not None
                        else ""))
    gate = a.get("split_gate") or {}
    lines.append("split gate: passed" if gate.get("passed") else
                 "split gate: FAILED, total only: " + "; ".join(gate.get("reasons") or []))
    lines.append(f"window {'valid' if acc.window_valid else 'INVALID: ' + str(acc.window_invalid_reason)}, "
                 f"J/token {acc.window_j_per_token:.4f} (window), {acc.j_per_token:.4f} (run)")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.2f}%"


def settings(directory: Path) -> str:
    """The naive per-phase read against the truth at three counter settings (P ms period, S ms sampled)."""
    lines = [f"{'P/S ms':<8}{'phase':<9}{'true':>8}{'naive':>8}{'naive off by':>14}   counter total vs true"]
    for period, sample in ((100, 25), (50, 50), (20, 20)):
        acc, _ = run(directory, f"p{period}s{sample}", period_ms=period, sample_ms=sample, seconds=SETTING_S,
                     k_of=lambda s: 4)
        a = acc.attribution or {}
        for i, p in enumerate(PHASES):
            true, naive = acc.phase_share_true[p], acc.phase_share_naive[p]
            tail = f"   {100 * a['total_error_vs_true']:+.2f}%" if i == 0 else ""
            lines.append(f"{f'{period}/{sample}' if i == 0 else '':<8}{p:<9}{100 * true:>7.1f}%{100 * naive:>7.1f}%"
                         f"{100 * (naive / true - 1):>+13.0f}%{tail}")
    return "\n".join(lines)


def per_request(records: list) -> str:
    """The per-request split of a run: requests and the named items as shares of the measured total."""
    split = split_energy(records, [records[0]["run_id"]], H200_SXM)
    assert split is not None
    parts = ", ".join(f"{name.replace('_', ' ')} {100 * x:.2f}%" for name, x in split.shares.items())
    return (f"{len(split.requests)} requests ({split.method}); of the measured {split.total_j:.1f} J: {parts}\n"
            f"closure: requests + named items - total = {split.closure_error_j:+.1f} J "
            f"({100 * split.closure_error_j / split.total_j:+.2f}%, allowed {100 * split.tolerance:g}%) -> "
            f"{'closes' if split.closes else 'DOES NOT CLOSE'}")


def blocks() -> dict[str, str]:
    """Every block the tutorial quotes, by name."""
    out = {"setup": (f"target llama-3.1-8b on {H200_SXM.name} (modelled clock), batch {BATCH}, prompts {PROMPT} "
                     f"tokens, budgets {BUDGET} tokens, per-draft acceptance {ACCEPT}; runs of {RUN_S:g} s, "
                     f"loops of {LOOP_S:g} s\ndevice law: idle {LAW.idle_w:g} W, host {LAW.host_w:g} W, active "
                     f"{LAW.active_w:g} W, power rising in {LAW.rise_s * 1e3:g} ms and falling in "
                     f"{LAW.lag_s * 1e3:g} ms\ncounter: period 100 ms, sampled 25 ms of each; sub-windows of at "
                     f"least 10 periods")}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        fixed, records = run(d, "fixed", period_ms=100, sample_ms=25, seconds=RUN_S, k_of=lambda s: 4, loop_s=LOOP_S)
        out["fixed"] = table(fixed)
        out["requests"] = per_request(records)
        # a policy that changes K with the load: 2 or 6 drafts, each for 300 steps
        out["varied"] = table(run(d, "varied", period_ms=100, sample_ms=25, seconds=RUN_S,
                                  k_of=lambda s: (2, 6)[(s // 300) % 2])[0])
        # a time-shared host stretches the host-bound phases unevenly; a fine, fully sampled counter; a steady
        # temperature: each phase's power stays put while the proportions drift
        steady = dataclasses.replace(LAW, warm_w=0.0)
        out["shared"] = table(run(d, "shared", period_ms=10, sample_ms=10, seconds=RUN_S, k_of=lambda s: 4,
                                  loop_s=LOOP_S, law=steady, shared=SharedClock())[0])
        out["settings"] = settings(d)
        out["slow"] = table(run(d, "slow", period_ms=2000, sample_ms=500, seconds=RUN_S, k_of=lambda s: 4,
                                loop_s=LOOP_S)[0])
        lagging = dataclasses.replace(LAW, lag_s=20e-3)
        out["lag"] = table(run(d, "lag", period_ms=100, sample_ms=25, seconds=RUN_S, k_of=lambda s: 4,
                               loop_s=LOOP_S, law=lagging)[0])
        out["short"] = table(run(d, "short", period_ms=100, sample_ms=25, seconds=SHORT_S, k_of=lambda s: 4)[0])
    return out


def main() -> None:
    for name, text in blocks().items():
        print(f"== {name} ==\n{text}\n")


if __name__ == "__main__":
    main()
