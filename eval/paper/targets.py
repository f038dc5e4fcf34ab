"""Targets, their runners and drafters; on a CPU, toy forwards priced at the real shapes.

On a GPU a target is a random-weight model of the real architecture (bf16, built in place),
run through a :class:`~refspec.cuda_graphs.GraphRunner` that captures its verify steps. Its
drafters are the real drafters' code at real shapes with random heads: ``eagle`` an EAGLE-1
chain head (one decoder layer, ``fc`` 2E -> E, the target's LM head), ``block`` a DFlash-like
block head (:data:`BLOCK_LAYERS` decoder layers over fused target features, block size 16, plain
embeddings in its slots). Acceptance is injected, so what they propose does not matter; what
they cost does.

On a CPU the same code runs a toy of the same family (:data:`TOY`: E 32, two layers, V 256),
eager-static through the same runner (its block head one layer, priced as
:data:`BLOCK_LAYERS`), and :class:`RealShapes` rewrites the work every forward
reports into the real architecture's before the meter and the ledger see it: the target's
forwards become the real target's (all its layers, its vocabulary, bf16), a head's forwards a
head layer of the real width. The sizes a forward depends on (rows, query tokens, keys, pairs)
are the run's own, so the modelled energy is that of the real shapes stepping exactly as the
engine stepped. The heads' extra matrices (``fc``, fusion) scale with (E / e)^2, an
approximation for their few terms linear in E (feature reads).
"""
from __future__ import annotations

import dataclasses
import gc
import logging
from typing import Any

import torch

from refspec.energy.ledger.events import PhaseEvent
from refspec.energy.model.work import ForwardShape
from refspec.eval.paper.grid import DrafterSpec

log = logging.getLogger("refspec.eval.paper")

TOY = {"hidden_size": 32, "num_layers": 2, "vocab_size": 256, "head_dim": 8}
"""Shrunk sizes of a CPU run's toy targets (:func:`refspec.models.random_models.shrunk_config`)."""
BLOCK_SIZE = 16
BLOCK_LAYERS = 5  # a DFlash draft for an 8B target has five decoder layers
REAL_DTYPE_BYTES = 2  # the GPU runs bf16


class RealShapes:
    """Maps a toy's reported work to the real architecture's (see the module docstring).

    Args:
        toy: the toy target's ``ModelArgs``.
        real: the real architecture's ``ModelArgs``.
    """

    def __init__(self, toy: Any, real: Any) -> None:
        self.toy, self.real = toy, real
        self.scale2 = (real.hidden_size / toy.hidden_size) ** 2
        self.deeper: list[tuple[Any, int]] = []  # (toy head args, the real head's layers)

    def run_as(self, toy_args: Any, layers: int) -> None:
        """Price the forwards of a toy head of ``toy_args`` as a head of ``layers`` layers."""
        self.deeper.append((toy_args, layers))

    def args(self, a: Any) -> Any:
        if a == self.toy:
            return self.real
        return dataclasses.replace(self.real, num_layers=a.num_layers, layer_types=(), sliding_window=None,
                                   vocab_size=self.real.vocab_size if a.vocab_size == self.toy.vocab_size
                                   else a.vocab_size)

    def shape(self, s: ForwardShape) -> ForwardShape:
        target = s.args == self.toy
        to_bf16 = REAL_DTYPE_BYTES / s.dtype_bytes
        rows = s.lm_head_rows
        deeper = next((n for a, n in self.deeper if a == s.args), None)
        layers = None if target else deeper if deeper is not None and s.layers else s.layers
        return dataclasses.replace(
            s, args=self.args(s.args), dtype_bytes=REAL_DTYPE_BYTES, matrix_bytes=None, layers=layers,
            lm_head_rows=self.real.vocab_size if rows == self.toy.vocab_size else rows,
            extra_weight_bytes=int(s.extra_weight_bytes * self.scale2 * to_bf16),
            extra_flops=int(s.extra_flops * self.scale2))

    def work(self, work: tuple[ForwardShape, ...]) -> tuple[ForwardShape, ...]:
        return tuple(self.shape(s) for s in work)


class MappedMeter:
    """A meter that hands ``mapper``'s real-shape work to ``meter``; everything else is ``meter``'s."""

    def __init__(self, meter: Any, mapper: RealShapes) -> None:
        self.meter, self.mapper = meter, mapper

    def __getattr__(self, name: str) -> Any:
        return getattr(self.meter, name)

    def begin(self, name: str) -> None:
        self.meter.begin(name)

    def end(self, name: str, work: tuple[ForwardShape, ...] = ()) -> Any:
        return self.meter.end(name, self.mapper.work(work))


class MappedObserver:
    """An engine observer (a ledger) that records the events' work at the real shapes."""

    def __init__(self, observer: Any, mapper: RealShapes) -> None:
        self.observer, self.mapper = observer, mapper

    def __getattr__(self, name: str) -> Any:
        return getattr(self.observer, name)

    def __call__(self, event: PhaseEvent) -> None:
        self.observer(dataclasses.replace(event, work=self.mapper.work(event.work)))


