"""Verification: deciding which drafted tokens a row keeps. Pure tensor functions.

Glossary (per row, per verify step):

- **draft**: the K tokens the drafter proposed after the row's pending token.
- **accepted**: the drafts kept, always a prefix of the chain (or a root-to-node path of a
  tree); ``num_accepted`` in ``0..K``.
- **recovered**: when draft ``i`` is rejected, the token emitted in its place, sampled from
  the residual ``norm(max(0, p_i - q_i))`` (greedy: the target's argmax).
- **bonus**: when all K drafts are accepted, the extra token sampled from the target's
  distribution after the last draft (greedy: its argmax).
- **emitted**: accepted drafts followed by one recovered or bonus token: ``num_accepted + 1``
  tokens (before EOS / budget truncation).
- **tau** (acceptance length): ``num_accepted + 1`` per verify step, averaged over the
  row-steps of active rows. It counts the bonus token, as SGLang, vLLM and EAGLE report it.

Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023): accept draft x with
probability ``min(1, p(x) / q(x))``; on rejection sample from ``norm(max(0, p - q))``; after
full acceptance sample the bonus from ``p``. The emitted sequence then follows the target
distribution exactly. A deterministic drafter (n-gram) is the one-hot ``q`` case.

Trees (several children per node) are verified in :mod:`refspec.verify_tree`.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """Outcome of verifying one chain per row.

    Attributes:
        num_accepted: ``[B]`` accepted drafts per row (0..K).
        next_token: ``[B]`` the recovered or bonus token per row.
    """

    num_accepted: torch.Tensor  # [B]
    next_token: torch.Tensor  # [B]


def _check_chain(draft: torch.Tensor, target: torch.Tensor) -> None:
    assert draft.dim() == 2 and target.dim() == 3, "draft [B, K], target [B, K+1, V]"
    assert target.shape[:2] == (draft.shape[0], draft.shape[1] + 1), (
        f"target has {tuple(target.shape[:2])} positions for drafts {tuple(draft.shape)}; expected [B, K+1]")


def greedy_accept(draft: torch.Tensor, target_logits: torch.Tensor) -> Acceptance:
    """Accept the longest prefix of the draft that matches the target's argmax.

    Args:
        draft: ``[B, K]`` drafted tokens.
        target_logits: ``[B, K+1, V]`` target logits at the pending token and each draft.

    Returns:
        The accepted counts and the target's argmax after the accepted prefix.
    """
    _check_chain(draft, target_logits)
    best = target_logits.argmax(-1)  # [B, K+1]
    matches = (draft == best[:, :-1]).long()  # [B, K]
    num_accepted = matches.cumprod(dim=1).sum(dim=1)  # [B]
    next_token = best.gather(1, num_accepted[:, None]).squeeze(1)
    return Acceptance(num_accepted, next_token)


def acceptance_probability(p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """``min(1, p(x) / q(x))`` for each draft x; ``[B, K]`` in, ``[B, K]`` out (q = 0 gives 1)."""
    safe_q = torch.where(q_draft > 0, q_draft, torch.ones_like(q_draft))
    return torch.where(q_draft > 0, (p_draft / safe_q).clamp(max=1.0), torch.ones_like(p_draft))


def recovery_distribution(target_probs: torch.Tensor, q_full: torch.Tensor) -> torch.Tensor:
    """Distribution of the token emitted after ``i`` accepted drafts.

    Args:
        target_probs: ``[B, K+1, V]`` p.
        q_full: ``[B, K, V]`` q.

    Returns:
        ``[B, K+1, V]``: rows ``i < K`` are ``norm(max(0, p_i - q_i))`` (p_i where that is
        empty, which only happens when p_i == q_i and rejection is impossible); row K is p_K.
    """
    k = q_full.shape[1]
    residual = (target_probs[:, :k] - q_full).clamp_min(0)  # [B, K, V]
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), target_probs[:, :k])
    return torch.cat([residual, target_probs[:, k:]], dim=1)


def one_hot_probs(draft: torch.Tensor, vocab: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[B, K, V]`` one-hot q of a deterministic drafter."""
    return torch.zeros(*draft.shape, vocab, device=draft.device, dtype=dtype).scatter_(2, draft[..., None], 1.0)


def speculative_sample(draft: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                       generator: torch.Generator | None, uniforms: torch.Tensor | None = None) -> Acceptance:
    """Lossless rejection sampling of a chain of drafts.

    Args:
        draft: ``[B, K]`` drafted tokens.
        draft_probs: ``[B, K, V]`` the drafter's (processed) distributions q, or None for a
            deterministic drafter (q is one-hot on the draft).
        target_probs: ``[B, K+1, V]`` the target's (processed) distributions p.
        generator: explicit random generator on the tensors' device.
        uniforms: ``[B, K]`` the acceptance draws (default: drawn from ``generator``).

    Returns:
        The accepted counts and the recovered / bonus token per row.
    """
    _check_chain(draft, target_probs)
    b, k = draft.shape
    v = target_probs.shape[-1]
    q_full = one_hot_probs(draft, v, target_probs.dtype) if draft_probs is None else draft_probs
    assert q_full.shape == (b, k, v), f"draft_probs {tuple(q_full.shape)} != {(b, k, v)}"
    p_draft = target_probs[:, :k].gather(2, draft[..., None]).squeeze(2)  # [B, K] p(x_i)
    q_draft = q_full.gather(2, draft[..., None]).squeeze(2)  # [B, K] q(x_i)
    u = torch.rand(b, k, device=draft.device, generator=generator) if uniforms is None else uniforms
    accept = (u < acceptance_probability(p_draft, q_draft)).long()  # [B, K]
    num_accepted = accept.cumprod(dim=1).sum(dim=1)  # [B]
    dist = recovery_distribution(target_probs, q_full)  # [B, K+1, V]
    row = dist.gather(1, num_accepted[:, None, None].expand(b, 1, v)).squeeze(1)  # [B, V]
    next_token = torch.multinomial(row, 1, generator=generator).squeeze(1)
    return Acceptance(num_accepted, next_token)


def emitted_tokens(draft: torch.Tensor, acc: Acceptance) -> torch.Tensor:
    """The ``num_accepted + 1`` tokens a row emits, left-aligned in ``[B, K+1]``.

    Entries after the recovered / bonus token repeat it; callers mask by count.
    """
    b, k = draft.shape
    idx = torch.arange(k + 1, device=draft.device)
    padded = torch.cat([draft, acc.next_token[:, None]], dim=1)  # [B, K+1]
    return torch.where(idx[None] < acc.num_accepted[:, None], padded, acc.next_token[:, None])
