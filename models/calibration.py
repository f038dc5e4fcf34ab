"""Which GEMM form each CPU product takes, chosen by timing the candidates on this machine.

CPUs differ in what they multiply fast: one emulates bf16 products and gains from fp32 copies
of the weights, another has bf16 matrix units and loses by them; one streams a column-major
matrix faster for a single row, another does not. So no path is chosen by CPU model: the first
load on a machine times every candidate form for the shapes decoding uses (one row, a few rows
for verification and small batches, many rows for prefill and large batches) in each dtype,
keeps the fastest, and caches the choice under ``$REFSPEC_HOME/calibration`` keyed by the CPU's
model name and flags, the torch version and the thread count. A change of any of them
recalibrates.

The forms are timed in interleaved rounds (every bucket and form once per round); when the
rounds' totals differ by more than :data:`BUSY_SPREAD` another job was competing for the
machine and the choice cannot be trusted: it is refused, not cached, the products take the
reference form, and a warning names the command that redoes it
(``python -m refspec.eval calibrate --force``, which also prints the timings).

The forms (:mod:`refspec.models.gemm_forms`): ``linear`` (``F.linear``, the reference), ``nodnn``,
``wxt``, ``column``, ``fp32`` and ``packed``.

The ``fp32`` form is a candidate for several rows only, so one-row products always stream the
model's dtype. A model keeps at most one kind of copy: the plan drops the copy whose saving is
smaller when the fastest forms would need two. The plan also records what verifying extra
positions costs: the time of a product of 1 to 128 rows in the chosen forms
(:meth:`GemmPlan.product_cost`, and its 5-row over 1-row ratio,
:meth:`GemmPlan.extra_position_cost`), from which the n-gram drafter picks its defaults.

``REFSPEC_GEMM_PLAN`` selects the plan :func:`resolve_plan` returns: ``auto`` (the default: the
cached calibration, or a fresh one) or ``reference`` (``F.linear`` everywhere, no copies).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Callable

import torch

from refspec.models.gemm_forms import COPY_FORMS, DTYPES, FORMS, apply_form, make_copy, packed_supported, row_bucket

log = logging.getLogger(__name__)

PLAN_VERSION = 6
ROUNDS = 3  # timed rounds per calibration, after one warm-up round
BUSY_SPREAD = 0.15
"""Rounds whose totals differ by more than this fraction say the machine was busy: the plan is refused."""
BUCKETS = ("one", "few", "many")
BUCKET_ROWS = {"one": (1,), "few": (2, 5, 16), "many": (40, 200)}
CURVE_ROWS = (1, 2, 4, 5, 8, 16, 32, 64, 128)  # the product-cost curve a drafter reads (GemmPlan.product_cost)
BUCKET_ROWS |= {f"rows{r}": (r,) for r in CURVE_ROWS}
# (out, in) of the products timed: a decoder's q/k/v, MLP up and down projections, repeated
# until they fill WEIGHT_BYTES, well beyond a CPU's caches, as a decode step streams them
SHAPES = ((1728, 576), (3072, 576), (576, 1536))
WEIGHT_BYTES = 64 * 2**20

Timer = Callable[[str, str, str], float]
"""``(dtype name, bucket, form) -> seconds``: how long one form takes for one bucket."""


def bucket_of(rows: int) -> str:
    """The bucket a product of ``rows`` rows belongs to."""
    return BUCKETS[row_bucket(rows)]


def candidate_forms(dtype: str) -> tuple[str, ...]:
    """The forms worth timing for ``dtype`` on this machine."""
    return tuple(f for f in FORMS[dtype] if f != "packed" or packed_supported(DTYPES[dtype]))


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmPlan:
    """The chosen form per dtype and bucket, with the timings it was chosen from.

    Attributes:
        forms: ``{dtype name: {bucket: form}}``.
        timings_s: ``{dtype name: {bucket: {form: seconds}}}`` as measured (or injected).
        machine: the key the plan was measured under (see :func:`machine_key`).
        spread: ``{dtype name: max / min - 1}`` of the timing rounds' totals (:func:`spread`).
    """

    forms: dict[str, dict[str, str]]
    timings_s: dict[str, dict[str, dict[str, float]]]
    machine: dict[str, str]
    spread: dict[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        # {torch dtype: (one, few, many)}: what each linear layer's GemmChoice holds
        table = {DTYPES[d]: tuple(f.get(b, "linear") for b in BUCKETS) for d, f in self.forms.items() if d in DTYPES}
        object.__setattr__(self, "_table", table)
        # {torch dtype: ((rows, seconds), ...)} sorted by rows: what product_cost() interpolates
        curves = {DTYPES[d]: tuple(sorted((int(r), float(t)) for r, t in v["rows"].items()))
                  for d, v in self.timings_s.items() if d in DTYPES and v.get("rows")}
        object.__setattr__(self, "_curves", curves)

    def form(self, dtype: torch.dtype, rows: int) -> str:
        """The form for a product of ``rows`` rows in ``dtype`` (``linear`` when unplanned)."""
        forms = self._table.get(dtype)
        return "linear" if forms is None else forms[row_bucket(rows)]

    def forms_of(self, dtype: torch.dtype) -> tuple[str, str, str] | None:
        """The forms of one row, a few rows and many rows in ``dtype`` (None when unplanned)."""
        return self._table.get(dtype)

    def extra_position_cost(self, dtype: torch.dtype) -> float | None:
        """Time of a product of 5 rows over one of 1 row, both in their chosen forms: what
        verifying 4 drafts costs beside a plain step (None when not calibrated)."""
        one, five = self.product_cost(dtype, 1), self.product_cost(dtype, 5)
        return None if one is None or five is None else five / one

    def product_cost(self, dtype: torch.dtype, rows: int) -> float | None:
        """Measured seconds of one pass over the calibration matrices with ``rows`` rows in the
        chosen forms, interpolated linearly between the measured row counts and proportional to
        ``rows`` beyond the last (None when no curve was measured)."""
        pts = self._curves.get(dtype)
        if not pts:
            return None
        if rows <= pts[0][0]:
            return pts[0][1]
        for (r0, t0), (r1, t1) in zip(pts, pts[1:]):
            if rows <= r1:
                return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
        return pts[-1][1] * rows / pts[-1][0]

    def copy_kind(self, dtype: torch.dtype) -> str | None:
        """The weight copy this dtype's forms need, or None."""
        kinds = {f for f in self.forms.get(dtype_name(dtype), {}).values() if f in COPY_FORMS}
        assert len(kinds) <= 1, f"a plan uses one copy kind per dtype, got {kinds}"
        return kinds.pop() if kinds else None

    def without_copies(self, dtype: torch.dtype) -> "GemmPlan":
        """This plan with ``dtype``'s buckets on their fastest measured copy-free forms (for a
        model whose copies would not fit); unchanged where nothing was measured."""
        name = dtype_name(dtype)
        t = {b: f for b, f in self.timings_s.get(name, {}).items() if b in BUCKETS}
        if set(t) != set(BUCKETS):
            return self
        free = {b: min((f for f in forms if f not in COPY_FORMS), key=forms.get, default="linear")
                for b, forms in t.items()}
        return dataclasses.replace(self, forms=self.forms | {name: free})

    def without(self, dtype: str) -> "GemmPlan":
        """This plan with nothing planned for ``dtype`` (its products take the reference form)."""
        return dataclasses.replace(self, forms={d: f for d, f in self.forms.items() if d != dtype},
                                   timings_s={d: t for d, t in self.timings_s.items() if d != dtype},
                                   spread={d: v for d, v in self.spread.items() if d != dtype})

    def describe(self) -> str:
        """One line: ``fp32 one=column few=wxt many=wxt; bf16 ...``."""
        return "; ".join(f"{d} " + " ".join(f"{b}={f[b]}" for b in BUCKETS) for d, f in self.forms.items())

    def to_json(self) -> dict:
        return {"version": PLAN_VERSION, "forms": self.forms, "timings_s": self.timings_s, "machine": self.machine,
                "spread": self.spread}