class ProfileTee:
    """An engine observer that records each event again as another profile would have run it: the
    real-shape work priced by that profile's roofline, on its own modelled clock (phases back to
    back, as a modelled clock runs them), into a ledger of its own. A CPU run so answers for a
    second GPU profile in the same pass (MODELLED directly, without a simulated counter)."""

    def __init__(self, ledger: Any, mapper: RealShapes, profile: Any) -> None:
        self.ledger, self.mapper, self.profile = ledger, mapper, profile
        self.source = f"modelled:roofline({profile.name})"
        self.clock_s = 0.0

    def __call__(self, event: PhaseEvent) -> None:
        from refspec.energy.meters.measurement import Measurement
        from refspec.energy.model.roofline import total_cost, work_time_s

        work = self.mapper.work(event.work)
        t = work_time_s(work, self.profile)
        m = Measurement(time_s=t, energy_j=self.profile.energy_j(total_cost(work), t), source=self.source)
        self.ledger(dataclasses.replace(event, work=work, measurement=m, clock_s=self.clock_s))
        self.clock_s += t


@dataclasses.dataclass
class Target:
    """One block's target and what it shares across shapes.

    Attributes:
        arch: its architecture name.
        model: the model (real shapes on a GPU, a toy on a CPU).
        runner: the verify callable (graphs on a GPU, eager-static on a CPU).
        mapper: the toy's :class:`RealShapes` (None on a GPU).
        heads: drafter kind -> its random head, built once.
        max_len: cache slots per row the runner's pool holds.
        max_k: the largest K of its shapes.
    """

    arch: str
    model: Any
    runner: Any
    mapper: RealShapes | None
    heads: dict[str, Any]
    max_len: int
    max_k: int = 0
    _loop_runner: Any = None

    @property
    def loop_runner(self) -> Any:
        """A runner of its own for the phase loops, whose set-up sizes its cache for hundreds of
        steps: growing the serving runner's pool would drop its graphs between variants."""
        if self._loop_runner is None:
            from refspec.cuda_graphs import GraphRunner

            self._loop_runner = GraphRunner(self.model, capture=self.runner.capture,
                                            max_tokens_per_row=self.max_k + 1)
        return self._loop_runner


def load_target(arch: str, *, device: torch.device, dtype: torch.dtype, seed: int, max_batch: int, max_k: int,
                max_len: int) -> Target:
    """A random-weight target of ``arch`` (a toy of its family on a CPU) with its runner's pool."""
    from refspec.cuda_graphs import GraphRunner
    from refspec.models.random_models import arch_args, random_model, shrunk_config

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    cpu = device.type == "cpu"
    model = random_model(shrunk_config(arch, **TOY) if cpu else arch, device=device, dtype=dtype, seed=seed)
    runner = GraphRunner(model, capture=not cpu, max_tokens_per_row=max_k + 1)
    runner.reserve(max_batch, max_len)
    mapper = RealShapes(model.args, arch_args(arch)) if cpu else None
    return Target(arch=arch, model=model, runner=runner, mapper=mapper, heads={}, max_len=max_len, max_k=max_k)


def build_drafter(spec: DrafterSpec, target: Target, kv_bucket: int) -> Any:
    """A fresh drafter of ``spec`` on ``target``; its random head is built once per target."""
    model = target.model
    if spec.name == "none":
        return None
    if spec.name == "eagle":
        from refspec.drafters.eagle import EagleDrafter
        from refspec.drafters.eagle_body import HeadConfig
        from refspec.drafters.eagle_head import new_head

        if "eagle" not in target.heads:
            torch.manual_seed(0)
            with torch.device(model.device):  # built in place: no host copy of an 8B-shaped layer
                head = new_head(HeadConfig.for_target("eagle", model.args))
            for p in head.parameters():  # the target's dtype; rotary buffers stay fp32
                p.data = p.data.to(model.dtype)
            target.heads["eagle"] = head.eval().requires_grad_(False)
        return EagleDrafter(target.heads["eagle"], model, kv_bucket=kv_bucket)
    from refspec.drafters.block import BlockDrafter
    from refspec.drafters.block_head import BlockHead, BlockHeadConfig, default_feature_layers

    if "block" not in target.heads:
        torch.manual_seed(0)
        toy = target.mapper is not None  # a CPU's toy runs one head layer, priced as BLOCK_LAYERS
        cfg = BlockHeadConfig(feature_layers=default_feature_layers(model.num_layers), block_size=BLOCK_SIZE,
                              num_layers=1 if toy else BLOCK_LAYERS, input_fusion=False)
        with torch.device(model.device):
            head = BlockHead(model.args, cfg)
        if toy:
            target.mapper.run_as(head.args, BLOCK_LAYERS)
        for p in head.parameters():
            p.data = p.data.to(model.dtype)
        target.heads["block"] = head.eval().requires_grad_(False)
    return BlockDrafter(target.heads["block"], model, kv_bucket=kv_bucket)


__all__ = ["Target", "RealShapes", "MappedMeter", "MappedObserver", "ProfileTee", "load_target", "build_drafter", "TOY",
           "BLOCK_LAYERS", "BLOCK_SIZE"]
