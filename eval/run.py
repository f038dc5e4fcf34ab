"""Running one evaluation configuration: engine, meter and ledger; the configuration's record.

A :class:`RunConfig` names everything that changes a figure (model, drafter, K, batch,
corpus, budget, dtype, device, meter, sampling, seed, injection). A :class:`Session` holds
what configurations share: the loaded target and tokenizer, the energy meter, the verify
callable (eager or CUDA graphs), built drafters and encoded prompts.
:func:`run_configuration` runs one configuration and returns its record, a flat JSON-ready
dict (the ``records.jsonl`` / ``summary.json`` schema, :data:`RECORD_FIELDS`).

Batching: with batch B and N prompts a configuration runs ``ceil(N / B)`` batches of exactly B
rows; prompts repeat cyclically to fill the rows (``prompts_unique`` N, ``rows``
``ceil(N / B) * B``), because batch size is the independent variable of the paper.

Every batch is one ledger run (``run_id`` ``<config id>.<attempt>.b<i>``, appended to the
ledger file with flush). The record's figures come only from the ledger records this
configuration wrote, read back from disk: each batch run is accounted by
:func:`refspec.accounting.account`, and the batches are pooled by :func:`pool_accountings`
(sums of time, energy and counts; J/token = energy / emitted tokens; TPOT percentiles over the
rows of every batch; tau = (accepted + row-steps) / row-steps).
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import platform
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from refspec import __version__
from refspec.accounting import Accounting, account
from refspec.phases import PhaseEvent
from refspec.eval.runtime import LoadedTarget, UsageError, load_target

log = logging.getLogger(__name__)

RECORD_VERSION = 1

RECORD_FIELDS: dict[str, str] = {
    # identity
    "record_version": "schema version of this record (int)",
    "status": '"ok" for a finished configuration',
    "config_id": "stable id of the configuration: <drafter>-k<K>-b<B>-<corpus>-<hash of config>",
    "config": "every setting that identifies the configuration (object, RunConfig fields)",
    "baseline_config_id": "config_id of the no-drafter configuration at the same batch and settings",
    "model": "model id or directory", "drafter": "drafter name; 'none' is the baseline", "k": "drafts per step",
    "tree": "EAGLE-2 dynamic tree (K is then the node budget)", "batch": "rows per batch B",
    "corpus": "corpus name or prompt file", "dtype": "fp32 | bf16 | fp16", "device": "torch device",
    "meter": "meter kind asked for", "temperature": "0 = greedy", "greedy": "greedy decoding (bool)",
    "seed": "seed of the sampling / injection generators", "cuda_graphs": "verify ran through CUDA graphs",
    "threads": "torch intra-op threads",
    # what ran
    "prompts_unique": "distinct prompts N", "rows": "rows decoded, ceil(N / B) * B (prompts repeat cyclically)",
    "batches": "batches run, ceil(N / B)", "max_new_tokens": "budget per row",
    "run_ids": "ledger run ids, one per batch", "ledger": "ledger file name (in the output directory)",
    # pooled accounting of the batches (refspec.accounting, then pool_accountings)
    "emitted": "output tokens", "drafted": "draft tokens proposed", "accepted": "draft tokens accepted",
    "row_steps": "active row-steps with a verify", "steps": "decode steps, summed over batches",
    "verified": "target positions verified", "rejected_positions": "verified positions refuted",
    "total_time_s": "metered time (s)", "prefill_time_s": "prefill time (s)", "phase_time_s": "time by phase (s)",
    "tokens_per_s": "emitted tokens / metered time",
    "tau": "acceptance length: (accepted + row-steps) / row-steps, bonus token included",
    "acceptance_rate": "accepted / drafted", "rows_with_tpot": "rows that emitted at least two tokens",
    "tpot_p50_s": "p50 over rows of time per output token per user (s)", "tpot_p99_s": "p99 of the same (s)",
    "total_energy_j": "energy of every phase (J); null without energy",
    "energy_per_token_j": "J per output token: all phases, prefill included, / emitted (only accepted count)",
    "phase_energy_j": "energy by phase (J)", "phase_share": "energy share by phase",
    "line_items_j": "prefill, draft kept/rejected, verify useful/rejected, commit, other (J)",
    "rejected_energy_j": "J spent on refuted drafts", "closes": "line items sum to the total",
    "idle_w": "idle power for net-of-idle figures (W)", "net_energy_j": "energy net of idle (J)",
    "net_energy_per_token_j": "J/token net of idle power (null without idle power)",
    "energy_source": "ledger source string(s): measured:<counter> | modelled:roofline(<profile>) | none:time-only",
    "energy_measured": "true only when every figure came from an energy counter",
    "energy_source_text": "the source in words", "time_source": "measured (wall clock) | modelled (roofline)",
    # comparisons and provenance
    "roofline": "analytic (modelled) J/token and TPOT of a steady-state step of the same configuration",
    "baseline": "the baseline's figures (config_id, tau, tokens_per_s, TPOT, J/token, source, phases)",
    "energy_saving_vs_baseline": "1 - J/token / baseline J/token (negative: speculation costs energy)",
    "speedup_vs_baseline": "tokens/s / baseline tokens/s",
    "greedy_match_baseline": "greedy outputs equal the baseline's token for token (null: not comparable)",
    "greedy_rows_matching": "rows whose output equals the baseline's",
    "acceptance_injected": "acceptance drawn from a recorded distribution: outputs are not the model's",
    "injection": "the injected model and its label (refspec.injection.injection_record)",
    "output_digest": "sha256 over every row's tokens", "row_digests": "sha256 prefix of each row's tokens",
    "versions": "refspec, Python and library versions", "wall_s": "wall time of the configuration (s)",
    "created_unix_s": "when it finished (s since the epoch)",
}
"""Fields of a configuration record, name -> description."""


# ---- configuration --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything that identifies one configuration (built only at the CLI edge).

    Attributes:
        model: model id (``refspec.assets``) or Hugging Face directory.
        drafter: registered drafter name, or ``"none"`` for plain decoding.
        k: drafts per step (0 for ``none``; a tree's node budget with ``tree``).
        batch: rows per batch B.
        corpus: built-in corpus name or prompt file.
        num_prompts: prompts taken from the corpus's eval split (fewer if it has fewer).
        max_new_tokens: budget per row.
        dtype: ``fp32``, ``bf16`` or ``fp16`` (resolved, never ``auto``).
        device: torch device string (resolved).
        meter: meter kind (``auto``, ``zeus``, ``roofline``, ``roofline:<profile>``, ``time``).
        temperature / top_k / top_p: sampling (temperature 0 is greedy).
        seed: seed of the sampling and injection generators.
        tree: EAGLE-2 dynamic tree drafting.
        cuda_graphs: verify through CUDA graphs (resolved).
        accept_model: injected acceptance model name or file, or None.
        drafter_options: extra drafter options, sorted ``(key, value)`` pairs.
        chat: render chat prompts with the chat template.
    """

    model: str
    drafter: str
    k: int
    batch: int
    corpus: str
    num_prompts: int
    max_new_tokens: int
    dtype: str
    device: str
    meter: str = "auto"
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    tree: bool = False
    cuda_graphs: bool = False
    accept_model: str | None = None
    drafter_options: tuple[tuple[str, str], ...] = ()
    chat: bool = True

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise UsageError(f"batch must be >= 1, got {self.batch}")
        if self.num_prompts < 1:
            raise UsageError(f"num-prompts must be >= 1, got {self.num_prompts}")
        if self.max_new_tokens < 1:
            raise UsageError(f"max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.k < 0:
            raise UsageError(f"k must be >= 0, got {self.k}")
        if (self.drafter == "none") != (self.k == 0):
            raise UsageError(f"drafter {self.drafter!r} with k={self.k}: k = 0 means no drafter (the baseline)")
        if self.accept_model is not None and self.drafter == "none":
            raise UsageError("--accept-model injects acceptance of drafts; it needs a drafter and k >= 1")
        if self.accept_model is not None and self.tree:
            raise UsageError("--accept-model injects chain acceptance only; drop --tree")

    @property
    def is_baseline(self) -> bool:
        return self.drafter == "none"

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def identity(self) -> dict[str, Any]:
        """The JSON-ready settings that identify the configuration."""
        d = dataclasses.asdict(self)
        d["drafter_options"] = {k: v for k, v in self.drafter_options}
        return d

    @property
    def config_id(self) -> str:
        """``<drafter>-k<K>-b<B>-<corpus>-<hash>``: readable, and unique per identity."""
        digest = hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()[:10]
        corpus = Path(self.corpus).stem if ("/" in self.corpus or self.corpus.endswith(".jsonl")) else self.corpus
        tree = "-tree" if self.tree else ""
        inj = "-injected" if self.accept_model else ""
        return f"{self.drafter}-k{self.k}{tree}-b{self.batch}-{corpus}{inj}-{digest}"

    @property
    def label(self) -> str:
        """Short label for tables and progress bars."""
        if self.is_baseline:
            return f"none b{self.batch}"
        return f"{self.drafter}{' tree' if self.tree else ''} k{self.k} b{self.batch}"

    def baseline(self) -> "RunConfig":
        """The no-drafter configuration at the same batch, corpus, budget and settings."""
        return dataclasses.replace(self, drafter="none", k=0, tree=False, accept_model=None, drafter_options=())


# ---- dtype and hardware ---------------------------------------------------------------------
def cpu_has_fast_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has native bf16 matrix instructions (``avx512_bf16`` or AMX).

    Args:
        cpuinfo: contents of ``/proc/cpuinfo`` (read when None; False when unreadable).
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags: set[str] = set()
    for line in cpuinfo.split("\n"):
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def auto_dtype(device: torch.device, cpuinfo: str | None = None) -> str:
    """``bf16`` on CUDA and on CPUs with native bf16 (avx512_bf16/AMX), else ``fp32``.

    Without native bf16 a CPU emulates it and runs slower than fp32.
    """
    if device.type == "cuda":
        return "bf16"
    return "bf16" if cpu_has_fast_bf16(cpuinfo) else "fp32"


def library_versions() -> dict[str, str]:
    """refspec, Python and the libraries behind a figure (``not installed`` where absent)."""
    out = {"refspec": __version__, "python": platform.python_version(), "torch": torch.__version__}
    for dist in ("numpy", "tokenizers", "transformers", "safetensors", "zeus", "datasets"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


def describe_source(source: str) -> str:
    """An energy source string in words, never presenting a model as a measurement."""
    if source.startswith("measured:"):
        return f"measured by counter {source.split(':', 1)[1]}"
    if source.startswith("modelled:roofline("):
        inner = source[len("modelled:roofline("):].rstrip(")")
        profile, _, mode = inner.partition(",")
        how = "on measured wall time" if mode == "wall-time" else "on modelled time"
        return f"modelled (not measured) by roofline profile {profile}, {how}"
    if source.startswith("none"):
        return "not recorded (time-only meter)"
    return f"unknown source {source!r}"


# ---- the session ----------------------------------------------------------------------------
class Session:
    """What the configurations of one invocation share.

    Args:
        model: model id or directory.
        dtype: resolved dtype name.
        device: torch device.
        meter: meter kind (see :class:`RunConfig`).
        cuda_graphs: the ``--cuda-graphs`` flag (None: on for CUDA, off elsewhere).
        warmup: run a short unrecorded generation before the first measurement of each
            (drafter, K, batch), so one-time allocation does not land in the ledger.
        chat: render chat-kind prompts through the tokenizer's chat template when it has one.
        progress: show progress bars (stderr).
    """

    def __init__(self, *, model: str, dtype: str, device: torch.device, meter: str = "auto",
                 cuda_graphs: bool | None = None, warmup: bool = True, chat: bool = True,
                 progress: bool = True) -> None:
        from refspec.eval.runtime import parse_dtype

        self.model_name = model
        self.dtype_name = dtype
        self.torch_dtype = parse_dtype(dtype)
        self.device = device
        self.meter_kind = meter
        self.cuda_graphs_flag = cuda_graphs
        self.warmup = warmup
        self.chat = chat
        self.progress = progress
        self._target: LoadedTarget | None = None
        self._meter: Any = None
        self._verify_fn: Any = None
        self._cuda_graphs: bool | None = None
        self._drafters: dict[tuple, Any] = {}
        self._prompts: dict[tuple, list[list[int]]] = {}
        self._warm: set[tuple] = set()

    # ---- shared objects -----------------------------------------------------------------------
    @property
    def target(self) -> LoadedTarget:
        """The loaded target (loaded on first use)."""
        if self._target is None:
            t0 = time.perf_counter()
            target = load_target(self.model_name, dtype=self.torch_dtype, device=self.device, progress=self.progress)
            if target.tokenizer is None:
                raise UsageError(f"{target.path} has no tokenizer.json; the evaluation encodes corpus prompts and "
                                 f"needs one")
            log.info("loaded %s (%s, %s) in %.1f s", self.model_name, self.dtype_name, self.device,
                     time.perf_counter() - t0)
            self._target = target
        return self._target

    @property
    def dtype_bytes(self) -> int:
        return torch.finfo(self.torch_dtype).bits // 8

    @property
    def meter(self) -> Any:
        """The energy meter every configuration is metered with."""
        if self._meter is None:
            from refspec.meters import make_meter

            kind, _, profile = self.meter_kind.partition(":")
            if kind not in ("auto", "zeus", "roofline", "time"):
                raise UsageError(f"unknown meter {self.meter_kind!r}; use auto, zeus, roofline, roofline:PROFILE "
                                 f"(cpu, h100, h200) or time")
            kwargs: dict[str, Any] = {"dtype_bytes": self.dtype_bytes}
            if profile:
                kwargs["profile"] = profile
            self._meter = make_meter(kind, **kwargs)  # type: ignore[arg-type]
            if hasattr(self._meter, "measure_idle_w") and getattr(self._meter, "idle_w", None) is None:
                self._meter.measure_idle_w(5.0)
            log.info("energy meter: %s", describe_source(self._meter.source))
        return self._meter

    @property
    def time_source(self) -> str:
        """``modelled`` when the meter models time (a roofline meter in model mode), else ``measured``."""
        return "modelled" if getattr(self.meter, "time_source", "measured") == "model" else "measured"

    @property
    def roofline_profile(self) -> Any:
        """The hardware profile for roofline predictions: the meter's, or the GPU's data sheet."""
        prof = getattr(self.meter, "profile", None)
        if prof is not None:
            return prof
        if self.device.type == "cuda":
            from refspec.roofline import GPU_PROFILES

            name = torch.cuda.get_device_name(self.device).lower()
            return next((p for key, p in GPU_PROFILES.items() if key in name), None)
        return None

    @property
    def cuda_graphs(self) -> bool:
        """Whether verify runs through CUDA graphs (resolved from the flag and the device)."""
        if self._cuda_graphs is None:
            if importlib.util.find_spec("refspec.cuda_graphs") is None:
                if self.cuda_graphs_flag:
                    raise UsageError("--cuda-graphs: refspec.cuda_graphs is not available in this installation")
                self._cuda_graphs = False
            else:
                from refspec.cuda_graphs import cuda_graphs_enabled

                self._cuda_graphs = cuda_graphs_enabled(self.cuda_graphs_flag, self.device)
        return self._cuda_graphs

    @property
    def verify_fn(self) -> Any:
        """The verify callable: a CUDA-graph runner when enabled, else the eager target."""
        if self._verify_fn is None:
            if self.cuda_graphs:
                from refspec.cuda_graphs import make_verify_fn

                self._verify_fn = make_verify_fn(self.target.model, self.device, True)
            else:
                self._verify_fn = self.target.model
        return self._verify_fn

    def drafter(self, cfg: RunConfig) -> Any:
        """The drafter of ``cfg`` (built once per name, tree flag and options), or None."""
        if cfg.is_baseline:
            return None
        key = (cfg.drafter, cfg.tree, cfg.k if cfg.tree else None, cfg.drafter_options)
        if key not in self._drafters:
            from refspec.drafters import registry

            options: dict[str, Any] = dict(cfg.drafter_options)
            if cfg.tree:
                options.update(tree="true", tree_budget=str(cfg.k))
            if cfg.accept_model and cfg.drafter == "ngram":
                options.setdefault("trim", "false")  # an injected acceptance distribution is per full K
            ctx = registry.DrafterContext(target=self.target.model, target_name=self.model_name,
                                          tokenizer_fingerprint=self.target.fingerprint, dtype=self.torch_dtype,
                                          device=self.device, options=options)
            self._drafters[key] = registry.build(cfg.drafter, ctx)
        return self._drafters[key]

    def prompts(self, corpus: str, num_prompts: int) -> list[list[int]]:
        """Token ids of the first ``num_prompts`` eval prompts of ``corpus``."""
        key = (corpus, num_prompts)
        if key not in self._prompts:
            from refspec.eval.corpora import build_prompts, load_corpus

            ds = load_corpus(corpus, split="eval")
            if len(ds) == 0:
                raise UsageError(f"corpus {corpus!r} has no eval prompts")
            if len(ds) < num_prompts:
                log.warning("corpus %s has %d eval prompts, fewer than --num-prompts %d; using all of them",
                            corpus, len(ds), num_prompts)
            rows = ds.select(range(min(num_prompts, len(ds))))
            tok = self.target.tokenizer
            chat = self.chat and bool(getattr(tok, "has_chat_template", False))
            self._prompts[key] = build_prompts(rows, tok, chat=chat)
        return self._prompts[key]

    def warm(self, engine: Any, cfg: RunConfig, prompts: Sequence[Sequence[int]]) -> None:
        """One short unrecorded generation at this (drafter, K, batch), once per session."""
        key = (cfg.drafter, cfg.k, cfg.tree, cfg.batch)
        if not self.warmup or key in self._warm:
            return
        self._warm.add(key)
        from refspec.engine import Engine

        quiet = Engine(engine.target, engine.drafter, config=engine.config, eos_token_ids=(),
                       verify_fn=engine.verify_fn)
        t0 = time.perf_counter()
        quiet.generate(list(prompts), max_new_tokens=min(4, cfg.max_new_tokens),
                       generator=torch.Generator(device=self.device).manual_seed(0))
        log.debug("warm-up of %s took %.2f s", cfg.label, time.perf_counter() - t0)


# ---- ledger plumbing ------------------------------------------------------------------------
class _Relay:
    """A phase observer that forwards to the current batch's ledger."""

    def __init__(self) -> None:
        self.target: Callable[[PhaseEvent], None] | None = None

    def __call__(self, event: PhaseEvent) -> None:
        if self.target is not None:
            self.target(event)


def ensure_line_end(path: Path) -> None:
    """Append a newline when ``path`` ends mid-line (a crash), so the next record starts clean."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell() == 0:
                return
            fh.seek(-1, os.SEEK_END)
            last = fh.read(1)
    except FileNotFoundError:
        return
    if last != b"\n":
        with open(path, "ab") as fh:
            fh.write(b"\n")


def ledger_records_since(path: Path, offset: int, run_ids: Sequence[str]) -> list[dict[str, Any]]:
    """Ledger records of ``run_ids`` written at or after byte ``offset`` of ``path``."""
    wanted = set(run_ids)
    out = []
    with open(path, "rb") as fh:
        fh.seek(offset)
        data = fh.read().decode("utf-8", errors="replace")
    for line in data.split("\n"):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            log.warning("skipping a corrupt ledger line in %s", path)
            continue
        if isinstance(rec, dict) and rec.get("run_id") in wanted:
            out.append(rec)
    return out


# ---- pooling batch accountings --------------------------------------------------------------
def _sum_dicts(dicts: Sequence[Mapping[str, float] | None]) -> dict[str, float] | None:
    if any(d is None for d in dicts):
        return None
    out: dict[str, float] = {}
    for d in dicts:
        for key, value in (d or {}).items():
            out[key] = out.get(key, 0.0) + float(value)
    return out


def pool_accountings(accs: Sequence[Accounting]) -> dict[str, Any]:
    """Pool the accountings of a configuration's batches into its headline figures.

    Times, energies and counts add; J/token = energy / emitted; tokens/s = emitted / time;
    tau = (accepted + row-steps) / row-steps; TPOT percentiles are taken over the rows of all
    batches (linear interpolation, as in :mod:`refspec.accounting`).
    """
    if not accs:
        raise ValueError("no batch accountings to pool")
    emitted = sum(a.emitted for a in accs)
    drafted = sum(a.drafted for a in accs)
    accepted = sum(a.accepted for a in accs)
    row_steps = sum(a.row_steps for a in accs)
    total_time = sum(a.total_time_s for a in accs)
    tpots = [t for a in accs for t in a.tpot_per_row_s if t is not None]
    energies = [a.total_energy_j for a in accs]
    has_energy = all(e is not None for e in energies)
    total_energy = float(sum(e for e in energies if e is not None)) if has_energy else None
    phase_energy = _sum_dicts([a.phase_energy_j for a in accs]) if has_energy else None
    net = [a.net_energy_j for a in accs]
    net_total = float(sum(n for n in net if n is not None)) if has_energy and all(n is not None for n in net) else None
    sources = sorted({s for a in accs for s in a.sources})
    return {
        "emitted": emitted, "drafted": drafted, "accepted": accepted, "row_steps": row_steps,
        "steps": sum(a.steps for a in accs),
        "verified": sum(a.verified for a in accs), "rejected_positions": sum(a.rejected_positions for a in accs),
        "total_time_s": total_time, "prefill_time_s": sum(a.prefill_time_s for a in accs),
        "phase_time_s": _sum_dicts([a.phase_time_s for a in accs]),
        "tokens_per_s": emitted / total_time if total_time else None,
        "tau": (accepted + row_steps) / row_steps if row_steps else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "rows_with_tpot": len(tpots),
        "tpot_p50_s": float(np.percentile(tpots, 50)) if tpots else None,
        "tpot_p99_s": float(np.percentile(tpots, 99)) if tpots else None,
        "total_energy_j": total_energy,
        "energy_per_token_j": total_energy / emitted if total_energy is not None and emitted else None,
        "phase_energy_j": phase_energy,
        "phase_share": ({p: e / total_energy for p, e in phase_energy.items()}
                        if phase_energy is not None and total_energy else None),
        "line_items_j": _sum_dicts([a.line_items_j for a in accs]) if has_energy else None,
        "rejected_energy_j": (sum(float(a.rejected_energy_j or 0.0) for a in accs) if has_energy else None),
        "closes": all(bool(a.closes) for a in accs) if has_energy else None,
        "idle_w": accs[0].idle_w,
        "net_energy_j": net_total,
        "net_energy_per_token_j": net_total / emitted if net_total is not None and emitted else None,
        "energy_source": ", ".join(sources),
        "energy_measured": all(a.measured for a in accs),
        "energy_source_text": "; ".join(describe_source(s) for s in sources),
    }


# ---- the roofline prediction ----------------------------------------------------------------
def acceptance_from_tau(tau: float, k: int) -> float:
    """Per-draft acceptance a whose expected tokens per step (1 - a^(k+1)) / (1 - a) equal tau."""
    from refspec.roofline import expected_tokens_per_step

    if k <= 0 or tau <= 1.0:
        return 0.0
    if tau >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_step(mid, k) < tau else (lo, mid)
    return (lo + hi) / 2


def _drafter_cost_model(cfg: RunConfig, drafter: Any) -> Any:
    """The roofline's cost model of a drafter, or None when none fits."""
    from refspec.roofline import EAGLE_HEAD, DrafterModel

    if cfg.drafter == "ngram":
        return DrafterModel(name="ngram", fraction=0.0)
    if cfg.drafter == "eagle":
        return EAGLE_HEAD
    if cfg.drafter == "eagle3":
        return DrafterModel(name="eagle3-1layer", layers=1, fc_inputs=3)
    if cfg.drafter == "block":
        layers = int(getattr(getattr(drafter, "head", None), "num_layers", 1) or 1)
        return DrafterModel(name="block", layers=layers, fc_inputs=0, parallel=True)
    args = getattr(getattr(drafter, "model", None), "args", None)
    if cfg.drafter == "draft-model" and args is not None:
        return DrafterModel(name="draft-model", args=args)
    return None


def roofline_prediction(session: Session, cfg: RunConfig, drafter: Any, prompts: Sequence[Sequence[int]],
                        tau: float | None) -> dict[str, Any] | None:
    """The analytic (modelled) J/token and TPOT of a steady-state step of ``cfg``, or None.

    Context is the mean prompt length plus half the budget; acceptance is the per-draft
    acceptance that reproduces the measured tau. Prefill is not part of the prediction.
    """
    from refspec.roofline import predict_step

    profile = session.roofline_profile
    if profile is None or cfg.tree:
        return None
    model = _drafter_cost_model(cfg, drafter) if not cfg.is_baseline else None
    if not cfg.is_baseline and model is None:
        return None
    context = int(sum(map(len, prompts)) / len(prompts) + cfg.max_new_tokens / 2)
    a = acceptance_from_tau(tau or 1.0, cfg.k)
    kwargs = {"drafter": model} if model is not None else {}
    p = predict_step(session.target.model.args, profile, batch=cfg.batch, k=cfg.k, context=context, acceptance=a,
                     dtype_bytes=session.dtype_bytes, **kwargs)
    return {"j_per_token": p.j_per_token, "tpot_s": p.tpot_s, "tokens_per_row": p.tokens_per_row,
            "acceptance": a, "context": context, "verify_compute_bound": p.verify_compute_bound,
            "profile": profile.name, "drafter_model": getattr(model, "name", None),
            "source": f"modelled:roofline({profile.name})", "includes_prefill": False}


# ---- one configuration ----------------------------------------------------------------------
@dataclasses.dataclass
class ConfigResult:
    """A finished configuration: its record and the generations behind it."""

    record: dict[str, Any]
    generations: list[Any]


def _digest(rows: Sequence[Sequence[int]]) -> tuple[str, list[str]]:
    per_row = [hashlib.sha256(json.dumps(list(r)).encode()).hexdigest()[:16] for r in rows]
    return hashlib.sha256("".join(per_row).encode()).hexdigest(), per_row


def compare_with_baseline(record: dict[str, Any], baseline: Mapping[str, Any] | None) -> None:
    """Fill ``record``'s baseline figures, saving, speed-up and greedy match (in place)."""
    if record.get("drafter") == "none":  # the baseline itself: nothing to compare with
        record.update(baseline=None, energy_saving_vs_baseline=None, speedup_vs_baseline=None,
                      greedy_match_baseline=None, greedy_rows_matching=None)
        return
    if baseline is None:
        record.setdefault("baseline", None)
        record.setdefault("greedy_match_baseline", None)
        return
    fields = ("config_id", "tau", "tokens_per_s", "tpot_p50_s", "tpot_p99_s", "energy_per_token_j",
              "energy_source", "phase_energy_j", "phase_share", "net_energy_per_token_j", "run_ids")
    record["baseline"] = {f: baseline.get(f) for f in fields}
    e, be = record.get("energy_per_token_j"), baseline.get("energy_per_token_j")
    record["energy_saving_vs_baseline"] = 1.0 - e / be if e is not None and be else None
    s, bs = record.get("tokens_per_s"), baseline.get("tokens_per_s")
    record["speedup_vs_baseline"] = s / bs if s and bs else None
    comparable = record.get("greedy") and not record.get("acceptance_injected") and not baseline.get(
        "acceptance_injected")
    if comparable and baseline.get("row_digests") and record.get("row_digests"):
        pairs = list(zip(record["row_digests"], baseline["row_digests"]))
        record["greedy_rows_matching"] = sum(a == b for a, b in pairs)
        record["greedy_match_baseline"] = record["output_digest"] == baseline.get("output_digest")
    else:
        record["greedy_match_baseline"] = None
        record["greedy_rows_matching"] = None


def _acceptance_injection(cfg: RunConfig, device: torch.device) -> tuple[Any, dict[str, Any] | None, str | None]:
    """The engine's acceptance_fn, the injection record and its label for ``cfg`` (Nones without injection)."""
    if cfg.accept_model is None:
        return None, None, None
    if importlib.util.find_spec("refspec.injection") is None:
        raise UsageError("--accept-model: refspec.injection is not available in this installation")
    from refspec.injection import injection_label, injection_record, make_acceptance_fn, resolve_acceptance_model

    model = resolve_acceptance_model(cfg.accept_model, k=cfg.k, drafter=cfg.drafter, corpus=cfg.corpus)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 7919)
    label = injection_label(model)
    log.info("%s", label)
    return make_acceptance_fn(model, gen), injection_record(model), label


def prepare_configuration(session: Session, cfg: RunConfig) -> None:
    """Load what ``cfg`` needs (prompts, drafter, injected model) so a bad setting fails before any run.

    Raises:
        UsageError, NoGPUError, DrafterError, AcceptanceModelError, CorpusError: what building them raises.
    """
    _ = session.meter  # a meter that cannot be built (zeus without a GPU) fails here
    session.prompts(cfg.corpus, cfg.num_prompts)
    session.drafter(cfg)
    _acceptance_injection(cfg, session.device)


def run_configuration(session: Session, cfg: RunConfig, *, ledger_path: Path,
                      baseline: Mapping[str, Any] | None = None) -> ConfigResult:
    """Run one configuration, append its ledger runs, and return its record.

    Args:
        session: the shared target, meter and caches.
        cfg: the configuration.
        ledger_path: JSONL ledger to append to (one run per batch).
        baseline: the baseline's record at the same batch, for the comparison fields.

    Returns:
        The record (see :data:`RECORD_FIELDS`) and the generations.
    """
    from refspec.engine import Engine, EngineConfig
    from refspec.ledger import Ledger
    from refspec.sampling import SamplingConfig

    t_start = time.perf_counter()
    target = session.target
    prompts = session.prompts(cfg.corpus, cfg.num_prompts)
    n = len(prompts)
    batches = math.ceil(n / cfg.batch)
    rows = [prompts[i % n] for i in range(batches * cfg.batch)]
    drafter = session.drafter(cfg)
    acceptance_fn, injection, inj_label = _acceptance_injection(cfg, session.device)
    sampling = SamplingConfig(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    relay = _Relay()
    engine = Engine(target.model, drafter, config=EngineConfig(k=cfg.k, sampling=sampling), meter=session.meter,
                    observers=[relay], eos_token_ids=target.eos_token_ids, verify_fn=session.verify_fn,
                    acceptance_fn=acceptance_fn)
    session.warm(engine, cfg, rows[: cfg.batch])

    ledger_path.parent.mkdir(parents=True, exist_ok=True)
    ensure_line_end(ledger_path)
    offset = ledger_path.stat().st_size if ledger_path.exists() else 0
    attempt = uuid.uuid4().hex[:6]
    labels = {**cfg.identity(), "config_id": cfg.config_id}
    run_ids: list[str] = []
    gens = []
    from tqdm.auto import tqdm

    budget = cfg.max_new_tokens
    with tqdm(total=len(rows) * budget, unit="tok", desc=cfg.label, file=sys.stderr, dynamic_ncols=True,
              disable=not session.progress, leave=False) as bar:
        for i in range(batches):
            chunk = rows[i * cfg.batch:(i + 1) * cfg.batch]
            run_id = f"{cfg.config_id}.{attempt}.b{i}"
            run_ids.append(run_id)
            counted = [0]

            def on_step(step: int, emitted: int, _counted: list[int] = counted) -> None:
                bar.update(emitted - _counted[0])
                _counted[0] = emitted

            engine.on_step = on_step
            gen_ = torch.Generator(device=session.device).manual_seed(cfg.seed + i)
            with Ledger(ledger_path, run_id=run_id, mode="a", meter_source=session.meter.source,
                        idle_w=getattr(session.meter, "idle_w", None),
                        labels={**labels, "batch_index": i, "batches": batches,
                                **({"acceptance_injected": True, "injection": inj_label} if inj_label else {})}
                        ) as ledger:
                relay.target = ledger
                g = engine.generate(chunk, max_new_tokens=budget, generator=gen_)
                relay.target = None
            gens.append(g)
            bar.update(len(chunk) * budget - counted[0])
            bar.set_postfix_str(f"tau {g.tau:.2f}" if drafter is not None else f"batch {i + 1}/{batches}")

    records = ledger_records_since(ledger_path, offset, run_ids)
    accs = [account(records, run_id=r) for r in run_ids]
    pooled = pool_accountings(accs)
    tokens = [t for g in gens for t in g.tokens]
    output_digest, row_digests = _digest(tokens)
    record: dict[str, Any] = {
        "record_version": RECORD_VERSION, "status": "ok", "config_id": cfg.config_id, "config": cfg.identity(),
        "baseline_config_id": cfg.baseline().config_id,
        "model": cfg.model, "drafter": cfg.drafter, "k": cfg.k, "tree": cfg.tree, "batch": cfg.batch,
        "corpus": cfg.corpus, "dtype": cfg.dtype, "device": cfg.device, "meter": cfg.meter,
        "temperature": cfg.temperature, "greedy": cfg.greedy, "seed": cfg.seed, "cuda_graphs": cfg.cuda_graphs,
        "prompts_unique": n, "rows": len(rows), "batches": batches, "max_new_tokens": budget,
        "run_ids": run_ids, "ledger": ledger_path.name, **pooled,
        "time_source": session.time_source, "threads": torch.get_num_threads(),
        "acceptance_injected": injection is not None, "injection": injection,
        "output_digest": output_digest, "row_digests": row_digests,
    }
    record["roofline"] = roofline_prediction(session, cfg, drafter, rows, pooled["tau"])
    compare_with_baseline(record, baseline)
    record["versions"] = library_versions()
    record["wall_s"] = time.perf_counter() - t_start
    record["created_unix_s"] = time.time()
    log.info("%s: tau %s, %.2f tok/s, J/token %s (%s)", cfg.label,
             "n/a" if pooled["tau"] is None else f"{pooled['tau']:.3f}", pooled["tokens_per_s"] or 0.0,
             "n/a" if pooled["energy_per_token_j"] is None else f"{pooled['energy_per_token_j']:.4g}",
             pooled["energy_source_text"])
    return ConfigResult(record=record, generations=gens)


__all__ = ["RunConfig", "Session", "ConfigResult", "run_configuration", "prepare_configuration", "pool_accountings",
           "compare_with_baseline", "auto_dtype", "cpu_has_fast_bf16", "describe_source", "library_versions",
           "acceptance_from_tau", "ensure_line_end", "RECORD_FIELDS"]
