"""Acceptance models: distributions over accepted drafts per verify step, and the built-in ones.

An :class:`AcceptanceModel` holds ``P(n_acc = j)`` for ``j = 0..K`` of one (drafter, corpus,
K) with its :class:`Provenance`: counted from real runs (:meth:`AcceptanceModel.from_generation`),
derived from published acceptance lengths (:func:`survival_from_taus`,
:func:`model_from_survival`), or synthetic (:func:`geometric_model`). Files of them and their
use by the engine are in :mod:`refspec.eval.injection`.

tau (acceptance length) counts the bonus token: ``tau = n_acc + 1`` per row-step.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import math
from typing import Any, Callable, Iterable, Sequence

import torch


class AcceptanceModelError(ValueError):
    """An acceptance model that cannot be built, found or used (with what to do instead)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Provenance:
    """Where an acceptance distribution came from.

    Attributes:
        kind: ``measured`` (counted from real runs), ``derived`` (computed from published
            figures), ``restricted`` (a measured/derived model folded to a smaller K) or
            ``extrapolated`` (beyond the K the source covers).
        source_model: the target model the acceptance was observed with.
        corpus: the corpus of the prompts.
        prompts: number of prompts behind the figures, None if unknown.
        date: ISO date of the run or derivation.
        source: the command that produced it, or the citation it was derived from.
        notes: anything else a reader must know.
    """

    kind: str
    source_model: str
    corpus: str
    prompts: int | None = None
    date: str = ""
    source: str = ""
    notes: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class AcceptanceModel:
    """A distribution over accepted drafts per verify step for one (drafter, corpus, K).

    Attributes:
        name: label (a built-in name or the file's).
        drafter: drafter registry name.
        corpus: corpus name.
        k: drafts per step K.
        probs: ``P(n_acc = j)`` for ``j = 0..K`` (K + 1 entries summing to 1).
        counts: row-steps per count behind ``probs`` when measured, else None.
        provenance: where it came from.
    """

    name: str
    drafter: str
    corpus: str
    k: int
    probs: tuple[float, ...]
    counts: tuple[int, ...] | None = None
    provenance: Provenance

    def __post_init__(self) -> None:
        if self.k < 0:
            raise AcceptanceModelError(f"k must be >= 0, got {self.k}")
        if len(self.probs) != self.k + 1:
            raise AcceptanceModelError(f"{self.name}: probs has {len(self.probs)} entries for k={self.k}; "
                                       f"need k + 1 = {self.k + 1} (counts 0..k)")
        if any(p < 0 or not math.isfinite(p) for p in self.probs) or abs(sum(self.probs) - 1.0) > 1e-6:
            raise AcceptanceModelError(f"{self.name}: probs must be non-negative and sum to 1, got {self.probs}")
        if self.counts is not None and len(self.counts) != self.k + 1:
            raise AcceptanceModelError(f"{self.name}: counts has {len(self.counts)} entries for k={self.k}")

    # ---- statistics ---------------------------------------------------------------------------
    @property
    def mean_tau(self) -> float:
        """Expected acceptance length ``E[n_acc + 1]``."""
        return sum((j + 1) * p for j, p in enumerate(self.probs))

    @property
    def std_tau(self) -> float:
        """Standard deviation of ``n_acc + 1`` (of one row-step)."""
        m = self.mean_tau
        return math.sqrt(max(0.0, sum((j + 1 - m) ** 2 * p for j, p in enumerate(self.probs))))

    @property
    def row_steps(self) -> int | None:
        """Row-steps behind the figures when measured."""
        return None if self.counts is None else sum(self.counts)

    def survival(self) -> tuple[float, ...]:
        """``P(n_acc >= i)`` for ``i = 0..K``."""
        out, tail = [], 1.0
        for p in self.probs:
            out.append(max(0.0, tail))
            tail -= p
        return tuple(out)

    # ---- transformations ----------------------------------------------------------------------
    def restrict(self, k: int) -> "AcceptanceModel":
        """The model for ``k <= K`` drafts: mass of counts ``>= k`` folds into ``k``.

        Raises:
            AcceptanceModelError: ``k > K`` (a recorded distribution cannot be extended).
        """
        if k == self.k:
            return self
        if not 0 <= k < self.k:
            raise AcceptanceModelError(
                f"{self.name} was recorded at k={self.k} and cannot serve k={k}: record it at k >= {k} "
                f"(export acceptance from a run with that k) or use a built-in that extrapolates")
        probs = tuple(self.probs[:k]) + (sum(self.probs[k:]),)
        counts = None if self.counts is None else tuple(self.counts[:k]) + (sum(self.counts[k:]),)
        prov = dataclasses.replace(self.provenance, kind="restricted" if self.provenance.kind == "measured"
                                   else self.provenance.kind,
                                   notes=_join(self.provenance.notes, f"restricted from k={self.k} to k={k}"))
        return dataclasses.replace(self, k=k, probs=probs, counts=counts, provenance=prov)

    # ---- sampling -----------------------------------------------------------------------------
    def cdf_tensor(self, device: torch.device | str) -> torch.Tensor:
        """``[K + 1]`` float64-accurate CDF ``P(n_acc <= j)`` as float32 on ``device`` (last entry 1)."""
        acc, out = 0.0, []
        for p in self.probs:
            acc += p
            out.append(acc)
        out[-1] = 1.0
        return torch.tensor(out, dtype=torch.float32, device=device)

    def sample(self, n: int, generator: torch.Generator, device: torch.device | str | None = None) -> torch.Tensor:
        """Draw ``n`` accepted counts by inverse CDF (device ops only, no host sync).

        Args:
            n: number of draws.
            generator: explicit random generator (its device is used unless ``device`` is given).
            device: device of the result.

        Returns:
            ``[n]`` long counts in ``0..K``.
        """
        dev = torch.device(device) if device is not None else generator.device
        cdf = self.cdf_tensor(dev)  # [K+1]
        u = torch.rand(n, device=dev, generator=generator)  # [n]
        return (u[:, None] >= cdf[None, : self.k]).sum(1)  # [n] entries of the CDF below u

    # ---- (de)serialisation --------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """One entry of the file schema (module docstring)."""
        return {"name": self.name, "drafter": self.drafter, "corpus": self.corpus, "k": self.k,
                "probs": list(self.probs), "counts": None if self.counts is None else list(self.counts),
                "mean_tau": self.mean_tau, "provenance": dataclasses.asdict(self.provenance)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "AcceptanceModel":
        """Inverse of :meth:`to_json` (``mean_tau`` is recomputed, not trusted)."""
        try:
            prov = Provenance(**d["provenance"])
            return cls(name=str(d["name"]), drafter=str(d["drafter"]), corpus=str(d["corpus"]), k=int(d["k"]),
                       probs=tuple(float(p) for p in d["probs"]),
                       counts=None if d.get("counts") is None else tuple(int(c) for c in d["counts"]),
                       provenance=prov)
        except (KeyError, TypeError) as exc:
            raise AcceptanceModelError(f"an acceptance model entry is malformed ({exc!r}); "
                                       f"see refspec.eval.injection for the schema") from None

    @classmethod
    def from_counts(cls, counts: Sequence[int], *, name: str, drafter: str, corpus: str,
                    provenance: Provenance) -> "AcceptanceModel":
        """A measured model from row-step counts ``[c_0, ..., c_K]``."""
        total = sum(counts)
        if total <= 0:
            raise AcceptanceModelError(f"{name}: no row-steps to build an acceptance distribution from")
        return cls(name=name, drafter=drafter, corpus=corpus, k=len(counts) - 1,
                   probs=tuple(c / total for c in counts), counts=tuple(int(c) for c in counts),
                   provenance=provenance)

    @classmethod
    def from_generation(cls, gen: Any | Iterable[Any], k: int, *, name: str, drafter: str, corpus: str,
                        source_model: str, prompts: int | None = None, date: str | None = None,
                        source: str = "", notes: str = "") -> "AcceptanceModel":
        """Count accepted drafts per row-step of one or more ``Engine.generate`` results.

        Args:
            gen: a :class:`~refspec.serving.Generation` or several (their ``accepted_per_step``:
                -1 marks rows already done and is skipped).
            k: the K the runs drafted with.
            name, drafter, corpus: labels of the model.
            source_model: the target the runs used.
            prompts: prompts behind the runs (default: rows of the generations).
            date: ISO date (default: today).
            source: the command line that produced the runs.
            notes: free text.

        Returns:
            A measured model.
        """
        gens = [gen] if hasattr(gen, "accepted_per_step") else list(gen)
        counts = [0] * (k + 1)
        for g in gens:
            for step in g.accepted_per_step:
                for a in step:
                    if a < 0:
                        continue
                    if a > k:
                        raise AcceptanceModelError(f"a row accepted {a} drafts but k={k}; pass the run's k")
                    counts[a] += 1
        if prompts is None:
            prompts = sum(len(g.prompt_lengths) for g in gens)
        prov = Provenance(kind="measured", source_model=source_model, corpus=corpus, prompts=prompts,
                          date=date or _dt.date.today().isoformat(), source=source, notes=notes)
        return cls.from_counts(counts, name=name, drafter=drafter, corpus=corpus, provenance=prov)


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


# ---- built-in models -----------------------------------------------------------------------
VLLM_EAGLE3_TAU: dict[int, float] = {2: 2.36, 3: 2.79, 4: 3.08, 5: 3.32, 6: 3.46, 7: 3.54}
"""vLLM EAGLE-3 chain acceptance lengths (tau, bonus included) for K = 2..7 on
Llama-3.1-8B-Instruct, as the vLLM project reports them (corpus not stated)."""


def survival_from_taus(taus: dict[int, float]) -> list[float]:
    """``S_i = P(n_acc >= i)`` for ``i = 1..K_max`` reproducing published taus at every K.

    With a chain drafter, ``tau(K) = 1 + sum_{i<=K} S_i``, so ``S_K = tau(K) - tau(K-1)`` for
    consecutive published K. The first published K (>= 2) only fixes the sum of the first
    ones; they are split geometrically (``S_{i}^2 = S_{i-1} S_{i+1}``, i.e. constant
    conditional acceptance across the unpublished head), an assumption labelled in the
    model's provenance.

    Raises:
        AcceptanceModelError: taus that are not increasing or give a rising survival.
    """
    ks = sorted(taus)
    if ks != list(range(ks[0], ks[-1] + 1)) or ks[0] < 1:
        raise AcceptanceModelError(f"published taus must cover consecutive K >= 1, got {ks}")
    s: dict[int, float] = {}
    for a, b in zip(ks, ks[1:]):
        s[b] = taus[b] - taus[a]
    k0, head = ks[0], taus[ks[0]] - 1.0  # S_1 + ... + S_k0 = head
    if k0 == 1:
        s[1] = head
    else:
        # geometric head ending at S_{k0+1}: S_i = S_{k0+1} * r^(k0+1-i); solve sum = head for r
        nxt = s.get(k0 + 1)
        if nxt is None:
            raise AcceptanceModelError("need at least two published K to derive a distribution")
        lo, hi = 1.0, 1e6
        for _ in range(200):
            r = (lo + hi) / 2
            total = sum(nxt * r ** (k0 + 1 - i) for i in range(1, k0 + 1))
            lo, hi = (r, hi) if total < head else (lo, r)
        for i in range(1, k0 + 1):
            s[i] = nxt * lo ** (k0 + 1 - i)
    out = [s[i] for i in range(1, ks[-1] + 1)]
    rising = any(b > a + 1e-12 for a, b in zip(out, out[1:]))
    reproduced = all(abs(1.0 + sum(out[:k]) - t) < 1e-6 for k, t in taus.items())
    if any(x < 0 or x > 1 for x in out) or rising or not reproduced:
        raise AcceptanceModelError(f"published taus {taus} give an impossible survival curve {out}")
    return out


def acceptance_from_tau(tau: float, k: int) -> float:
    """The per-draft acceptance a whose expected tokens per step, (1 - a^(k+1)) / (1 - a), equal
    ``tau`` (Leviathan et al. 2023); 0 for tau <= 1 or k = 0, 1 for tau >= k + 1 (bisection)."""
    from refspec.energy.model.roofline import expected_tokens_per_step

    if k <= 0 or tau <= 1.0:
        return 0.0
    if tau >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_step(mid, k) < tau else (lo, mid)
    return (lo + hi) / 2


def model_from_survival(survival: Sequence[float], k: int, *, tail_ratio: float | None, name: str,
                        drafter: str, corpus: str, provenance: Provenance) -> AcceptanceModel:
    """A model at K = ``k`` from ``S_1..S_n``; beyond n the survival decays by ``tail_ratio``.

    Raises:
        AcceptanceModelError: ``k > n`` and no ``tail_ratio``.
    """
    s = list(survival)
    kind = provenance.kind
    if k > len(s):
        if tail_ratio is None:
            raise AcceptanceModelError(f"{name} covers k <= {len(s)}, not k={k}")
        while len(s) < k:
            s.append(s[-1] * tail_ratio)
        kind = "extrapolated"
    full = [1.0] + s[:k]
    probs = tuple(max(0.0, full[j] - full[j + 1]) for j in range(k)) + (full[k],)
    total = sum(probs)
    probs = tuple(p / total for p in probs)
    notes = provenance.notes
    if kind == "extrapolated":
        notes = _join(notes, f"counts beyond {len(survival)} extrapolated with conditional acceptance "
                             f"{tail_ratio:.3f} per draft")
    return AcceptanceModel(name=name, drafter=drafter, corpus=corpus, k=k, probs=probs, counts=None,
                           provenance=dataclasses.replace(provenance, kind=kind, notes=notes))


DERIVED_ON = "2026-11-29"
"""Date the built-in derivations were written (their ``provenance.date``)."""


def _vllm_eagle3(k: int) -> AcceptanceModel:
    s = survival_from_taus(VLLM_EAGLE3_TAU)
    prov = Provenance(kind="derived", source_model="Llama-3.1-8B-Instruct", corpus="unspecified", prompts=None,
                      date=DERIVED_ON,
                      source="vLLM's reported EAGLE-3 chain acceptance length on Llama-3.1-8B-Instruct, K=2..7: "
                             "2.36, 2.79, 3.08, 3.32, 3.46, 3.54",
                      notes="derived: S_K = tau(K) - tau(K-1) for K = 3..7, S_1, S_2 split geometrically; "
                            "the published runs' corpus is not stated there")
    return model_from_survival(s, k, tail_ratio=s[-1] / s[-2], name="vllm-eagle3-llama3.1-8b", drafter="eagle3",
                               corpus="unspecified", provenance=prov)


def geometric_model(acceptance: float, k: int) -> AcceptanceModel:
    """Independent per-draft acceptance ``a`` (Leviathan et al. 2023): ``P(n_acc >= i) = a^i``."""
    if not 0.0 <= acceptance <= 1.0:
        raise AcceptanceModelError(f"geometric acceptance must lie in [0, 1], got {acceptance}")
    prov = Provenance(kind="derived", source_model="any", corpus="any", date="",
                      source="Leviathan et al. 2023: i.i.d. per-draft acceptance",
                      notes=f"synthetic: every draft accepted with probability {acceptance}")
    return model_from_survival([acceptance ** i for i in range(1, k + 1)], k, tail_ratio=None,
                               name=f"geometric:{acceptance:g}", drafter="any", corpus="any", provenance=prov)


DFLASH_B16_TAU: dict[str, float] = {"conversation": 3.36, "code": 3.52}
"""Acceptance length (tau, bonus included) of z-lab's DFlash block drafter (block size 16) on
Qwen3-8B served by vLLM on an H100, MT-Bench's 80 prompts, as NVIDIA Model-Optimizer's DFlash
page reports them per category (``examples/speculative_decoding/doc/dflash.md``, "vLLM
Deployment Results", z-lab column): ``code`` is its coding category (3.52); ``conversation`` the
mean of writing, roleplay, reasoning, extraction, stem and humanities (3.97, 3.37, 3.49, 3.02,
3.63, 2.68). DFlash's own paper (arXiv 2602.06036) reports higher acceptance at batch 1 with
thinking off; these are third-party serving figures."""

_DFLASH_CATEGORY = {"code": "coding category", "conversation": "mean of the six non-math, non-coding categories"}
PUBLISHED_ON = "2026-12-03"
"""Date the published-level file was derived (its ``provenance.date``)."""


def dflash_like_model(corpus: str, k: int = 16) -> AcceptanceModel:
    """A DFlash-like block drafter's distribution at K = ``k`` on ``corpus``: constant per-draft
    acceptance ``a`` (a geometric survival, the only shape a mean fixes) whose tau at K = 16 is the
    published :data:`DFLASH_B16_TAU`.

    Raises:
        AcceptanceModelError: a corpus without a published figure.
    """
    if corpus not in DFLASH_B16_TAU:
        raise AcceptanceModelError(f"no published DFlash acceptance for corpus {corpus!r}; have "
                                   f"{sorted(DFLASH_B16_TAU)}")
    tau, lo, hi = DFLASH_B16_TAU[corpus], 0.0, 1.0
    for _ in range(80):  # tau(a) = (1 - a^17) / (1 - a) rises with a
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** i for i in range(17)) < tau else (lo, mid)
    prov = Provenance(kind="derived", source_model="Qwen3-8B", corpus=corpus, prompts=80, date=PUBLISHED_ON,
                      source="NVIDIA Model-Optimizer, examples/speculative_decoding/doc/dflash.md, vLLM deployment "
                             "results, z-lab DFlash block size 16 on Qwen3-8B, MT-Bench per category",
                      notes=f"tau {tau} at K=16 ({_DFLASH_CATEGORY[corpus]}); geometric survival with per-draft "
                            f"acceptance {lo:.4f} (an assumed shape: the source gives means only)")
    return model_from_survival([lo ** i for i in range(1, 17)], k, tail_ratio=None, name=f"dflash-b16-{corpus}",
                               drafter="block", corpus=corpus, provenance=prov)


