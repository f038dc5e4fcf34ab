"""The paper's grid: what runs, in which order, and how long it is planned to take.

A **block** is one target architecture (random weights of its real shapes) at some batches x
drafters. A **shape** is one (batch, drafter) of a block: its graphs are captured and its
phase loops run once. A **variant** is one acceptance level x corpus served at that shape
(:mod:`refspec.eval.paper.acceptance`); plain decoding has one variant. Each variant is served
``repeats`` times, each a ledger run of its own whose steady-state window is long enough for
the counter (:class:`Windows`).

Blocks run in order of importance and shapes batch by batch (1, then the largest, then the
middle one), so a run cut by ``--budget-s`` still answers claims 1-6 on the first family.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from refspec.energy.accounting.split_gate import GATE, STEP_LOOP_SPANS

NONE_SOURCE = "-"
"""The source of plain decoding's one variant (nothing injected)."""


@dataclasses.dataclass(frozen=True)
class DrafterSpec:
    """``none`` (K = 0), an EAGLE-shaped chain head (``eagle``) or a block head (``block``)."""

    name: str
    k: int

    def __post_init__(self) -> None:
        if self.name not in ("none", "eagle", "block") or (self.k == 0) != (self.name == "none") or self.k < 0:
            raise ValueError(f"a drafter is none:0, eagle:K or block:K with K >= 1, got {self.name}:{self.k}")

    @property
    def label(self) -> str:
        return "none" if self.name == "none" else f"{self.name} k{self.k}"


NONE, EAGLE3, BLOCK16 = DrafterSpec("none", 0), DrafterSpec("eagle", 3), DrafterSpec("block", 16)


@dataclasses.dataclass(frozen=True)
class Block:
    """One target's shapes and the acceptance they are served at.

    Attributes:
        name: label in results and tables.
        arch: an architecture of :data:`refspec.energy.model.architectures.ARCHS`.
        batches: serving batches, in run order.
        drafters: drafter configurations, in run order.
        corpora: corpora whose acceptance is injected.
        sources: acceptance levels served at every batch.
        small_batches: batches that also serve the ``small`` level (when it is not in ``sources``).
        answers: what the block is for.
        leave_out: (batch, drafter name) shapes not run (the budget's cuts, planned).
    """

    name: str
    arch: str
    batches: tuple[int, ...]
    drafters: tuple[DrafterSpec, ...]
    corpora: tuple[str, ...]
    sources: tuple[str, ...]
    small_batches: tuple[int, ...] = ()
    answers: str = ""
    leave_out: tuple[tuple[int, str], ...] = ()

    def shapes(self) -> list[tuple[int, DrafterSpec]]:
        return [(b, d) for b in self.batches for d in self.drafters if (b, d.name) not in self.leave_out]

    def variants(self, batch: int, spec: DrafterSpec) -> list[tuple[str, str]]:
        """(source, corpus) pairs served at one shape; plain decoding serves one, corpus-free."""
        if not spec.k:
            return [(NONE_SOURCE, self.corpora[0])]
        sources = list(self.sources) + (["small"] if batch in self.small_batches and "small" not in self.sources
                                        else [])
        return [(s, c) for s in sources for c in self.corpora]


GRID = (
    Block("core", "llama-3.1-8b", (1, 64, 16), (NONE, EAGLE3, BLOCK16), ("conversation",), ("published",),
          small_batches=(64,), answers="claims 1-6 on a grouped-query target", leave_out=((16, "eagle"),)),
    Block("family2", "qwen3-8b", (1, 64), (NONE, BLOCK16), ("conversation",), ("published",),
          answers="claims 1, 4, 5 on a second attention family (QK-norm)", leave_out=((1, "block"),)),
)
"""The grid, the same on a GPU (real shapes) and a CPU (toy forwards priced at the real shapes)."""
QUICK_GRID = (
    Block("core", "llama-3.1-8b", (1, 4), (NONE, EAGLE3, BLOCK16), ("conversation",), ("published",),
          small_batches=(1,), answers="claims 1-6 (quick)"),
    Block("family2", "qwen3-8b", (1,), (NONE, BLOCK16), ("conversation",), ("published",),
          answers="a second attention family (quick)"),
)
"""A short grid for CI's rehearsal (``--quick``)."""


