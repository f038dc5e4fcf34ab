"""Turning logits into the distribution a token is drawn from.

The same :func:`probs_from_logits` is applied to the target's logits (p) and the drafter's
(q), so temperature, top-k and top-p change both identically: speculative sampling then
reproduces exactly the distribution plain sampling would draw from.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How tokens are chosen.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_k: keep the k most likely tokens (0 keeps all).
        top_p: keep the smallest set of most likely tokens whose mass reaches top_p (1 keeps all).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_from_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Sampling distribution after temperature, top-k and top-p.

    Args:
        logits: ``[..., V]`` raw logits.
        cfg: sampling settings (must not be greedy).

    Returns:
        ``[..., V]`` float32 probabilities summing to 1 over the kept tokens.
    """
    assert not cfg.greedy, "greedy decoding takes the argmax; there is no distribution to build"
    x = logits.float() / cfg.temperature
    if cfg.top_k and cfg.top_k < x.shape[-1]:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = mass_before >= cfg.top_p  # the first token is never dropped
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row.

    Args:
        probs: ``[N, V]`` probabilities.
        generator: explicit random generator (on the probs' device).

    Returns:
        ``[N]`` token ids.
    """
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def choose(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """Next token for each row of ``logits [N, V]``: argmax if greedy, else a sample."""
    if cfg.greedy:
        return logits.argmax(-1)
    return sample(probs_from_logits(logits, cfg), generator)