def published_models() -> list[AcceptanceModel]:
    """The published-level acceptance the paper command injects (``refspec.eval.paper``): EAGLE-3
    on Llama-3.1-8B (vLLM's chain taus, K = 7, one model per corpus since the source states none)
    and a DFlash-like block drafter at K = 16 per corpus."""
    out = []
    for corpus in ("conversation", "code"):
        m = _vllm_eagle3(7)
        prov = dataclasses.replace(m.provenance, corpus=corpus,
                                   notes=_join(m.provenance.notes, f"served for corpus {corpus}: the source states "
                                                                   f"none, so every corpus gets the same model"))
        out.append(dataclasses.replace(m, name=f"eagle3-llama3.1-8b-vllm-{corpus}", drafter="eagle", corpus=corpus,
                                       provenance=prov))
    return out + [dflash_like_model(c) for c in ("conversation", "code")]


BUILTIN: dict[str, Callable[[int], AcceptanceModel]] = {"vllm-eagle3-llama3.1-8b": _vllm_eagle3}
"""Named models for ``--accept-model NAME`` (plus ``geometric:A`` for any A in [0, 1])."""


__all__ = ["AcceptanceModel", "AcceptanceModelError", "Provenance", "BUILTIN", "VLLM_EAGLE3_TAU", "DERIVED_ON",
           "DFLASH_B16_TAU", "geometric_model", "acceptance_from_tau", "survival_from_taus", "model_from_survival",
           "dflash_like_model", "published_models"]