def select(args: Any) -> list[Block]:
    """The blocks of this run: ``--quick``, ``--blocks``, ``--batches``, ``--corpora``, ``--sources``."""
    blocks = list(QUICK_GRID if args.quick else GRID)
    if args.blocks:
        names = [n for n in args.blocks.split(",") if n]
        unknown = sorted(set(names) - {b.name for b in blocks})
        if unknown:
            raise ValueError(f"--blocks: unknown {unknown}; choose from {[b.name for b in blocks]}")
        blocks = [b for b in blocks if b.name in names]
    changes: dict[str, Any] = {}
    if args.batches:
        changes["batches"] = tuple(args.batches)
    if args.corpora:
        changes["corpora"] = tuple(c for c in args.corpora.split(",") if c)
    if args.sources:
        changes["sources"] = tuple(s for s in args.sources.split(",") if s)
    return [dataclasses.replace(b, **changes) for b in blocks]


# ---- windows the counter can bear ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Windows:
    """How long the counter must be watched, in its own periods and seconds.

    Attributes:
        period_s: the counter's update period P (measured at start on a GPU).
        window_s: shortest steady-state window: max(``min_window_s``, 50 P).
        loop_s: shortest phase loop: the split gate's floor, max(10 P, 1 s)
            (:data:`refspec.energy.accounting.split_gate.GATE`).
        sub_window_s: shortest sub-window between counter reads: 10 P.
    """

    period_s: float
    window_s: float
    loop_s: float
    sub_window_s: float

    @classmethod
    def for_period(cls, period_s: float, min_window_s: float) -> "Windows":
        return cls(period_s=period_s, window_s=max(min_window_s, 50 * period_s), loop_s=GATE.floor_s(period_s),
                   sub_window_s=10 * period_s)


# ---- the plan -----------------------------------------------------------------------------------
HOST_S_PER_STEP = 2.0e-3  # assumed: engine Python per decode step on a GPU (accept, commit, bookkeeping)
HOST_S_PER_HEAD_FORWARD = 0.6e-3  # assumed: one eager drafter-head forward's launches
WARM_S_PER_SHAPE = 1.5  # assumed: the warm-up run and its graph captures
LOOP_OVERHEAD_S = 0.4  # assumed: a loop's set-up (decoding to the run's keys) and first call
LOOP_MARGIN = 1.1  # each loop asks for this multiple of the gate's floor
ALIGN_PERIODS = 2.5  # a loop awaits an update (half a period on average), runs one past its length, sees two after
WINDOW_MARGIN = 1.1  # streams are sized for this multiple of the shortest window
FIXED_GPU_S = {"install (shell)": 30.0, "start, idle power, counter period, ceilings": 15.0, "plots and tables": 5.0}
"""Planned seconds outside the blocks; a target build is planned per block (:data:`BUILD_S`)."""
BUILD_S = 8.0  # assumed: a random-weight 8B target built in place on the GPU


def drafter_model(spec: DrafterSpec) -> Any:
    """The roofline's cost model of a drafter configuration (None for ``none``)."""
    from refspec.energy.model.roofline import EAGLE_HEAD, DrafterModel

    if spec.name == "none":
        return None
    return EAGLE_HEAD if spec.name == "eagle" else DrafterModel(name="block", layers=1, fc_inputs=3, parallel=True)


def step_seconds(arch: str, profile: Any, spec: DrafterSpec, batch: int, tau: float, context: int,
                 host: bool) -> float:
    """Planned seconds of one decode step: the roofline's, plus the host's on a GPU."""
    from refspec.energy.model.roofline import predict_step
    from refspec.eval.acceptance_models import acceptance_from_tau
    from refspec.models.random_models import arch_args

    pred = predict_step(arch_args(arch), profile, batch=batch, k=spec.k, context=context,
                        acceptance=acceptance_from_tau(tau, spec.k), drafter=drafter_model(spec))
    heads = spec.k if spec.name == "eagle" else int(spec.name == "block")
    return pred.step_time_s + (HOST_S_PER_STEP + heads * HOST_S_PER_HEAD_FORWARD if host else 0.0)


@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """A served run sized for its window.

    Attributes:
        requests: requests in the stream (closed loop on B slots).
        steps: planned decode steps of the whole run (window, ramp and drain).
        seconds: planned seconds of the run (decode steps and prefills).
    """

    requests: int
    steps: int
    seconds: float


