"""The paper's grid as blocks of points, in the order a short GPU window should answer them, and
the seconds each block is planned to take (from the roofline, before anything runs).

A block is one target architecture at some batches x drafter configurations x corpora. The
first block answers claims 1-6 of the paper on the Llama shape; later ones add batches for the
crossover, graphs against eager, a second attention family, and (where the MoE target exists)
a mixture-of-experts shape, which runs after the GPU tests (optional, lowest priority).
``--budget-s`` stops starting points once the plan says the next one would overrun, so a
cut-short run still holds the most important answers.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
from typing import Any, Sequence


@dataclasses.dataclass(frozen=True)
class DrafterSpec:
    """One drafter configuration: ``none`` (k = 0), an EAGLE-shaped chain head, or a block head."""

    name: str  # "none", "eagle" or "block"
    k: int

    def __post_init__(self) -> None:
        if self.name not in ("none", "eagle", "block") or (self.k == 0) != (self.name == "none") or self.k < 0:
            raise ValueError(f"a drafter is none:0, eagle:K or block:K with K >= 1, got {self.name}:{self.k}")

    @property
    def label(self) -> str:
        return {"none": "none", "eagle": f"eagle k{self.k}", "block": f"block {self.k}"}[self.name]


@dataclasses.dataclass(frozen=True)
class Block:
    """Points of one target: every batch x drafter x corpus.

    Attributes:
        name: label in the results and tables.
        arch: architecture of ``refspec.energy.architectures.ARCHS`` (random weights).
        batches: serving batch sizes.
        drafters: drafter configurations.
        corpora: corpora whose recorded acceptance is injected (``none`` runs once, corpus-free).
        answers: what the block is for (printed in the plan).
        phase_loops: measure the phase-isolated loops at its points.
        eager: also run each point through runners without graph capture.
        needs: a module that must exist (an optional target), else the block is skipped.
    """

    name: str
    arch: str
    batches: tuple[int, ...]
    drafters: tuple[DrafterSpec, ...]
    corpora: tuple[str, ...]
    answers: str
    phase_loops: bool = True
    eager: bool = False
    needs: str | None = None

    def points(self) -> list[tuple[int, DrafterSpec, str]]:
        """(batch, drafter, corpus) in run order: batch, then corpus, then drafter."""
        out = []
        for b in self.batches:
            for i, c in enumerate(self.corpora):
                out += [(b, d, c) for d in self.drafters if d.name != "none" or i == 0]
        return out

    def available(self) -> bool:
        """Its optional module exists and its architecture is known."""
        from refspec.energy.architectures import ARCHS

        return (self.needs is None or importlib.util.find_spec(self.needs) is not None) and self.arch in ARCHS


def parse_drafters(text: str) -> tuple[DrafterSpec, ...]:
    """``none:0,eagle:3,block:8`` -> drafter specs."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, k = item.partition(":")
        try:
            out.append(DrafterSpec(name, int(k or 0)))
        except ValueError as exc:
            raise ValueError(f"--drafters {item!r}: {exc}") from None
    return tuple(out)


NONE, EAGLE3, EAGLE7, BLOCK8, BLOCK16 = (DrafterSpec("none", 0), DrafterSpec("eagle", 3), DrafterSpec("eagle", 7),
                                         DrafterSpec("block", 8), DrafterSpec("block", 16))
ALL = (NONE, EAGLE3, EAGLE7, BLOCK8, BLOCK16)
CORPORA = ("conversation", "code")

