"""What a drafter returns, checked once per step where the engine receives it.

A drafter is user code (a plug-in drafter, a trained head); what it proposes reaches the target's
embedding, the acceptance test and the record. A wrong shape, a float id, an id outside the
vocabulary, ``None``, too many tokens, or sampled probabilities that are not a distribution
would otherwise surface as an IndexError, a CUDA device assert or a silently wrong acceptance.
:func:`check_draft` turns each into a :class:`~refspec.drafting.DrafterError` naming the drafter
and what it returned. The value checks share one host synchronisation per step (the engine's
step loop reads its per-row flags on the host anyway).
"""
from __future__ import annotations

import torch

from refspec.drafting import Draft, DrafterError

PROB_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
"""How far a row of draft probabilities may sum from 1 (16-bit types: :data:`PROB_TOLERANCE_16`)."""
PROB_TOLERANCE_16 = 2e-2


def _shape(t: torch.Tensor) -> str:
    return f"{t.dtype} tensor of shape {tuple(t.shape)}"


def _check_form(draft: object, name: str, batch: int, k: int) -> Draft:
    """Type, dtype and shape checks (host metadata only, no synchronisation)."""
    if not isinstance(draft, Draft):
        raise DrafterError(f"drafter {name} returned {type(draft).__name__} from propose, not a Draft")
    tokens = draft.tokens
    if not isinstance(tokens, torch.Tensor):
        raise DrafterError(f"drafter {name} returned Draft.tokens of type {type(tokens).__name__}, not a tensor")
    if tokens.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise DrafterError(f"drafter {name} returned token ids as a {_shape(tokens)}; ids are integers (torch.long)")
    if tokens.dim() != 2 or tokens.shape[0] != batch:
        raise DrafterError(f"drafter {name} returned tokens as a {_shape(tokens)}; expected [{batch}, K'] "
                           f"(one row per batch row)")
    n = tokens.shape[1]
    if draft.tree is None and n > k:
        raise DrafterError(f"drafter {name} returned {n} draft tokens per row for k={k}; a chain has at most k")
    if draft.tree is not None:
        for field in ("parents", "depth"):
            t = getattr(draft.tree, field)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (batch, n):
                got = _shape(t) if isinstance(t, torch.Tensor) else type(t).__name__
                raise DrafterError(f"drafter {name} returned tree.{field} as {got}; expected [{batch}, {n}]")
    return draft


def check_draft(draft: object, *, name: str, batch: int, k: int, vocab_size: int, sampling: bool) -> Draft:
    """``draft`` when it is a valid proposal for this step, else a :class:`DrafterError`.

    Args:
        draft: what ``propose(state, k)`` returned.
        name: the drafter's name (for the message).
        batch: rows of the step (B).
        k: the step's K (a chain proposes at most K tokens per row).
        vocab_size: the target's vocabulary (V); ids must lie in ``[0, V)``.
        sampling: whether decoding samples (then ``probs`` must be distributions over V).

    Returns:
        The draft, unchanged.

    Raises:
        DrafterError: what was wrong, naming the drafter and what it returned.
    """
    draft = _check_form(draft, name, batch, k)
    tokens, probs = draft.tokens, draft.probs
    if tokens.numel() == 0:
        return draft
    flags = [(tokens < 0).any() | (tokens >= vocab_size).any()]  # [] bool each
    if sampling and probs is not None:
        n = tokens.shape[1]
        if not isinstance(probs, torch.Tensor) or not probs.is_floating_point() \
                or tuple(probs.shape) != (batch, n, vocab_size):
            got = _shape(probs) if isinstance(probs, torch.Tensor) else type(probs).__name__
            raise DrafterError(f"drafter {name} returned probs as {got}; expected floating [{batch}, {n}, "
                               f"{vocab_size}] distributions")
        tol = PROB_TOLERANCE.get(probs.dtype, PROB_TOLERANCE_16)
        sums = probs.float().sum(-1)  # [B, N]
        flags += [~torch.isfinite(probs).all() | (probs < 0).any(), ((sums - 1).abs() > tol).any()]
    bad = torch.stack(flags).tolist()  # one synchronisation for every value check
    if bad[0]:
        lo, hi = int(tokens.min()), int(tokens.max())
        raise DrafterError(f"drafter {name} returned token ids in [{lo}, {hi}], outside the vocabulary [0, "
                           f"{vocab_size})")
    if len(bad) > 1 and bad[1]:
        raise DrafterError(f"drafter {name} returned probs with NaN, infinite or negative entries")
    if len(bad) > 2 and bad[2]:
        worst = float((probs.float().sum(-1) - 1).abs().max())
        raise DrafterError(f"drafter {name} returned probs that do not sum to 1 (off by up to {worst:.3g}); a "
                           f"sampling drafter gives the distribution each draft was drawn from")
    return draft


__all__ = ["check_draft", "PROB_TOLERANCE", "PROB_TOLERANCE_16"]
