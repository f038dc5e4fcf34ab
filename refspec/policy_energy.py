"""The energy policy: per step, the K of least predicted joules per emitted token.

For every K of its set, :class:`EnergyPolicy` predicts, before the step:

* the step's **time and energy**, from the roofline (:mod:`refspec.energy.model.roofline`) priced by
  the hardware profile of the run (:class:`RooflineStepCost`): the drafter's K forwards (its
  ``roofline_model``; none for a free drafter) and the target's verify forward of K + 1 tokens
  in every slot over the keys it will attend. The profile is the one the run's meter models or
  measures by (a roofline meter's, the CPU profile on a CPU), never a timing of the machine
  that runs the code, so a run modelled on an H200 decides as an H200 would;
* the **tokens** the active rows will emit: per request ``1 + sum_{i<=K} prod_{j<=i} a_j``
  with ``a_j`` the conditional acceptance of draft position j (:class:`AcceptanceTracker`:
  the request's own counts, shrunk to the running estimate over every request, itself shrunk
  to the drafter's and corpus's prior, plus :data:`OPTIMISM` / (active rows) pseudo-acceptances,
  so one rejected draft does not stop a request's drafting for good: a step without drafts
  teaches nothing. The optimism is shared by the rows of a step because they share its K: at
  batch 1 exploring is the request's own choice, at batch 32 one fresh request's optimism
  would make every row pay for drafts that do not pay).

It returns the K of least energy / tokens among those whose predicted time per output token,
step time x active rows / tokens, meets the TPOT target (without one, every K qualifies; when
none does, the fastest). Where most active requests have never drafted (a new request at
batch 1), they are probed: where the best K is 0 but the smallest K > 0 costs at most
:data:`PROBE_SLACK` x (share of unprobed requests) more per token, that K runs, so a request
whose text drafts well is found even when the running estimate says drafting does not pay.

Where the run measures time (a CPU's wall clock, a GPU's CUDA events) rather than modelling it,
the roofline's times are only a prior: a CPU runs a product of a few rows far from both its
peak and its bandwidth. Observing the run's phase events (:meth:`EnergyPolicy.on_event`), the
policy then scales each K's predicted time by what the steps of that K measured (draft, verify
and commit, over the roofline's draft and verify: :class:`TimeCalibration`), the static power
following the time; a K not measured yet takes the scale interpolated between the nearest
measured K below and above. It measures the smallest and the largest K
:data:`EXPLORE_STEPS` times at the start, and a measured K it stopped choosing again every
:data:`REPROBE_EVERY` steps, so its scale stays current.

Example (H200 profile, Llama-3.1-8B shapes): at 1 active row accepting 0.8 of its drafts the
verify reads the weights once whatever K, so K = 4 emits 3.4 tokens for under half the energy
per token of K = 0; at 1024 rows of 64-token context accepting 0.6 the verify is compute-bound
and each extra position costs its FLOPs, so K = 0 wins (``tests/test_policy.py``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from refspec.config import ModelArgs, round_up
from refspec.energy.model.hardware import HardwareProfile
from refspec.energy.model.roofline import DrafterModel, forward_cost
from refspec.energy.model.work import ForwardShape
from refspec.policy_protocol import StepView

PRIOR_WEIGHT = 8.0
"""Observations the drafter's prior counts as, per draft position, in the running estimate."""
REQUEST_WEIGHT = 2.0
"""Observations the running estimate counts as, per position, in a request's own estimate."""
OPTIMISM = 1.0
"""Pseudo-acceptances a request's estimate holds per position beyond the running estimate's,
divided by the active rows (optimism under uncertainty: it fades as the request's own drafts
are counted)."""
PROBE_SLACK = 0.1
"""Extra J/token a probe of unprobed requests may cost, at a batch of nothing but unprobed ones."""
EXPLORE_STEPS = 1
"""Steps of the smallest and the largest K measured at the start of a run whose time is measured."""
REPROBE_EVERY = 128
"""Steps after which a measured K not chosen since is measured again."""
RATIO_WINDOW = 8
"""Latest measured/predicted time ratios a K's scale averages."""


