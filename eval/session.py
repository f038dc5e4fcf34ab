"""What the configurations of one evaluation share: target, meter, verify callable, drafters, prompts.

A :class:`Session` loads each of them once, on first use, so a sweep of many configurations
loads the target once and meters every configuration with the same meter.
"""
from __future__ import annotations

import importlib.util
import logging
import time
from typing import TYPE_CHECKING, Any, Sequence

import torch

from refspec.eval.record_figures import describe_source
from refspec.eval.flags import UsageError
from refspec.eval.runtime import LoadedTarget, load_target

if TYPE_CHECKING:
    from refspec.eval.run_config import RunConfig

log = logging.getLogger(__name__)


class Session:
    """What the configurations of one invocation share.

    Args:
        model: model id or directory.
        dtype: resolved dtype name.
        device: torch device.
        meter: meter kind (see :class:`~refspec.eval.run_config.RunConfig`).
        cuda_graphs: the ``--cuda-graphs`` flag (None: on for CUDA, off elsewhere).
        compile_step: the ``--compile`` flag: verify through :class:`~refspec.models.compiled.CompiledStep`
            (where CUDA graphs do not run).
        phase_loops_s: seconds of each phase-isolated loop after a run metered by a counter
            (:mod:`refspec.phase_loops`): None ten counter periods (at least 1 s), 0 none.
        warmup: run a short unrecorded generation before the first measurement of each
            (drafter, K, batch), so one-time allocation does not land in the ledger.
        chat: render chat-kind prompts through the tokenizer's chat template when it has one.
        progress: show progress bars (stderr).
        tp: tensor-parallel ranks (``--tp``): this rank loads its share of the target and meters its own
            device (:mod:`refspec.eval.tp_launch`); no phase loops then.
    """

    def __init__(self, *, model: str, dtype: str, device: torch.device, meter: str = "auto",
                 cuda_graphs: bool | None = None, warmup: bool = True, chat: bool = True,
                 progress: bool = True, compile_step: bool = False, phase_loops_s: float | None = None,
                 tp: int = 1) -> None:
        from refspec.eval.runtime import parse_dtype

        self.model_name = model
        self.dtype_name = dtype
        self.torch_dtype = parse_dtype(dtype)
        self.device = device
        self.meter_kind = meter
        self.cuda_graphs_flag = cuda_graphs
        self.compile_step = compile_step
        self.warmup = warmup
        self.phase_loops_s = phase_loops_s if tp == 1 else 0  # a counter meter's loops per phase: None auto, 0 none
        self.tp = tp
        self.chat = chat
        self.progress = progress
        self._target: LoadedTarget | None = None
        self._meter: Any = None
        self._cuda_graphs: bool | None = None
        self._drafters: dict[tuple, Any] = {}
        self._prompts: dict[tuple, Any] = {}
        self._streams: dict[tuple, Any] = {}
        self._warm: set[tuple] = set()

    # ---- shared objects -----------------------------------------------------------------------
    @property
    def target(self) -> LoadedTarget:
        """The loaded target (loaded on first use)."""
        if self._target is None:
            t0 = time.perf_counter()
            target = load_target(self.model_name, dtype=self.torch_dtype, device=self.device, progress=self.progress,
                                 tp=self.tp, compile=self.compile_step and not self.cuda_graphs,
                                 cuda_graphs=self.cuda_graphs)
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
            from refspec.energy.meters.make import make_meter

            try:  # the whole --meter spec (refspec.energy.meters.spec) goes through
                if self.tp > 1:  # each rank its own device, every rank's figures in the ledger
                    from refspec.eval.tp_launch import tp_meter

                    self._meter = tp_meter(self.meter_kind, self.dtype_bytes)
                else:
                    self._meter = make_meter(self.meter_kind, dtype_bytes=self.dtype_bytes)
            except ValueError as exc:  # a spec, profile or sub-window that does not fit
                raise UsageError(f"--meter {self.meter_kind!r}: {exc}") from None
            if hasattr(self._meter, "measure_idle_w") and getattr(self._meter, "idle_w", None) is None:
                self._meter.measure_idle_w(5.0)
            log.info("energy meter: %s", describe_source(self._meter.source))
        return self._meter

    @property
    def time_source(self) -> str:
        """``modelled`` when the meter models time (a roofline meter in model mode), else ``wall-clock``."""
        return "modelled" if getattr(self.meter, "time_source", "wall_time") == "model" else "wall-clock"

    @property
    def roofline_profile(self) -> Any:
        """The hardware profile for roofline predictions: the meter's, or the GPU's data sheet."""
        prof = getattr(self.meter, "profile", None)
        if prof is not None:
            return prof
        if self.device.type == "cuda":
            from refspec.energy.model.hardware import GPU_PROFILES

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

    def prompt_set(self, corpus: str, wanted: int, cap: int | None = None) -> Any:
        """Up to ``min(wanted, cap)`` distinct eval prompts of ``corpus`` with their reference answers'
        lengths (:func:`refspec.eval.prompt_sets.corpus_prompt_set`)."""
        key = (corpus, wanted, cap)
        if key not in self._prompts:
            from refspec.eval.prompt_sets import corpus_prompt_set

            tok = self.target.tokenizer
            chat = self.chat and bool(getattr(tok, "has_chat_template", False))
            try:
                self._prompts[key] = corpus_prompt_set(corpus, tok, chat=chat, wanted=wanted, cap=cap)
            except ValueError as exc:
                if "no eval prompts" in str(exc):
                    raise UsageError(str(exc)) from None
                raise
        return self._prompts[key]

    def prompts(self, corpus: str, wanted: int, cap: int | None = None) -> list[list[int]]:
        """The token ids of :meth:`prompt_set`'s prompts."""
        return self.prompt_set(corpus, wanted, cap).prompts

    def stream(self, cfg: RunConfig) -> Any:
        """The request stream of ``cfg`` (:func:`refspec.eval.requests.build_stream`), built once per
        stream setting: a configuration and its baseline serve the same requests, budgets and arrivals.

        Raises:
            UsageError: ``--output-len-dist reference`` on prompts without reference answers.
        """
        from refspec.eval.requests import LengthDist, build_stream

        key = (cfg.corpus, cfg.num_requests, cfg.num_prompts, cfg.max_new_tokens, cfg.output_len_dist, cfg.seed,
               cfg.request_rate)
        if key not in self._streams:
            prompt_set = self.prompt_set(cfg.corpus, cfg.num_requests, cfg.num_prompts)
            try:
                self._streams[key] = build_stream(prompt_set, cfg.num_requests, max_new_tokens=cfg.max_new_tokens,
                                                  dist=LengthDist.parse(cfg.output_len_dist), rate=cfg.request_rate,
                                                  seed=cfg.seed)
            except ValueError as exc:
                raise UsageError(f"--corpus {cfg.corpus}: {exc}") from None
        return self._streams[key]

    def warm(self, engine: Any, cfg: RunConfig, prompts: Sequence[Sequence[int]]) -> None:
        """One short unrecorded run at this (drafter, K, batch, schedule), once per session: a
        static batch, or a continuous stream one request longer than the batch (so a refill runs)."""
        key = (cfg.drafter, cfg.k, cfg.tree, cfg.batch, cfg.schedule)
        if not self.warmup or key in self._warm:
            return
        self._warm.add(key)
        from refspec.engine import Engine
        from refspec.serving import Request

        quiet = Engine(engine.target, engine.drafter, config=engine.config, eos_token_ids=())
        t0 = time.perf_counter()
        gen = torch.Generator(device=self.device).manual_seed(0)
        budget = min(4, cfg.max_new_tokens)
        if cfg.schedule == "continuous":
            n = cfg.batch + 1
            quiet.serve([Request(id=i, prompt=tuple(prompts[i % len(prompts)]), max_new_tokens=budget)
                         for i in range(n)], batch=cfg.batch, generator=gen)
        else:
            quiet.generate([list(prompts[i % len(prompts)]) for i in range(cfg.batch)], max_new_tokens=budget,
                           generator=gen)
        log.debug("warm-up of %s took %.2f s", cfg.label, time.perf_counter() - t0)


__all__ = ["Session"]
