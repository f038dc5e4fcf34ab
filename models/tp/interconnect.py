"""The interconnect in the roofline: what tensor parallelism adds to a forward, and how it moves
the point where verifying more tokens stops being nearly free.

A forward over N GPUs in Megatron's layout (:mod:`refspec.models.tp.shard`, shares from
:mod:`refspec.models.tp.plan`):

* **each GPU's share** is :func:`~refspec.energy.model.roofline.forward_cost` of the architecture of
  its share (its heads, K/V heads and MLP columns; embedding, norms and LM head whole, as
  refspec replicates them): weight bytes and FLOPs of the blocks over N, the LM head's not;
  its KV cache holds Hkv / N heads (at least one). The costliest share (rank 0's when the
  heads split unevenly) sets the time.
* **two all-reduces per layer** of the residual stream, Q x E elements of b bytes for Q query
  tokens. A ring all-reduce moves 2(N-1)/N of the tensor's bytes out of (and into) each GPU, so
  one takes ``2(N-1)/N x bytes / link bandwidth + link latency``. The collectives sit between
  dependent layers: they add to the time, nothing overlaps them.

Time of a forward = max(FLOPs / peak, bytes / HBM bandwidth) of one share + all-reduce time +
the launch overhead. Energy = N x (static W x time + pJ/FLOP and pJ/B of one share) + pJ per
link byte x the bytes every GPU sends. Drafters run replicated (every GPU drafts the same), so a
draft forward costs one GPU's time and N GPUs' energy.

Two crossovers per N (:func:`crossovers`): where verification turns **compute-bound**
(FLOPs / peak >= HBM time of a share: both scale by about 1/N, so N barely moves it), and where
the **token-proportional time** (FLOPs / peak + all-reduce transfer) outgrows the weight read:
the HBM time shrinks by 1/N while each token's all-reduce bytes grow to 2(N-1)/N of its
activations, so a larger N reaches it at a smaller batch. Every figure here is modelled.
"""
from __future__ import annotations

import dataclasses

from refspec.config import ModelArgs
from refspec.energy.model.cost import Cost
from refspec.energy.model.hardware import PICO, HardwareProfile
from refspec.energy.model.roofline import EAGLE_HEAD, DrafterModel, expected_tokens_per_step, forward_cost
from refspec.energy.model.work import ForwardShape
from refspec.models.tp.plan import rank_args, shard_plan


@dataclasses.dataclass(frozen=True, kw_only=True)
class TPForward:
    """One forward over N GPUs (see the module docstring).

    Attributes:
        tp: N.
        gpu: the costliest GPU's share.
        collectives: all-reduces run (2 per layer; 0 at N = 1).
        tensor_bytes: bytes of one all-reduced tensor (Q x E x b).
        link_bytes: bytes each GPU sends over the link in the forward.
        compute_s / memory_s: the share's FLOPs / peak and bytes / HBM bandwidth.
        comm_s: the all-reduces' time (transfer + latency).
        time_s: the forward's time.
        energy_j: energy of all N GPUs and the link.
    """

    tp: int
    gpu: Cost
    collectives: int
    tensor_bytes: float
    link_bytes: float
    compute_s: float
    memory_s: float
    comm_s: float
    time_s: float
    energy_j: float

    @property
    def bound(self) -> str:
        """``compute`` when the share's FLOPs outlast its HBM traffic, else ``memory``."""
        return "compute" if self.compute_s >= self.memory_s else "memory"


def share_args(args: ModelArgs, tp: int) -> ModelArgs:
    """The architecture of the costliest share of ``args`` over ``tp`` ranks (rank 0's).

    Raises:
        refspec.models.tp.plan.TPError: a model ``tp`` ranks cannot share.
    """
    return args if tp == 1 else rank_args(args, shard_plan(args, tp, 0))


def _link(profile: HardwareProfile, tp: int) -> tuple[float, float]:
    if tp > 1 and not profile.link_Bps:
        raise ValueError(f"profile {profile.name} has no GPU-to-GPU link figures; tensor parallelism needs them")
    return profile.link_Bps or 1.0, profile.link_latency_s


