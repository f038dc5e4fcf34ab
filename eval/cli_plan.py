"""The checks of ``python -m refspec.eval`` that need torch or the drafter registry (they run after
the torch-free ones of :mod:`refspec.eval.cli_checks`), ending in a :class:`Plan` of configurations.
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from refspec.eval.cli_args import CORE_CORPORA, DEFAULT_BATCH, DEFAULT_RUN_CELLS, SCHEDULES
from refspec.eval.cli_checks import check_drafter_options, check_run_flags, csv, parse_drafter_options
from refspec.eval.flags import UsageError, finite, integer

if TYPE_CHECKING:
    import torch


def _check_corpora(names: Sequence[str]) -> list[str]:
    from refspec.eval.corpora.catalog import CORPORA

    out: list[str] = []
    for name in names:
        if name == "all":
            out += [c for c in CORE_CORPORA if c not in out]
            continue
        if name in CORPORA or name.startswith("hf:"):
            out.append(name)
            continue
        if name.startswith("mixed:"):  # requests of several corpora interleaved (refspec.eval.mixed_corpus)
            from refspec.eval.mixed_corpus import check_mixed

            try:
                out.append(check_mixed(name, CORPORA))
            except ValueError as exc:
                raise UsageError(f"--corpus {exc}") from None
            continue
        path = Path(name).expanduser()
        if path.suffix in (".jsonl", ".json") or "/" in name:
            try:
                with open(path, "rb") as fh:
                    fh.read(1)
            except OSError as exc:
                raise UsageError(f"--corpus {name}: cannot read prompt file: {exc.strerror or exc}") from None
            out.append(str(path))
            continue
        raise UsageError(f"--corpus {name!r} is unknown; built-in corpora: {', '.join(CORPORA)}, all "
                         f"({', '.join(CORE_CORPORA)}), or a .jsonl file with a 'prompt' field per line")
    return list(dict.fromkeys(out))


def _check_drafters(names: Sequence[str], options: Sequence[tuple[str, str]]) -> list[str]:
    """Known drafters only; a plug-in class without ``from_context`` must accept the options given."""
    import inspect

    from refspec.drafters import registry
    from refspec.drafting import DrafterError

    known = registry.available()
    for name in names:
        if registry.is_plugin(name):
            try:
                cls = registry.resolve(name)  # import and protocol check now, before any model loads
            except DrafterError as exc:
                raise UsageError(f"--drafter {name}: {exc}") from exc
            if not hasattr(cls, "from_context"):
                try:
                    inspect.signature(cls).bind(**dict(options))
                except TypeError:
                    raise UsageError(f"--drafter-option {sorted(k for k, _ in options)}: {name} takes "
                                     f"{list(inspect.signature(cls).parameters) or 'no options'}") from None
                except ValueError:  # no signature to check: the build decides
                    pass
        elif name != "none" and name not in known:
            raise UsageError(f"--drafter {name!r} is unknown; available in this installation: none, "
                             f"{', '.join(known) or '(no drafter modules)'}, or MODULE:CLASS")
    return list(dict.fromkeys(names))


def _check_accept_model(spec: str | None) -> None:
    if spec is None:
        return
    from refspec.eval.injection import BUILTIN, load_acceptance_models

    if spec in BUILTIN or spec.startswith("geometric:"):
        return
    path = Path(spec)
    if not path.exists():
        raise UsageError(f"--accept-model {spec!r}: not a built-in ({', '.join(BUILTIN)}, geometric:A) and no such "
                         f"file")
    try:
        load_acceptance_models(path)
    except OSError as exc:
        raise UsageError(f"--accept-model {spec}: cannot read it: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UsageError(f"--accept-model {spec}: {exc}") from None


def _resolve_dtype(name: str, device: torch.device) -> str:
    name = name.lower()
    if name == "auto":  # fp32 on a CPU: exact greedy equality with the baseline (bf16 products flip near-ties)
        return "bf16" if device.type == "cuda" else "fp32"
    aliases = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    name = aliases.get(name, name)
    if name not in ("fp32", "bf16", "fp16"):
        raise UsageError(f"--dtype {name!r} is unknown; use auto, fp32, bf16 or fp16")
    return name


def _cuda_graphs(flag: bool | None, device: torch.device) -> bool:
    """Resolve ``--cuda-graphs``: refspec.cuda_graphs decides where present; eager where absent."""
    import importlib.util

    if importlib.util.find_spec("refspec.cuda_graphs") is None:
        if flag:
            raise UsageError("--cuda-graphs: refspec.cuda_graphs is not available in this installation")
        return False
    from refspec.cuda_graphs import cuda_graphs_enabled

    return cuda_graphs_enabled(flag, device)


@dataclasses.dataclass
class Plan:
    """A validated invocation: the session settings and the configurations to run."""

    session_kwargs: dict[str, Any]
    configs: list[Any]
    out_dir: Path | None


def _check_meter_device(meter: str, device: "torch.device") -> None:
    import torch

    kind = meter.partition(":")[0]
    if kind in ("zeus", "nvml") and (device.type != "cuda" or not torch.cuda.is_available()):
        raise UsageError(f"--meter {kind} reads an NVIDIA GPU's energy counter (NVML) and this run has no GPU; use "
                         f"--meter roofline (modelled energy), rapl (a CPU's counter) or time")


def check_serving_flags(args: argparse.Namespace, *, sweep: bool) -> list[str]:
    """``--schedule``, ``--requests`` and ``--request-rate`` (torch-free); returns the schedules."""
    schedules = csv("--schedule", args.schedule)
    bad = [x for x in schedules if x not in SCHEDULES]
    if bad or (len(schedules) > 1 and not sweep):
        raise UsageError(f"--schedule {args.schedule!r}: use {' or '.join(SCHEDULES)}"
                         + ("" if sweep else " (a sweep takes several, comma-separated)"))
    from refspec.eval.requests import LengthDist

    try:
        LengthDist.parse(args.output_len_dist)
    except ValueError as exc:
        raise UsageError(f"--output-len-dist: {exc}") from None
    if args.requests is not None:
        integer("--requests", args.requests, low=1, high=10_000_000, fix="the number of requests a run serves")
    if args.request_rate is not None:
        finite("--request-rate", args.request_rate, low=0, low_open=True, fix="requests per second, e.g. 2.5")
        if "static" in schedules:
            raise UsageError("--request-rate is open-loop arrivals into freed slots; --schedule static runs "
                             "lockstep batches with no arrivals: drop one of them")
    return list(dict.fromkeys(schedules))


def _check_policies(flag: str | list[str] | None) -> tuple[str, ...]:
    """``--spec-policy`` (torch-free): the canonical specs, ``fixed`` when none is given."""
    from refspec.eval.policy_setup import checked_spec

    specs = [flag] if isinstance(flag, str) else list(flag or ["fixed"])
    return tuple(dict.fromkeys(checked_spec(s).name for s in specs))


def _cells(args: argparse.Namespace, batches: list[int]) -> list[tuple[list[str], tuple[int, ...]]]:
    """The (corpora, batches) grids of the invocation: ``run`` without --batch and --corpus runs its
    default cells, each corpus at its own batch; otherwise one grid."""
    if args.corpus is None and not batches:
        return [([corpus], (batch,)) for corpus, batch in DEFAULT_RUN_CELLS]
    names = csv("--corpus", args.corpus) if args.corpus is not None else [c for c, _ in DEFAULT_RUN_CELLS]
    return [(names, tuple(batches or [DEFAULT_BATCH]))]


def build_plan(args: argparse.Namespace, *, sweep: bool) -> Plan:
    """Every flag checked (torch-free ones first), then the configurations of the invocation."""
    schedules = check_serving_flags(args, sweep=sweep)
    batches, ks = check_run_flags(args, sweep=sweep)
    policies = _check_policies(args.spec_policy)
    cells = _cells(args, batches)
    corpora = _check_corpora([c for names, _ in cells for c in names])  # before torch: the catalogue is light
    from refspec.drafters import registry
    from refspec.eval.run_config import RunConfig
    from refspec.eval.runtime import pick_device
    from refspec.eval.sweep import SweepGrid, plan

    device = pick_device(args.device)
    dtype = _resolve_dtype(args.dtype, device)
    _check_meter_device(args.meter, device)
    options = parse_drafter_options(args.drafter_option, args.draft_model)
    drafters = _check_drafters(csv("--drafter", args.drafter), options)
    check_drafter_options(drafters, options)
    _check_accept_model(args.accept_model)
    graphs = _cuda_graphs(args.cuda_graphs, device)
    default_k = {d: (16 if args.tree else registry.default_k(d)) for d in drafters if d != "none"}
    base = RunConfig(model=args.model, drafter="none", k=0, batch=cells[0][1][0], corpus=corpora[0],
                     num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, dtype=dtype,
                     device=str(device), meter=args.meter, temperature=args.temperature, top_k=args.top_k,
                     top_p=args.top_p, seed=args.seed, cuda_graphs=graphs, chat=not args.no_chat,
                     schedule=schedules[0], requests=args.requests, request_rate=args.request_rate,
                     output_len_dist=args.output_len_dist, tp=args.tp)
    configs = [c for names, cell_batches in cells
               for c in plan(SweepGrid(corpora=tuple(_check_corpora(names)), batches=cell_batches,
                                       drafters=tuple(drafters), ks=None if ks is None else tuple(ks), base=base,
                                       baseline=not args.no_baseline, default_k=default_k,
                                       schedules=tuple(schedules), policies=policies))]
    extra = dict(tree=args.tree, accept_model=args.accept_model, drafter_options=options)
    configs = [c if c.is_baseline else dataclasses.replace(c, **extra) for c in configs]
    if not configs:
        raise UsageError("nothing to run: --no-baseline leaves no configuration (add --drafter NAME or --k >= 1)")
    session_kwargs = dict(model=args.model, dtype=dtype, device=device, meter=args.meter, cuda_graphs=args.cuda_graphs,
                          compile_step=args.compile, phase_loops_s=args.phase_loops_s, tp=args.tp,
                          warmup=not args.no_warmup, chat=not args.no_chat, progress=not args.no_progress)
    return Plan(session_kwargs=session_kwargs, configs=configs, out_dir=args.out)