def plan_stream(*, batch: int, tau: float, step_s: float, prefill_s: float, window_s: float, new_tokens: int
                ) -> StreamPlan:
    """Requests so that every slot stays busy for ``WINDOW_MARGIN x window_s``.

    A request of mean budget N lasts N / tau steps; the steady state ends when the queue is
    empty and the first slot frees, and the drain after it lasts up to the longest budget.
    """
    per_request_steps = new_tokens / tau
    window_steps = math.ceil(WINDOW_MARGIN * window_s / step_s)
    requests = batch * (math.ceil(window_steps / per_request_steps) + 1)
    steps = math.ceil(requests * per_request_steps / batch + 0.5 * per_request_steps)
    return StreamPlan(requests=requests, steps=steps, seconds=steps * step_s + requests * prefill_s)


def plan_block(block: Block, profile: Any, taus: dict[tuple[str, str, str], float], *, windows: Windows,
               repeats: int, prompt_len: int, new_tokens: int, host: bool) -> dict[str, Any]:
    """Planned seconds of a block's shapes on ``profile`` (variants x repeats, loops, warm-up).

    Args:
        taus: (source, drafter kind, corpus) -> mean tau at the grid's K.
        host: add the assumed host costs (a GPU run); a modelled clock has none.
    """
    from refspec.energy.model.work import ForwardShape
    from refspec.energy.model.roofline import forward_cost
    from refspec.models.random_models import arch_args

    args = arch_args(block.arch)
    context = prompt_len + new_tokens // 2
    prefill_s = profile.time_s(forward_cost(ForwardShape(args=args, rows=1, tokens_per_row=prompt_len,
                                                         context_tokens=prompt_len, dtype_bytes=2)))
    shapes = []
    for batch, spec in block.shapes():
        runs = []
        for source, corpus in block.variants(batch, spec):
            tau = taus.get((source, spec.name, corpus), 1.0) if spec.k else 1.0
            step = step_seconds(block.arch, profile, spec, batch, tau, context, host)
            sp = plan_stream(batch=batch, tau=tau, step_s=step, prefill_s=prefill_s, window_s=windows.window_s,
                             new_tokens=new_tokens)
            runs.append({"source": source, "corpus": corpus, "tau": tau, "step_s": step, **dataclasses.asdict(sp),
                         "planned_s": repeats * sp.seconds})
        loops = 5  # draft (an empty one without a drafter), verify, commit, prefill, the whole step
        lengths = loops - 1 + STEP_LOOP_SPANS  # the step loop runs several loop lengths
        loop_s = (lengths * LOOP_MARGIN * max(windows.loop_s, 0.0)
                  + loops * (LOOP_OVERHEAD_S + ALIGN_PERIODS * windows.period_s))
        total = WARM_S_PER_SHAPE + loop_s + sum(r["planned_s"] for r in runs)
        shapes.append({"batch": batch, "drafter": spec.label, "variants": runs, "loops_s": loop_s,
                       "planned_s": total})
    return {"block": block.name, "arch": block.arch, "answers": block.answers, "shapes": shapes,
            "planned_s": BUILD_S + sum(s["planned_s"] for s in shapes), "profile": profile.name}


def format_plan(plans: Sequence[dict[str, Any]], fixed_s: dict[str, float]) -> str:
    """The plan as printed before the run: fixed stages, one line per block, the total."""
    rows = [f"{'stage':<46} {'planned s':>9}  what"]
    rows += [f"{name:<46} {s:>9.0f}" for name, s in fixed_s.items()]
    for p in plans:
        n = sum(len(s["variants"]) for s in p["shapes"])
        rows.append(f"{'block ' + p['block'] + ' (' + p['arch'] + ')':<46} {p['planned_s']:>9.0f}  "
                    f"{len(p['shapes'])} shapes, {n} variants; {p['answers']}")
    total = sum(fixed_s.values()) + sum(p["planned_s"] for p in plans)
    rows.append(f"{'total':<46} {total:>9.0f}  (host {HOST_S_PER_STEP * 1e3:.1f} ms/step, "
                f"{HOST_S_PER_HEAD_FORWARD * 1e3:.1f} ms per eager head forward, assumed)")
    return "\n".join(rows)


__all__ = ["DrafterSpec", "Block", "GRID", "QUICK_GRID", "Windows", "StreamPlan", "plan_stream", "plan_block",
           "format_plan", "select", "step_seconds", "NONE_SOURCE", "FIXED_GPU_S"]