def tp_forward(shape: ForwardShape, profile: HardwareProfile, tp: int) -> TPForward:
    """Time and energy of ``shape`` (the whole model's forward) run over ``tp`` GPUs."""
    a = shape.args
    gpu = forward_cost(dataclasses.replace(shape, args=share_args(a, tp)))
    queries = shape.rows * shape.tokens_per_row if shape.query_tokens is None else shape.query_tokens
    layers = a.num_layers if shape.layers is None else shape.layers
    collectives = 2 * layers if tp > 1 else 0
    tensor = float(queries * a.hidden_size * shape.dtype_bytes)
    link_bw, latency = _link(profile, tp)
    sent = collectives * 2 * (tp - 1) / tp * tensor  # a ring all-reduce: 2(N-1)/N of the tensor out of each GPU
    comm = sent / link_bw + collectives * latency
    compute, memory = gpu.flops / profile.peak_flops, gpu.bytes / profile.bandwidth_Bps
    time = max(compute, memory) + comm + profile.overhead_s
    energy = tp * profile.energy_j(gpu, time) + tp * PICO * profile.link_pj_per_byte * sent
    return TPForward(tp=tp, gpu=gpu, collectives=collectives, tensor_bytes=tensor, link_bytes=sent, compute_s=compute,
                     memory_s=memory, comm_s=comm, time_s=time, energy_j=energy)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TPStep:
    """One speculative step over N GPUs at steady state (all rows active); times in s, energies in J.

    Attributes:
        tp / batch / k / acceptance / context: the setting.
        verify: the verify forward.
        draft_time_s / draft_energy_j: the replicated drafter's forwards (N GPUs' energy).
        step_time_s / step_energy_j: draft + verify.
        tokens_per_row: expected tokens emitted per row per step.
        tpot_s / j_per_token: per user and per emitted token.
        weight_bytes_per_gpu: weights one GPU reads per verify forward.
    """

    tp: int
    batch: int
    k: int
    acceptance: float
    context: int
    verify: TPForward
    draft_time_s: float
    draft_energy_j: float
    step_time_s: float
    step_energy_j: float
    tokens_per_row: float
    tpot_s: float
    j_per_token: float
    weight_bytes_per_gpu: float


def _verify_shape(target: ModelArgs, batch: int, k: int, context: int, dtype_bytes: int) -> ForwardShape:
    return ForwardShape(args=target, rows=batch, tokens_per_row=k + 1, context_tokens=batch * (context + k + 1),
                        dtype_bytes=dtype_bytes)


def predict_tp_step(target: ModelArgs, profile: HardwareProfile, *, tp: int, batch: int, k: int, context: int,
                    acceptance: float, drafter: DrafterModel | None = EAGLE_HEAD, dtype_bytes: int = 2) -> TPStep:
    """Model one step over ``tp`` GPUs: K replicated draft forwards (or one block forward), one
    tensor-parallel verify forward of K + 1 tokens per row (as
    :func:`~refspec.energy.model.roofline.predict_step` for one GPU, which ``tp=1`` reproduces apart
    from the link terms, all zero there)."""
    verify = tp_forward(_verify_shape(target, batch, k, context, dtype_bytes), profile, tp)
    draft_time = draft_energy = 0.0
    if k > 0 and drafter is not None and not drafter.free:
        rows = [(k, context + k)] if drafter.parallel else [(1, context + i + 1) for i in range(k)]
        for width, keys in rows:
            c = drafter.forward_cost(target, rows=batch, tokens_per_row=width, context_tokens=batch * keys,
                                     dtype_bytes=dtype_bytes)
            t = profile.time_s(c)
            draft_time += t
            draft_energy += tp * profile.energy_j(c, t)  # every GPU drafts the same
    tokens = expected_tokens_per_step(acceptance, k) if k else 1.0
    step_time, step_energy = draft_time + verify.time_s, draft_energy + verify.energy_j
    return TPStep(tp=tp, batch=batch, k=k, acceptance=acceptance, context=context, verify=verify,
                  draft_time_s=draft_time, draft_energy_j=draft_energy, step_time_s=step_time,
                  step_energy_j=step_energy, tokens_per_row=tokens, tpot_s=step_time / tokens,
                  j_per_token=step_energy / (batch * tokens), weight_bytes_per_gpu=verify.gpu.weight_bytes)


def _first(pred, max_batch: int) -> int | None:
    """Smallest batch in 1..max_batch where ``pred`` holds (monotone), or None."""
    if not pred(max_batch):
        return None
    lo, hi = 0, max_batch
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if pred(mid) else (mid, hi)
    return hi


def crossovers(target: ModelArgs, profile: HardwareProfile, *, tp: int, k: int, context: int, dtype_bytes: int = 2,
               max_batch: int = 1 << 16) -> tuple[int | None, int | None]:
    """``(compute-bound batch, token-bound batch)`` of the verify forward (K + 1 tokens per row)
    over ``tp`` GPUs: the smallest batch whose share's FLOPs / peak reaches its HBM time, and the
    smallest whose FLOPs / peak plus all-reduce transfer time does (None: beyond ``max_batch``)."""
    link_bw, _ = _link(profile, tp)

    def fwd(b: int) -> TPForward:
        return tp_forward(_verify_shape(target, b, k, context, dtype_bytes), profile, tp)

    def compute_bound(b: int) -> bool:
        f = fwd(b)
        return f.compute_s >= f.memory_s

    def token_bound(b: int) -> bool:
        f = fwd(b)
        return f.compute_s + f.link_bytes / link_bw >= f.memory_s

    return _first(compute_bound, max_batch), _first(token_bound, max_batch)


__all__ = ["TPForward", "TPStep", "share_args", "tp_forward", "predict_tp_step", "crossovers"]