def default_ks(k: int) -> tuple[int, ...]:
    """The K an energy policy chooses from: every K up to 8, beyond that powers of two and K."""
    if k <= 8:
        return tuple(range(k + 1))
    return tuple(sorted({0, k} | {1 << i for i in range(k.bit_length()) if 1 << i < k}))


class AcceptanceTracker:
    """Conditional acceptance of each draft position, per request and over every request.

    Position j (1-based) of a step's chain is *tried* when the drafts before it were all
    accepted; ``a_j`` = accepted / tried. A step with K drafts of which A were accepted tried
    positions 1..min(A + 1, K) and accepted 1..A.

    Args:
        positions: P, the longest chain tracked.
        prior: the prior per-token acceptance (one value for every position, or P values).
        prior_weight: observations the prior counts as per position.
        request_weight: observations the running estimate counts as in a request's estimate.
        optimism: pseudo-acceptances added to a request's estimate per position.
    """

    def __init__(self, positions: int, prior: float | Sequence[float] = 0.5, *, prior_weight: float = PRIOR_WEIGHT,
                 request_weight: float = REQUEST_WEIGHT, optimism: float = OPTIMISM) -> None:
        prior = [float(prior)] * positions if isinstance(prior, (int, float)) else [float(p) for p in prior]
        if len(prior) != positions or any(not 0.0 <= p <= 1.0 for p in prior):
            raise ValueError(f"prior must be {positions} acceptance rates in [0, 1], got {prior}")
        self.prior = prior
        self.prior_weight, self.request_weight, self.optimism = prior_weight, request_weight, optimism
        self.tried = [0.0] * positions  # [P] over every request
        self.accepted = [0.0] * positions
        self._requests: dict[int, tuple[list[float], list[float]]] = {}  # id -> (tried [P], accepted [P])

    def observe(self, k: int, accepted: Sequence[int], slot_requests: Sequence[int]) -> None:
        """Count one step of K drafts: ``accepted[slot]`` drafts (-1: no generating request)."""
        live = {r for r in slot_requests if r >= 0}
        for rid in [r for r in self._requests if r not in live]:  # finished requests leave
            del self._requests[rid]
        if k <= 0:
            return
        for a, rid in zip(accepted, slot_requests):
            if a < 0 or rid < 0:
                continue
            tried, acc = self._requests.setdefault(rid, ([0.0] * len(self.prior), [0.0] * len(self.prior)))
            for j in range(min(a + 1, k, len(self.prior))):
                hit = float(j < a)
                tried[j] += 1.0
                acc[j] += hit
                self.tried[j] += 1.0
                self.accepted[j] += hit

    def running(self) -> list[float]:
        """``[P]`` conditional acceptance over every request seen, with the prior."""
        w = self.prior_weight
        return [(a + w * p) / (t + w) for a, t, p in zip(self.accepted, self.tried, self.prior)]

    def rates(self, request: int, running: Sequence[float] | None = None, shared: int = 1) -> list[float]:
        """``[P]`` conditional acceptance of ``request``: ``(accepted + w g + o) / (tried + w + o)``
        (w the request weight, g the running estimate, o the optimism / ``shared``, the rows
        sharing the step)."""
        running = self.running() if running is None else running
        tried, acc = self._requests.get(request, ((0.0,) * len(running), (0.0,) * len(running)))
        w, o = self.request_weight, self.optimism / max(shared, 1)
        return [(a + w * g + o) / (t + w + o) for t, a, g in zip(tried, acc, running)]

    def probed(self, request: int) -> bool:
        """Whether ``request`` has drafted at least once."""
        own = self._requests.get(request)
        return own is not None and own[0][0] > 0

    def expected_tokens(self, request: int, ks: Sequence[int], running: Sequence[float] | None = None,
                        shared: int = 1) -> dict[int, float]:
        """Expected tokens ``request`` emits in a step of each K: ``1 + sum_i prod_{j<=i} a_j``."""
        rates = self.rates(request, running, shared)
        out, total, survive = {}, 1.0, 1.0
        for i in range(max(ks) + 1):
            if i:
                survive *= rates[i - 1]
                total += survive
            out[i] = total
        return {k: out[k] for k in ks}