REFERENCE = GemmPlan(forms={}, timings_s={}, machine={})
"""No calibration: ``F.linear`` everywhere and no weight copies."""


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}.get(dtype, str(dtype))


def _cpu_fields() -> tuple[str, str]:
    """The CPU's model name and flags line (from Linux ``/proc/cpuinfo``; the platform elsewhere)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return fields.get("model name", platform.processor() or platform.machine()), fields.get("flags", "")


NOTABLE_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_bf16")


def notable_cpu_flags() -> list[str]:
    """The CPU's vector and matrix extensions that decide its fast GEMM paths (for reports)."""
    have = set(_cpu_fields()[1].split())
    return [f for f in NOTABLE_FLAGS if f in have]


def machine_key(threads: int | None = None) -> dict[str, str]:
    """What a plan depends on: CPU model and flags, torch version, thread count."""
    model, flags = _cpu_fields()
    return {"cpu": model, "flags_sha256": hashlib.sha256(flags.encode()).hexdigest()[:16],
            "torch": torch.__version__, "threads": str(threads if threads is not None else torch.get_num_threads())}


def _operands(dtype: str, forms: tuple[str, ...]) -> tuple[list[torch.Tensor], dict[str, list]]:
    """:data:`WEIGHT_BYTES` of random matrices in ``dtype`` and the copies each form reads."""
    dt, gen = DTYPES[dtype], torch.Generator().manual_seed(0)
    per_set = sum(o * i for o, i in SHAPES) * dt.itemsize
    weights = [torch.randn(s, generator=gen).to(dt) for _ in range(-(-WEIGHT_BYTES // per_set)) for s in SHAPES]
    copies = {f: [make_copy(f, w) for w in weights] for f in forms}
    return weights, copies


def measure_rounds(dtype: str, buckets: dict[str, tuple[str, ...]], *, rounds: int = ROUNDS,
                   timer: Timer | None = None) -> list[dict[str, dict[str, float]]]:
    """Seconds one pass over the matrices takes in each bucket and form, summed over the
    bucket's rows, once per round (``timer`` replaces the measurement: tests).

    Every round times every bucket and form once, after one untimed warm-up round, so a burst
    of load on a shared machine shows as a difference between rounds (:func:`spread`)."""
    if timer is not None:
        return [{b: {f: timer(dtype, b, f) for f in forms} for b, forms in buckets.items()} for _ in range(rounds)]
    all_forms = tuple(dict.fromkeys(f for forms in buckets.values() for f in forms))
    weights, copies = _operands(dtype, all_forms)
    gen = torch.Generator().manual_seed(1)
    xs = {r: [torch.randn(r, w.shape[1], generator=gen).to(DTYPES[dtype]) for w in weights]
          for b in buckets for r in BUCKET_ROWS[b]}
    out = []
    for r in range(rounds + 1):  # round 0 warms caches and kernels
        t = {b: dict.fromkeys(forms, 0.0) for b, forms in buckets.items()}
        for b, forms in buckets.items():
            for rows in BUCKET_ROWS[b]:
                for f in forms:
                    start = time.perf_counter()
                    for x, w, c in zip(xs[rows], weights, copies[f]):
                        apply_form(f, x, w, c)
                    t[b][f] += time.perf_counter() - start
        if r:
            out.append(t)
    return out


def spread(rounds: list[dict[str, dict[str, float]]]) -> float:
    """How much the rounds' total times differ: ``max / min - 1`` (0 for one round)."""
    totals = [sum(sum(forms.values()) for forms in rnd.values()) for rnd in rounds]
    return max(totals) / min(totals) - 1.0


def _best(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {b: {f: min(rnd[b][f] for rnd in rounds) for f in forms} for b, forms in rounds[0].items()}


def _choose(timings: dict[str, dict[str, float]]) -> dict[str, str]:
    """Fastest form per bucket; when those need two copy kinds, the best plan with only one."""
    def fastest(allowed: set[str]) -> dict[str, str]:
        return {b: min((f for f in t if f not in COPY_FORMS or f in allowed), key=t.get) for b, t in timings.items()}

    best = fastest(set(COPY_FORMS))
    kinds = {f for f in best.values() if f in COPY_FORMS}
    if len(kinds) <= 1:
        return best
    return min((fastest({k}) for k in kinds), key=lambda p: sum(timings[b][f] for b, f in p.items()))


def calibrate(dtypes: tuple[str, ...] = ("fp32", "bf16"), *, timer: Timer | None = None) -> GemmPlan:
    """Time every form for every bucket in each dtype in interleaved rounds and keep the fastest
    (see module doc); the plan records the rounds' spread per dtype (:func:`trusted` reads it)."""
    timings, forms, spreads = {}, {}, {}
    for d in dtypes:
        forms_here = candidate_forms(d) if timer is None else FORMS[d]
        candidates = {b: tuple(f for f in forms_here if b != "one" or f != "fp32") for b in BUCKETS}
        rounds = measure_rounds(d, candidates, timer=timer)
        timings[d] = _best(rounds)
        forms[d] = _choose(timings[d])
        # the cost of verifying extra positions, in the forms just chosen
        chosen = {f"rows{r}": (forms[d][bucket_of(r)],) for r in CURVE_ROWS}
        curve = measure_rounds(d, chosen, timer=timer)
        t = _best(curve)
        timings[d]["rows"] = {str(r): t[f"rows{r}"][forms[d][bucket_of(r)]] for r in CURVE_ROWS}
        spreads[d] = max(spread(rounds), spread(curve))
    return GemmPlan(forms=forms, timings_s=timings, machine=machine_key(), spread=spreads)


def trusted(plan: GemmPlan, dtype: str) -> bool:
    """Whether ``dtype``'s rounds agreed within :data:`BUSY_SPREAD` (else the machine was busy)."""
    return plan.spread.get(dtype, 0.0) <= BUSY_SPREAD


def plan_path(home: Path, machine: dict[str, str]) -> Path:
    digest = hashlib.sha256(json.dumps(machine, sort_keys=True).encode()).hexdigest()[:16]
    return home / "calibration" / f"gemm-{digest}.json"


def cached_plan(home: Path) -> GemmPlan:
    """The plan cached for this machine (empty when there is none or it cannot be read)."""
    machine = machine_key()
    if plan_path(home, machine) in _unsaved:
        return _unsaved[plan_path(home, machine)]
    try:
        data = json.loads(plan_path(home, machine).read_text())
        if data.get("version") == PLAN_VERSION and data.get("machine") == machine:
            return GemmPlan(forms=dict(data["forms"]), timings_s=dict(data["timings_s"]), machine=machine,
                            spread=dict(data.get("spread", {})))
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent or unreadable: calibrate again
    return GemmPlan(forms={}, timings_s={}, machine=machine)


_refused: set[tuple[Path, str]] = set()  # (cache file, dtype) refused in this process: not timed again
_unsaved: dict[Path, GemmPlan] = {}  # plans whose cache file could not be written: kept for this process


def load_or_calibrate(home: Path, *, dtypes: tuple[str, ...] = ("fp32", "bf16"), timer: Timer | None = None,
                      force: bool = False) -> GemmPlan:
    """The cached plan for this machine, with the dtypes it lacks (every dtype with ``force``)
    calibrated and :func:`adopt` -ed; a dtype refused in this process is not timed again
    (unless ``force``)."""
    plan = cached_plan(home)
    path = plan_path(home, plan.machine)
    missing = tuple(d for d in dtypes if force or (d not in plan.forms and (path, d) not in _refused))
    return adopt(home, plan, calibrate(missing, timer=timer)) if missing else plan


def adopt(home: Path, plan: GemmPlan, fresh: GemmPlan) -> GemmPlan:
    """``plan`` with ``fresh`` 's dtypes whose rounds agreed, written to the cache atomically.

    A dtype whose rounds spread more than :data:`BUSY_SPREAD` is refused: not cached, its
    products take the reference form (``F.linear``), and a warning names the command that
    redoes it."""
    path = plan_path(home, plan.machine)
    keep = tuple(d for d in fresh.forms if trusted(fresh, d))
    for d in fresh.forms:
        if d not in keep:
            _refused.add((path, d))
            plan = plan.without(d)
            log.warning("CPU GEMM calibration for %s refused: its timing rounds differed by %.0f%% (limit %.0f%%), "
                        "the machine was busy; %s products take the reference form (F.linear) and nothing is "
                        "cached. Redo it on a quiet machine: python -m refspec.eval calibrate --force", d,
                        100 * fresh.spread[d], 100 * BUSY_SPREAD, d)
    if not keep:
        return plan
    plan = GemmPlan(forms=plan.forms | {d: fresh.forms[d] for d in keep},
                    timings_s=plan.timings_s | {d: fresh.timings_s[d] for d in keep}, machine=plan.machine,
                    spread=plan.spread | {d: fresh.spread[d] for d in keep})
    log.info("calibrated CPU GEMM forms: %s", GemmPlan(forms={d: fresh.forms[d] for d in keep}, timings_s={},
                                                         machine={}).describe())
    _save(path, plan)
    return plan


def _save(path: Path, plan: GemmPlan) -> None:
    """Write the cache atomically; where it cannot be written (a read-only or misplaced
    ``REFSPEC_HOME``) the plan serves this process only: the cache is an optimisation."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(plan.to_json(), indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        _unsaved[path] = plan
        log.warning("the CPU GEMM calibration cache %s cannot be written (%s); the plan serves this run only and "
                    "is timed again next time (set REFSPEC_HOME to a writable folder to keep it)", path,
                    exc.strerror or exc)
        return
    _unsaved.pop(path, None)


def resolve_plan(dtype: torch.dtype) -> GemmPlan:
    """The plan ``REFSPEC_GEMM_PLAN`` asks for (see the module docstring), calibrated for ``dtype``."""
    choice = os.environ.get("REFSPEC_GEMM_PLAN", "auto").strip().lower()
    if choice == "reference" or dtype_name(dtype) not in DTYPES:
        return REFERENCE
    if choice != "auto":
        raise ValueError(f"REFSPEC_GEMM_PLAN must be 'auto' or 'reference', got {choice!r}")
    from refspec.assets.registry import refspec_home

    return load_or_calibrate(refspec_home(), dtypes=(dtype_name(dtype),))
