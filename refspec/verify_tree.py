"""Verification of draft trees: greedy path matching and lossless recursive rejection sampling.

A tree block per row is the root (the pending token, block index 0) followed by N draft nodes
(node ``j`` at block index ``j + 1``), each with a parent that precedes it. The target scores
every block entry in one forward, so ``target[:, i]`` is the distribution after the path to
entry ``i``. The words of :mod:`refspec.verify` apply: the **accepted** drafts form a
root-to-node path, then one **recovered** token (some child of the last accepted node was
rejected) or **bonus** token (the last accepted node had no children) is emitted.

Sampled verification (recursive rejection sampling; SpecInfer's multi-step speculative
sampling, Miao et al. 2023; Jeon et al. 2024 for children drawn without replacement). Start at
the root with ``r = p_root``. Try the children of the current node in node order; for child
``x_i`` with draft law ``q_i``:

- accept it with probability ``min(1, r(x_i) / q_i(x_i))``; then descend: the child becomes
  the current node and ``r`` its target distribution;
- else replace ``r`` by the normalised residual ``norm(max(0, r - q_i))`` and try the next
  child.

When no child is left, the emitted token is drawn from ``r``.

Exactness. With ``draft_probs`` None every child counts as fixed (one-hot ``q_i``): accept it
with probability ``r(x_i)``, else remove ``x_i`` from ``r``. Given the tree, each stage is then a
standard speculative-sampling step, so the rule is exact for any tree that does not depend on
the target's acceptance draws: EAGLE-2's top-k children with budget pruning, and sampled
children too (usually accepted less often than with their q). With ``draft_probs``, ``q_i`` must be the
law of child i's token given the path to its parent and its earlier siblings (node order); the
residual then does not depend on the rejected token, and induction over the children gives
exactness. This covers

- children drawn independently (with replacement) from ``q``: every ``q_i = q``;
- children drawn without replacement from ``q``: ``q_i`` is ``q`` without the earlier siblings'
  tokens, renormalised.

A wrong ``q_i`` is not exact: the unconditional ``q`` for draws without replacement, or q for
sampled children that were then pruned by their scores (no simple law describes that
selection; give None for such trees).
"""
from __future__ import annotations

import dataclasses

import torch

from refspec.verify import Acceptance


def tree_ancestors(parents: torch.Tensor) -> torch.Tensor:
    """Ancestor-or-self relation of a tree block that starts with the root.

    Args:
        parents: ``[B, N]`` parent index of each draft node within the block, where index 0
            is the root (the pending token) and node ``j`` of the draft sits at block index
            ``j + 1``; a node's parent precedes it.

    Returns:
        ``[B, N+1, N+1]`` bool, ``[b, i, j]`` iff block entry j is entry i or an ancestor of it.
    """
    b, n = parents.shape
    anc = torch.eye(n + 1, dtype=torch.bool, device=parents.device).repeat(b, 1, 1)
    for j in range(n):
        par = parents[:, j]  # block index of the parent of block entry j + 1
        assert bool((par <= j).all()), "tree nodes must come after their parents"
        anc[:, j + 1] |= anc[torch.arange(b, device=parents.device), par]
    return anc