class RooflineStepCost:
    """Predicted time and energy of one decode step at (slots, K, attended keys).

    Args:
        target: the target's architecture.
        profile: the hardware the run measures or models.
        drafter: the drafter's cost per draft forward (None: a free drafter, n-gram lookup).
        dtype_bytes: bytes per weight / KV element.
        verify_shape: ``(rows, tokens_per_row, num_keys, lm_head_tokens) -> ForwardShape``, the
            shape the target records for such a forward (``Transformer.forward_shape``: weight
            copies of a CPU GEMM plan included); None: a plain :class:`ForwardShape`.
        kv_bucket: the engine's bucket of attended keys.
    """

    def __init__(self, target: ModelArgs, profile: HardwareProfile, *, drafter: DrafterModel | None = None,
                 dtype_bytes: int = 2, verify_shape: Callable[..., ForwardShape] | None = None,
                 kv_bucket: int = 64) -> None:
        self.target, self.profile, self.drafter = target, profile, drafter
        self.dtype_bytes, self.verify_shape, self.kv_bucket = dtype_bytes, verify_shape, kv_bucket
        self.static_w = profile.static_w
        self._memo: dict[tuple[int, int, int], tuple[float, float]] = {}

    def _verify(self, rows: int, k: int, keys: int) -> ForwardShape:
        if self.verify_shape is None:
            return ForwardShape(args=self.target, rows=rows, tokens_per_row=k + 1, context_tokens=rows * keys,
                                dtype_bytes=self.dtype_bytes)
        shape = self.verify_shape(rows, k + 1, keys, rows * (k + 1))
        return dataclasses.replace(shape, experts_touched=None)  # a prediction routes by expectation

    def __call__(self, batch: int, k: int, length_bound: int) -> tuple[float, float]:
        """``(time_s, energy_j)`` of a step over ``batch`` slots drafting K, whose longest row
        has ``length_bound - 1`` committed tokens."""
        keys = round_up(length_bound + k, self.kv_bucket)
        hit = self._memo.get((batch, k, keys))
        if hit is not None:
            return hit
        costs = [forward_cost(self._verify(batch, k, keys))]
        d = self.drafter
        if k > 0 and d is not None and not d.free:  # as predict_step: K one-token forwards over a growing
            widths = [(k, length_bound - 1 + k)] if d.parallel else [(1, length_bound + i) for i in range(k)]  # cache
            costs += [d.forward_cost(self.target, rows=batch, tokens_per_row=w, context_tokens=batch * ctx,
                                     dtype_bytes=self.dtype_bytes) for w, ctx in widths]
        time_s = energy_j = 0.0
        for c in costs:
            t = self.profile.time_s(c)
            time_s, energy_j = time_s + t, energy_j + self.profile.energy_j(c, t)
        self._memo[(batch, k, keys)] = (time_s, energy_j)
        return time_s, energy_j


