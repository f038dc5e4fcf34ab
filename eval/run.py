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
:func:`refspec.energy.accounting.account`, and the batches are pooled by :func:`pool_accountings`
(sums of time, energy and counts; J/token = energy / emitted tokens; TPOT percentiles over the
rows of every batch; tau = (accepted + row-steps) / row-steps). The record's fields, the
pooling, the roofline prediction and the baseline comparison are in :mod:`refspec.eval.records`
(re-exported here).
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import platform
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from refspec import __version__
from refspec.energy.accounting import account
from refspec.energy.phases import PhaseEvent
from refspec.eval.runtime import LoadedTarget, UsageError, load_target
from refspec.eval.records import (RECORD_FIELDS, RECORD_VERSION, _digest, acceptance_from_tau, compare_with_baseline,
                                 describe_source, ensure_line_end, ledger_records_since, pool_accountings,
                                 roofline_prediction)

log = logging.getLogger(__name__)




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
            from refspec.energy.meters import make_meter

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
            from refspec.energy.roofline import GPU_PROFILES

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


# ---- one configuration ----------------------------------------------------------------------
@dataclasses.dataclass
class ConfigResult:
    """A finished configuration: its record and the generations behind it."""

    record: dict[str, Any]
    generations: list[Any]


def _acceptance_injection(cfg: RunConfig, device: torch.device) -> tuple[Any, dict[str, Any] | None, str | None]:
    """The engine's acceptance_fn, the injection record and its label for ``cfg`` (Nones without injection)."""
    if cfg.accept_model is None:
        return None, None, None
    if importlib.util.find_spec("refspec.eval.injection") is None:
        raise UsageError("--accept-model: refspec.eval.injection is not available in this installation")
    from refspec.eval.injection import injection_label, injection_record, make_acceptance_fn, resolve_acceptance_model

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
    from refspec.energy.ledger import Ledger
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