def tree_path(node: torch.Tensor, num_accepted: torch.Tensor, parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Block indices from the root to each row's last accepted node.

    Args:
        node: ``[B]`` block index of the last accepted node (0 = root only).
        num_accepted: ``[B]`` its depth.
        parents: ``[B, N]`` block index of each node's parent.
        max_depth: P, the tree's maximum depth (the longest path a row can accept).

    Returns:
        ``[B, P+1]``: the root, then the accepted nodes in order; entries past ``num_accepted``
        repeat the last one.
    """
    b = node.shape[0]
    assert node.shape == num_accepted.shape == (b,) and parents.shape[0] == b, "node, num_accepted [B]; parents [B, N]"
    path = torch.zeros(b, max_depth + 1, dtype=torch.long, device=node.device)
    full_parents = torch.cat([torch.zeros(b, 1, dtype=parents.dtype, device=parents.device), parents], dim=1)
    cur = node.clone()
    for d in range(max_depth, -1, -1):  # walk up from the accepted node
        at_d = num_accepted >= d
        path[:, d] = torch.where(at_d, cur, path[:, d])
        cur = torch.where(at_d & (d > 0), full_parents.gather(1, cur[:, None]).squeeze(1), cur)
    # past num_accepted, repeat the last accepted entry
    idx = torch.arange(max_depth + 1, device=node.device)[None]
    last = path.gather(1, num_accepted[:, None])
    return torch.where(idx <= num_accepted[:, None], path, last)


def tree_greedy_accept(draft: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
                       target_logits: torch.Tensor) -> tuple[Acceptance, torch.Tensor]:
    """Greedy acceptance of a draft tree: the deepest node whose whole path matches.

    Args:
        draft: ``[B, N]`` node tokens.
        parents: ``[B, N]`` block index of each node's parent (0 = root).
        depth: ``[B, N]`` depth of each node (root children have depth 1).
        target_logits: ``[B, N+1, V]`` target logits at the root and each node.

    Returns:
        ``(acceptance, path)``: path ``[B, P+1]`` as :func:`tree_path` gives it, P the maximum
        depth.
    """
    b, n = draft.shape
    assert target_logits.shape[:2] == (b, n + 1), "target logits must cover root + nodes"
    best = target_logits.argmax(-1)  # [B, N+1]
    ok = torch.ones(b, n + 1, dtype=torch.bool, device=draft.device)
    for j in range(n):  # parents precede children, so one pass settles every node
        par = parents[:, j]
        match = draft[:, j] == best.gather(1, par[:, None]).squeeze(1)
        ok[:, j + 1] = match & ok.gather(1, par[:, None]).squeeze(1)
    block_depth = torch.cat([torch.zeros(b, 1, dtype=depth.dtype, device=depth.device), depth], dim=1)
    score = torch.where(ok, block_depth, torch.full_like(block_depth, -1))
    node = score.argmax(1)  # [B] deepest accepted block index (0 = root only)
    num_accepted = block_depth.gather(1, node[:, None]).squeeze(1)
    next_token = best.gather(1, node[:, None]).squeeze(1)
    max_depth = int(depth.max().item()) if n else 0
    return Acceptance(num_accepted, next_token), tree_path(node, num_accepted, parents, max_depth)


@dataclasses.dataclass(frozen=True)
class TreeWalk:
    """The outcome of recursive rejection sampling once its acceptance draws are fixed.

    Attributes:
        num_accepted: ``[B]`` accepted nodes (the depth of ``node``).
        node: ``[B]`` block index of the last accepted node (0 = root only).
        residual: ``[B, V]`` the distribution the recovered or bonus token is drawn from.
        tried: ``[B, N]`` bool, the nodes whose acceptance was tested.
        accept_prob: ``[B, N]`` the probability each tried node was accepted with (0 elsewhere).
    """

    num_accepted: torch.Tensor
    node: torch.Tensor
    residual: torch.Tensor
    tried: torch.Tensor
    accept_prob: torch.Tensor


def _check_tree(draft: torch.Tensor, parents: torch.Tensor, draft_probs: torch.Tensor | None,
                target_probs: torch.Tensor, uniforms: torch.Tensor) -> None:
    b, n = draft.shape
    assert parents.shape == (b, n) and uniforms.shape == (b, n), "draft, parents, uniforms [B, N]"
    assert target_probs.dim() == 3 and target_probs.shape[:2] == (b, n + 1), "target_probs [B, N+1, V]"
    assert draft_probs is None or draft_probs.shape == (b, n, target_probs.shape[2]), "draft_probs [B, N, V]"


def tree_rejection_walk(draft: torch.Tensor, parents: torch.Tensor, draft_probs: torch.Tensor | None,
                        target_probs: torch.Tensor, uniforms: torch.Tensor) -> TreeWalk:
    """Recursive rejection sampling over a tree, given one acceptance draw per node.

    Node ``j`` is accepted when ``uniforms[:, j] < accept_prob[:, j]``; the draw of a node that
    is never tried is unused. Separating the draws makes every outcome enumerable in tests.

    Args:
        draft: ``[B, N]`` node tokens.
        parents: ``[B, N]`` block index of each node's parent (0 = root); parents precede
            children and siblings are tried in node order.
        draft_probs: ``[B, N, V]`` per node the law its token was drawn from (given its path
            and its earlier siblings), or None for deterministic children (one-hot q).
        target_probs: ``[B, N+1, V]`` the target's processed distribution at the root and at
            each node.
        uniforms: ``[B, N]`` acceptance draws in [0, 1).

    Returns:
        The accepted path's end, its depth and the residual to draw the next token from.
    """
    _check_tree(draft, parents, draft_probs, target_probs, uniforms)
    b, n = draft.shape
    cur = torch.zeros(b, dtype=torch.long, device=draft.device)  # block index of the current node
    num_accepted = torch.zeros_like(cur)
    residual = target_probs[:, 0]  # [B, V] the current target r
    tried = torch.zeros(b, n, dtype=torch.bool, device=draft.device)
    accept_prob = torch.zeros(b, n, dtype=target_probs.dtype, device=draft.device)
    for j in range(n):  # parents precede children, so one pass in node order visits every stage
        x = draft[:, j:j + 1]  # [B, 1]
        if draft_probs is None:
            q = torch.zeros_like(residual).scatter_(1, x, 1.0)  # [B, V] one-hot
        else:
            q = draft_probs[:, j]
        r_x, q_x = residual.gather(1, x).squeeze(1), q.gather(1, x).squeeze(1)  # [B]
        # a token its own law gives no mass cannot have been drawn: never accept it
        a = torch.where(q_x > 0, (r_x / q_x.clamp_min(torch.finfo(q.dtype).tiny)).clamp(max=1.0), torch.zeros_like(r_x))
        is_child = parents[:, j] == cur
        accept = is_child & (uniforms[:, j] < a)
        reject = is_child & ~accept
        rest = (residual - q).clamp_min(0)  # [B, V]
        mass = rest.sum(-1, keepdim=True)
        # zero mass means r == q: then the child is always accepted and the residual is never used
        rest = torch.where(mass > 0, rest / mass.clamp_min(torch.finfo(rest.dtype).tiny), residual)
        residual = torch.where(accept[:, None], target_probs[:, j + 1], torch.where(reject[:, None], rest, residual))
        cur = torch.where(accept, torch.full_like(cur, j + 1), cur)
        num_accepted = num_accepted + accept.long()
        tried[:, j] = is_child
        accept_prob[:, j] = torch.where(is_child, a, torch.zeros_like(a))
    return TreeWalk(num_accepted=num_accepted, node=cur, residual=residual, tried=tried, accept_prob=accept_prob)


def tree_speculative_sample(draft: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
                            draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                            generator: torch.Generator | None,
                            uniforms: torch.Tensor | None = None) -> tuple[Acceptance, torch.Tensor]:
    """Lossless sampled verification of a draft tree (the rule of the module docstring).

    Args:
        draft: ``[B, N]`` node tokens.
        parents: ``[B, N]`` block index of each node's parent (0 = root).
        depth: ``[B, N]`` depth of each node (root children have depth 1).
        draft_probs: ``[B, N, V]`` per node the law its token was drawn from, or None for
            deterministic children.
        target_probs: ``[B, N+1, V]`` the target's processed distributions p.
        generator: explicit random generator on the tensors' device.
        uniforms: ``[B, N]`` the acceptance draws (default: drawn from ``generator``).

    Returns:
        ``(acceptance, path)``: path ``[B, P+1]`` as :func:`tree_path` gives it.
    """
    b, n = draft.shape
    assert depth.shape == (b, n), "depth [B, N]"
    u = torch.rand(b, n, device=draft.device, generator=generator) if uniforms is None else uniforms
    walk = tree_rejection_walk(draft, parents, draft_probs, target_probs, u)
    next_token = torch.multinomial(walk.residual, 1, generator=generator).squeeze(1)  # [B]
    max_depth = int(depth.max().item()) if n else 0
    return Acceptance(walk.num_accepted, next_token), tree_path(walk.node, walk.num_accepted, parents, max_depth)