class TimeCalibration:
    """Measured over predicted step time, per K (a K never measured: interpolated between the
    nearest measured K below and above, or the nearest's beyond them).

    Args:
        ks: the K a policy chooses from.
    """

    def __init__(self, ks: Sequence[int]) -> None:
        self._ratios: dict[int, list[float]] = {k: [] for k in ks}
        self._last: dict[int, int] = {k: -(1 << 30) for k in ks}  # step of each K's latest measurement

    def add(self, k: int, step: int, measured_s: float, predicted_s: float) -> None:
        """One step of K: its measured time against the roofline's prediction."""
        if predicted_s > 0 and measured_s > 0 and k in self._ratios:
            self._ratios[k] = (self._ratios[k] + [measured_s / predicted_s])[-RATIO_WINDOW:]
            self._last[k] = step

    def _mean(self, k: int) -> float:
        return sum(self._ratios[k]) / len(self._ratios[k])

    def ratio(self, k: int) -> float:
        """The scale of K's predicted time (1 before any measurement)."""
        seen = sorted(kk for kk, r in self._ratios.items() if r)
        if not seen:
            return 1.0
        below, above = [kk for kk in seen if kk <= k], [kk for kk in seen if kk >= k]
        if not below or not above:
            return self._mean(seen[0] if not below else seen[-1])
        lo, hi = below[-1], above[0]
        if lo == hi:
            return self._mean(lo)
        w = (k - lo) / (hi - lo)
        return (1 - w) * self._mean(lo) + w * self._mean(hi)

    def due(self, step: int) -> int | None:
        """A K to measure now: the smallest or largest K while measured fewer than
        :data:`EXPLORE_STEPS` times, else a measured K last measured :data:`REPROBE_EVERY` steps
        back; None otherwise."""
        ends = (min(self._ratios), max(self._ratios))
        fresh = [k for k in ends if len(self._ratios[k]) < EXPLORE_STEPS]
        if fresh:
            return fresh[0]
        measured = [k for k, r in self._ratios.items() if r]
        stale = min(measured, key=lambda k: self._last[k])
        return stale if step - self._last[stale] >= REPROBE_EVERY else None


@dataclasses.dataclass(frozen=True)
class KOption:
    """One K's prediction for a step: ``tokens`` emitted by the active rows in ``time_s`` for ``energy_j``."""

    k: int
    time_s: float
    energy_j: float
    tokens: float
    active: int

    @property
    def j_per_token(self) -> float:
        return self.energy_j / self.tokens

    @property
    def tpot_s(self) -> float:
        """Time per output token per active row."""
        return self.time_s * self.active / self.tokens


def cheapest(options: Sequence[KOption], tpot_s: float | None = None) -> KOption:
    """The option of least J/token among those meeting ``tpot_s`` (all without a target; the
    fastest when none meets it); ties go to the smaller K."""
    fits = [o for o in options if tpot_s is None or o.tpot_s <= tpot_s]
    if not fits:
        return min(options, key=lambda o: (o.tpot_s, o.k))
    return min(fits, key=lambda o: (o.j_per_token, o.k))


