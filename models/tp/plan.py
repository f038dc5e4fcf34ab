"""How N tensor-parallel ranks share a dense model's heads and MLP columns (pure arithmetic:
the sharding is :mod:`refspec.models.tp.shard`, its cost :mod:`refspec.models.tp.interconnect`).

Each rank keeps whole key/value groups (a K/V head with the query heads that read it); with fewer
K/V heads than ranks each K/V head is replicated on N / Hkv ranks, which split its query heads.
Groups that do not divide evenly go unevenly (SmolLM2's 3 groups over 2 ranks: 2 + 1), rank 0
taking the larger share; MLP columns likewise. Mixture-of-experts models are not shared.
"""
from __future__ import annotations

import dataclasses
import logging

from refspec.config import ModelArgs

log = logging.getLogger(__name__)


class TPError(ValueError):
    """A tensor-parallel launch or sharding that cannot work (a usage error)."""


def _split(n: int, parts: int, i: int) -> tuple[int, int]:
    """``[lo, hi)`` of part ``i`` when ``n`` items are cut into ``parts`` contiguous near-equal parts."""
    base, extra = divmod(n, parts)
    lo = i * base + min(i, extra)
    return lo, lo + base + (i < extra)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """What rank ``rank`` of ``size`` keeps: ``[lo, hi)`` ranges of query heads, K/V heads and
    MLP columns of every block."""

    size: int
    rank: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    mlp: tuple[int, int]

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate(self) -> int:
        return self.mlp[1] - self.mlp[0]


def shard_plan(args: ModelArgs, size: int, rank: int) -> ShardPlan:
    """Rank ``rank``'s share of a model of ``args`` over ``size`` ranks.

    Raises:
        TPError: a mixture-of-experts model, or heads that ``size`` ranks cannot share.
    """
    if args.is_moe:
        raise TPError(f"--tp {size}: {args.family} is a mixture-of-experts model and refspec shards dense models "
                      f"only (llama, qwen2, qwen3, gemma3); run it with --tp 1")
    h, hkv = args.num_heads, args.num_kv_heads
    g = h // hkv  # query heads per K/V head
    if hkv >= size:  # whole K/V groups per rank
        klo, khi = _split(hkv, size, rank)
        q = (klo * g, khi * g)
    elif size % hkv == 0 and g % (size // hkv) == 0:  # each K/V head on size / Hkv ranks
        share = size // hkv
        klo, khi = rank // share, rank // share + 1
        per = g // share
        q = (klo * g + (rank % share) * per, klo * g + (rank % share + 1) * per)
    else:
        fits = [n for n in range(1, 65) if n <= hkv or (n % hkv == 0 and g % (n // hkv) == 0)]
        raise TPError(f"--tp {size}: {args.num_heads} query heads in {hkv} key/value groups cannot be shared by "
                      f"{size} ranks (each rank needs whole groups, or {size} must be a multiple of {hkv} that "
                      f"splits a group's {g} query heads evenly); use --tp {', '.join(map(str, fits[:8]))}")
    if args.intermediate_size < size:
        raise TPError(f"--tp {size}: an MLP of {args.intermediate_size} columns cannot feed {size} ranks")
    return ShardPlan(size=size, rank=rank, q_heads=q, kv_heads=(klo, khi), mlp=_split(args.intermediate_size, size,
                                                                                       rank))


def rank_args(args: ModelArgs, plan: ShardPlan) -> ModelArgs:
    """The architecture of one rank's share (what its forwards cost): its heads and MLP columns;
    embedding, norms and LM head whole (replicated)."""
    return dataclasses.replace(args, num_heads=plan.num_heads, num_kv_heads=plan.num_kv_heads,
                               intermediate_size=plan.intermediate)


def check_shardable(args: ModelArgs, size: int) -> list[ShardPlan]:
    """Every rank's plan (raises :class:`TPError` as :func:`shard_plan`); logs an uneven split."""
    plans = [shard_plan(args, size, r) for r in range(size)]
    heads = sorted({p.num_heads for p in plans})
    if len(heads) > 1:
        log.warning("--tp %d: %d query heads in %d key/value groups split unevenly (%s heads per rank): the ranks "
                    "with fewer wait at each all-reduce", size, args.num_heads, args.num_kv_heads,
                    " / ".join(str(p.num_heads) for p in plans))
    return plans


__all__ = ["TPError", "ShardPlan", "shard_plan", "rank_args", "check_shardable"]
