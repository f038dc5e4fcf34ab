"""A loaded target readied for a run, in one place: :func:`prepare_target`.

The model has one forward (:class:`~refspec.models.transformer.Transformer`); what a run adds
around it is applied here, to the built model, in this order:

1. **tensor parallelism** (``tp``): the model is cut to this rank's share, an all-reduce after
   each row-parallel layer (:mod:`refspec.models.tp.shard`);
2. **CPU GEMM plan** (on a CPU): each linear layer takes the product form timed on this machine
   and keeps the weight copy it reads (:mod:`refspec.models.cpu_speed`);
3. **the step** the verify and plain decode forwards run through: the model itself, a compiled
   CPU step (``compile``, :mod:`refspec.models.compiled`) or CUDA graphs (``cuda_graphs``,
   :mod:`refspec.cuda_graphs`).

The result, a :class:`PreparedTarget`, is what the engine runs
(:class:`~refspec.target.TargetForward`): its forwards go through the step, prefill runs the
model eagerly, and the cache is the step's (the CUDA graphs' pool when there is one).
"""
from __future__ import annotations

from typing import Sequence

import torch

from refspec.cache import StaticKVCache
from refspec.config import ModelArgs
from refspec.cuda_graphs import GraphRunner
from refspec.models.calibration import REFERENCE, GemmPlan, resolve_plan
from refspec.models.compiled import CompiledStep, CompileError
from refspec.models.cpu_speed import plan_gemms
from refspec.models.tp.group import TensorParallel
from refspec.models.tp.plan import TPError
from refspec.models.tp.shard import shard_model
from refspec.models.transformer import Transformer


class PreparedTarget:
    """A model and the step its forwards run through (:class:`~refspec.target.TargetForward`).

    Build it with :func:`prepare_target`; build it directly to run a step made by hand (an
    eager-static :class:`~refspec.cuda_graphs.GraphRunner` on a CPU, a compile backend of one's own).

    Args:
        model: the model (after its transforms).
        step: what its forwards run through and what makes their cache: called like the model's
            forward, with a ``new_cache`` (default: the model).
        cpu_plan: the CPU GEMM plan its linear layers follow (:data:`~refspec.models.calibration.REFERENCE`:
            none).
    """

    def __init__(self, model: Transformer, *, step: Transformer | GraphRunner | CompiledStep | None = None,
                 cpu_plan: GemmPlan = REFERENCE) -> None:
        self.model = model
        self.step = model if step is None else step
        self.cpu_plan = cpu_plan

    def __repr__(self) -> str:
        plan = self.cpu_plan.describe() or "reference"
        return f"PreparedTarget({self.model.args.family}, step={type(self.step).__name__}, cpu_plan={plan!r})"

    @property
    def args(self) -> ModelArgs:
        return self.model.args

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def num_layers(self) -> int:
        return self.model.num_layers

    def __call__(self, tokens: torch.Tensor | None, positions: torch.Tensor, cache: StaticKVCache, *,
                 slots: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                 sliding_mask: torch.Tensor | None = None, num_keys: int | None = None,
                 logits_at: torch.Tensor | None = None, hidden_layers: tuple[int, ...] = (),
                 inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """The model's forward through the step (see :meth:`refspec.target.TargetForward.__call__`)."""
        return self.step(tokens, positions, cache, slots=slots, mask=mask, sliding_mask=sliding_mask,
                         num_keys=num_keys, logits_at=logits_at, hidden_layers=hidden_layers,
                         inputs_embeds=inputs_embeds)

    def prefill(self, tokens: torch.Tensor, seq_lens: Sequence[int], cache: StaticKVCache, rows: torch.Tensor, *,
                hidden_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The model's packed prefill, eager (:meth:`refspec.models.transformer.Transformer.prefill`)."""
        return self.model.prefill(tokens, seq_lens, cache, rows, hidden_layers=hidden_layers)

    def new_cache(self, batch: int, max_len: int) -> StaticKVCache:
        """The step's cache: a view of the CUDA graphs' pool with graphs, else the model's own."""
        return self.step.new_cache(batch, max_len)


def prepare_target(model: Transformer, *, cpu_plan: GemmPlan | None = None, compile: bool = False,
                   cuda_graphs: bool = False, tp: TensorParallel | None = None) -> PreparedTarget:
    """Ready a loaded model for a run (in place, see the module docstring).

    Args:
        model: a loaded model (:func:`~refspec.models.loading.load_model`, or a rank's share from
            :func:`~refspec.models.tp.loading.load_sharded`).
        cpu_plan: the CPU GEMM plan (default: :func:`~refspec.models.calibration.resolve_plan`,
            which ``REFSPEC_GEMM_PLAN`` selects: the plan timed and cached on this machine, or
            ``reference``); off the CPU none is applied.
        compile: run the steps through ``torch.compile`` (CPU only).
        cuda_graphs: run the steps through captured CUDA graphs (CUDA only).
        tp: the tensor-parallel group this process is a rank of: a whole model is cut to its
            share, a share is kept (None: a single-device run).

    Returns:
        The :class:`PreparedTarget` the engine runs (its ``model`` is ``model``).

    Raises:
        CompileError: ``compile`` off the CPU, or together with ``cuda_graphs``.
        refspec.cuda_graphs.CudaGraphError: ``cuda_graphs`` off CUDA.
        TPError: ``compile`` with ``tp``, or a model the group cannot share.
    """
    if compile and cuda_graphs:
        raise CompileError("the compiled step is for CPUs and CUDA graphs are for GPUs: ask for one of them")
    if tp is not None and tp.size > 1:
        if compile:
            raise TPError(f"compile with --tp {tp.size}: the compiled CPU step traces no collectives")
        shard_model(model, tp)
    plan = REFERENCE
    if model.device.type == "cpu":
        plan = plan_gemms(model, resolve_plan(model.dtype) if cpu_plan is None else cpu_plan)
    step: GraphRunner | CompiledStep | None = None
    if compile:
        step = CompiledStep(model)
    elif cuda_graphs:
        step = GraphRunner(model, capture=True)
    return PreparedTarget(model, step=step, cpu_plan=plan)


__all__ = ["PreparedTarget", "prepare_target"]