class EnergyPolicy:
    """Per step, the K of least predicted J/token meeting a TPOT target (module docstring).

    Args:
        k: the engine's K (the largest K chosen).
        cost: ``(batch, k, length_bound) -> (time_s, energy_j)``, e.g. a :class:`RooflineStepCost`.
        tpot_ms: TPOT target in ms, or None.
        prior: the prior per-token acceptance of the drafter on this corpus.
        ks: the K it chooses from (default :func:`default_ks`).
        measured: the run measures time (wall clock, CUDA events) rather than modelling it with
            ``cost``'s profile: calibrate each K's time from the phase events (:meth:`on_event`).
        static_w: the static power in W behind ``cost``'s energy (default ``cost.static_w``),
            which scales with a calibrated time.
        optimism: the acceptance tracker's pseudo-acceptances per request (0: the estimates as
            counted, e.g. for tables of what a known acceptance implies).
    """

    def __init__(self, *, k: int, cost: Callable[[int, int, int], tuple[float, float]], tpot_ms: float | None = None,
                 prior: float | Sequence[float] = 0.5, ks: Sequence[int] | None = None, measured: bool = False,
                 static_w: float | None = None, optimism: float = OPTIMISM) -> None:
        self.ks = tuple(sorted(set(ks))) if ks is not None else default_ks(k)
        if not self.ks or self.ks[0] < 0 or self.ks[-1] > k:
            raise ValueError(f"the energy policy's K must lie in 0..{k}, got {self.ks}")
        if tpot_ms is not None and not 0 < tpot_ms < math.inf:
            raise ValueError(f"tpot_ms must be a positive number, got {tpot_ms}")
        self.name = "energy" if tpot_ms is None else f"energy:tpot_ms={tpot_ms:g}"
        self.cost, self.tpot_s = cost, None if tpot_ms is None else tpot_ms / 1e3
        self.tracker = AcceptanceTracker(max(max(self.ks), 1), prior, optimism=optimism)
        self.last: list[KOption] = []  # the latest step's predictions (for tests and reports)
        self.calibration = TimeCalibration(self.ks) if measured else None
        self.static_w = float(getattr(cost, "static_w", 0.0) if static_w is None else static_w)
        self._step: tuple[int, int, float, float] | None = None  # (step, K, predicted s, measured s so far)

    def options(self, view: StepView) -> list[KOption]:
        """Every K's prediction for the step ``view`` describes."""
        requests = [r for r in view.slot_requests if r >= 0]
        running = self.tracker.running()
        per_k = dict.fromkeys(self.ks, 0.0)
        for rid in requests:
            for k, n in self.tracker.expected_tokens(rid, self.ks, running, shared=view.active).items():
                per_k[k] += n
        scale = view.active / len(requests) if requests else 1.0  # finished rows still in a slot emit nothing
        out = []
        for k in self.ks:
            time_s, energy_j = self.cost(view.batch, k, view.length_bound)
            if self.calibration is not None:  # the measured time, and the static energy over it
                extra_s = time_s * (self.calibration.ratio(k) - 1.0)
                time_s, energy_j = time_s + extra_s, energy_j + self.static_w * extra_s
            tokens = per_k[k] * scale if requests else float(view.active)
            out.append(KOption(k=k, time_s=time_s, energy_j=energy_j, tokens=max(tokens, 1e-9), active=view.active))
        return out

    def choose(self, view: StepView) -> int:
        if view.active <= 0 or self.ks == (0,):
            return 0
        k = self._choose(view)
        if self.calibration is not None:
            self._step = (view.step, k, self.cost(view.batch, k, view.length_bound)[0], 0.0)
        return k

    def _choose(self, view: StepView) -> int:
        due = self.calibration.due(view.step) if self.calibration is not None else None
        if due is not None:
            return due
        self.last = opts = self.options(view)
        best = cheapest(opts, self.tpot_s)
        requests = [r for r in view.slot_requests if r >= 0]
        unprobed = sum(not self.tracker.probed(r) for r in requests) / max(len(requests), 1)
        probe = next((o for o in opts if o.k > 0), None)
        if best.k == 0 and unprobed >= 0.5 and probe is not None and (self.tpot_s is None or probe.tpot_s <= self.tpot_s) \
                and probe.j_per_token <= best.j_per_token * (1 + PROBE_SLACK * unprobed):
            return probe.k
        return best.k

    def observe(self, k: int, accepted: Sequence[int], slot_requests: Sequence[int]) -> None:
        self.tracker.observe(k, accepted, slot_requests)

    def on_event(self, event) -> None:
        """A phase observer (``Engine(observers=[..., policy.on_event])``): the measured time of
        each step's draft, verify and commit phases calibrates its K (when ``measured``)."""
        if self._step is None or event.step != self._step[0] or event.phase not in ("draft", "verify", "commit"):
            return
        step, k, predicted_s, measured_s = self._step
        measured_s += event.measurement.time_s
        self._step = (step, k, predicted_s, measured_s)
        if event.phase == "commit":
            self.calibration.add(k, step, measured_s, predicted_s)
            self._step = None


__all__ = ["AcceptanceTracker", "EnergyPolicy", "KOption", "PROBE_SLACK", "RooflineStepCost", "TimeCalibration",
           "cheapest", "default_ks"]