GPU_BLOCKS = (
    Block("core", "llama-3.1-8b", (1, 16, 64), ALL, CORPORA, "claims 1-6 on a grouped-query dense target"),
    Block("crossover", "llama-3.1-8b", (8, 32), ALL, ("conversation",), "batches between, for the measured crossover",
          phase_loops=False),
    Block("graphs-vs-eager", "llama-3.1-8b", (1, 16), (NONE, EAGLE3, BLOCK8), ("conversation",),
          "what CUDA graphs save: the same points without capture", phase_loops=False, eager=True),
    Block("family2", "qwen3-8b", (1, 16, 64), (NONE, EAGLE3, BLOCK16), ("conversation",),
          "claims 1-3 on a second attention family (QK-norm)"),
    Block("moe", "qwen3-30b-a3b", (1, 16, 64), (NONE, EAGLE3, BLOCK16), ("conversation",),
          "a mixture-of-experts target (optional)", phase_loops=False, needs="refspec.models.moe"),
)
DRY_BLOCKS = (
    Block("core", "llama-3.1-8b", (1, 4), (NONE, EAGLE3, BLOCK8), CORPORA, "claims 1-6 (toy)"),
    Block("crossover", "llama-3.1-8b", (2,), (NONE, BLOCK8), ("conversation",), "crossover (toy)", phase_loops=False),
    Block("graphs-vs-eager", "llama-3.1-8b", (1,), (NONE, EAGLE3), ("conversation",), "graphs vs eager (toy)",
          phase_loops=False, eager=True),
    Block("family2", "qwen3-8b", (1, 4), (NONE, BLOCK8), ("conversation",), "second family (toy)", phase_loops=False),
    Block("moe", "qwen3-30b-a3b", (1,), (NONE, EAGLE3), ("conversation",), "MoE (toy, optional)", phase_loops=False,
          needs="refspec.models.moe"),
)


def select_blocks(args: Any) -> list[Block]:
    """The blocks of this run, with ``--blocks``, ``--batches``, ``--drafters``, ``--corpora`` applied."""
    blocks = list(DRY_BLOCKS if args.dry_run else GPU_BLOCKS)
    if args.blocks:
        names = [n for n in args.blocks.split(",") if n]
        unknown = sorted(set(names) - {b.name for b in blocks})
        if unknown:
            raise ValueError(f"--blocks: unknown {unknown}; choose from {[b.name for b in blocks]}")
        blocks = [b for b in blocks if b.name in names]
    changes: dict[str, Any] = {}
    if args.batches:
        changes["batches"] = tuple(args.batches)
    if args.drafters:
        changes["drafters"] = parse_drafters(args.drafters)
    if args.corpora:
        changes["corpora"] = tuple(c for c in args.corpora.split(",") if c)
    return [dataclasses.replace(b, **changes) for b in blocks]


# ---- the plan: seconds per point from the roofline ------------------------------------------
HOST_S_PER_STEP = 1.5e-3  # assumed: the engine's Python per decode step (accept, commit, bookkeeping)
HOST_S_PER_HEAD_FORWARD = 0.5e-3  # assumed: one eager drafter-head forward's launches
CAPTURE_S = 0.1  # assumed: one CUDA graph capture of a target forward
LOOP_OVERHEAD_S = 0.3  # warm-up call and sub-window bookkeeping of one phase loop


def per_token_acceptance(tau: float, k: int) -> float:
    """The per-draft acceptance a whose (1 - a^(k+1)) / (1 - a) equals ``tau`` (bisection)."""
    from refspec.energy.roofline import expected_tokens_per_step

    tau = min(max(tau, 1.0), k + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_step(mid, k) < tau else (lo, mid)
    return (lo + hi) / 2


def drafter_model(spec: DrafterSpec) -> Any:
    """The roofline's cost model of a drafter configuration (None for ``none``)."""
    from refspec.energy.roofline import DrafterModel, EAGLE_HEAD

    return None if spec.name == "none" else EAGLE_HEAD if spec.name == "eagle" else DrafterModel(
        name="block", layers=1, fc_inputs=2, parallel=True)


def point_seconds(args_model: Any, profile: Any, *, batch: int, spec: DrafterSpec, tau: float, prompt_len: int,
                  new_tokens: int, runs: float, loops: int, loop_s: float) -> float:
    """Planned seconds of one point: ``runs`` generations, graph captures, ``loops`` phase loops."""
    from refspec.energy.roofline import ForwardShape, forward_cost, predict_step

    step = predict_step(args_model, profile, batch=batch, k=spec.k, context=prompt_len + new_tokens // 2,
                        acceptance=per_token_acceptance(tau, spec.k) if spec.k else 0.0,
                        drafter=drafter_model(spec))
    heads = 0 if spec.name == "none" else spec.k if spec.name == "eagle" else 1
    steps = math.ceil(new_tokens / step.tokens_per_row)
    prefill = profile.time_s(forward_cost(ForwardShape(args=args_model, rows=batch, tokens_per_row=prompt_len,
                                                       context_tokens=batch * prompt_len, dtype_bytes=2)))
    run = prefill + steps * (step.step_time_s + HOST_S_PER_STEP + heads * HOST_S_PER_HEAD_FORWARD)
    captures = math.ceil((new_tokens + spec.k + 1) / 128) + 1
    return runs * run + captures * CAPTURE_S + loops * (loop_s + LOOP_OVERHEAD_S)


def runs_per_point(batch: int, warm_up: bool, eager: bool, serve: bool) -> float:
    """Generations of one point in units of one static run of B rows x N tokens.

    Continuous: a stream of max(4, 3B/2) requests of mean budget N on B slots (R/B runs) after a
    static warm-up at the longest budget 3N/2; static: the measured run after a warm-up of N;
    an eager comparison adds a static graph run (under continuous) and the eager run.
    """
    if serve:
        return max(4, (3 * batch + 1) // 2) / batch + 1.5 * warm_up + 2.0 * eager
    return 1.0 + warm_up + 1.0 * eager


def plan_block(block: Block, profile: Any, taus: dict[tuple[str, str], float], *, prompt_len: int, new_tokens: int,
               loop_s: float, dry: bool, serve: bool = True) -> dict[str, Any]:
    """Planned seconds of every point of a block (for a dry run: of the same block at GPU size).

    Warm-ups run once per (batch, drafter) (the second corpus reuses the captured graphs), phase
    loops once per shape (prefill per batch, verify per width, draft per drafter and k), an
    eager point once more (:func:`runs_per_point`).
    """
    from refspec.models.random_models import arch_args

    model = arch_args(block.arch)
    points, warmed, shapes = [], set(), set()
    for batch, spec, corpus in block.points():
        runs = runs_per_point(batch, (batch, spec) not in warmed and not block.eager, block.eager, serve)
        warmed.add((batch, spec))
        new = {("prefill", batch), ("verify", batch, spec.k + 1)} | (
            {("draft", batch, spec.name, spec.k)} if spec.k else set())
        loops = len(new - shapes) if block.phase_loops else 0
        shapes |= new
        tau = taus.get((spec.name, corpus), 1.0) if spec.k else 1.0
        s = point_seconds(model, profile, batch=batch, spec=spec, tau=tau, prompt_len=prompt_len,
                          new_tokens=new_tokens, runs=runs, loops=loops, loop_s=loop_s)
        points.append({"batch": batch, "drafter": spec.label, "corpus": corpus, "planned_s": s})
    return {"block": block.name, "arch": block.arch, "answers": block.answers, "points": points,
            "planned_s": sum(p["planned_s"] for p in points), "profile": profile.name,
            "assumptions": f"host {HOST_S_PER_STEP * 1e3:.1f} ms/step, {HOST_S_PER_HEAD_FORWARD * 1e3:.1f} ms per "
                           f"eager head forward, {CAPTURE_S:.2f} s per graph capture" + (
                               "; planned at GPU size for the H200 profile (dry run)" if dry else "")}


def format_plan(plans: Sequence[dict[str, Any]], fixed_s: dict[str, float]) -> str:
    """The plan as printed before the run: fixed stages, then one line per block and a total."""
    rows = [f"{'stage':<18} {'planned s':>9}  what"]
    rows += [f"{name:<18} {s:>9.0f}" for name, s in fixed_s.items()]
    for p in plans:
        rows.append(f"{p['block']:<18} {p['planned_s']:>9.0f}  {p['arch']}: {len(p['points'])} points; {p['answers']}")
    total = sum(fixed_s.values()) + sum(p["planned_s"] for p in plans)
    rows.append(f"{'total':<18} {total:>9.0f}  ({plans[0]['assumptions'] if plans else ''})")
    return "\n".join(rows)
