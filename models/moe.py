"""Mixture-of-experts MLP of the qwen3_moe, mixtral and qwen2_moe families: router, experts, dispatch.

Routing (both families, as ``transformers`` computes it): router logits ``x W_r^T``, a softmax
over all X experts in fp32, the top k_e probabilities; qwen3_moe divides them by their sum
when ``norm_topk_prob`` is set, mixtral always does (which equals a softmax over the k_e
selected logits). A token's output is the weighted sum of its k_e experts' gated MLPs
(``down(silu(gate x) * up x)``). qwen3_moe and mixtral have no shared expert; qwen2_moe adds
one gated MLP every token runs, scaled by ``sigmoid(x w_g)`` (``shared_expert``,
``shared_expert_gate``).

Experts are stored fused, ``gate_up [X, 2I, E]`` (gate rows first) and ``down [X, E, I]``; the
state dict keeps Hugging Face's per-expert split names (``experts.{j}.gate/up/down.weight``),
so checkpoints and ``load_state_dict`` see one matrix per expert.

Three dispatch paths compute the same sum:

* ``gather`` (eager default): routed (token, expert) pairs sorted by expert; each expert that
  received tokens multiplies exactly those rows. Only the routed experts' weights are read;
  the per-expert counts come to the host (one sync), so it cannot be captured in a CUDA graph.
* ``grouped`` (static shapes, no host sync): the same expert-sorted pairs through
  :func:`torch.nn.functional.grouped_mm`, one grouped GEMM per projection whose per-expert
  row counts are device offsets; an expert without rows is a group of zero rows. Capturable
  in a CUDA graph; on a GPU it needs bf16 and a grouped-GEMM kernel (SM >= 80).
* ``dense`` (static shapes; what a CUDA graph captures unless ``grouped`` is chosen): every
  expert runs over every token and a ``[N, X]`` combine matrix, zero off the routed pairs,
  weights the sum. No host sync and no data-dependent shape, at X / k_e times the expert
  FLOPs and all expert bytes.

Either way the layer writes the number of distinct experts its forward routed to into the
device scalar :attr:`MoE.touched` (inside a captured graph too, so a replay updates it); the
cost model bills expert bytes from it (:meth:`refspec.models.Transformer.forward_shape`, which
on a GPU hands the count on as a device tensor, read once the step has synchronised).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from refspec.config import ModelArgs

DISPATCH = ("gather", "grouped", "dense")


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of ``x [N, E]`` by ``router [X, E]``.

    Returns:
        ``(weights [N, k] in x's dtype, experts [N, k] int64)``, highest probability first.
    """
    probs = torch.softmax(F.linear(x, router).float(), dim=-1)  # [N, X]
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


def _expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate x) * up x)`` of one expert (``gate_up [2I, E]``, ``down [E, I]``) or of a
    stack of them (``[X, 2I, E]``, ``[X, E, I]`` over ``x [X, N, E]``)."""
    gate, up = torch.matmul(x, gate_up.transpose(-1, -2)).chunk(2, dim=-1)
    return torch.matmul(F.silu(gate) * up, down.transpose(-1, -2))


def dispatch_gather(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each routed expert over its own tokens. Returns ``(out [N, E], distinct experts)``."""
    k = experts.shape[1]
    flat = experts.flatten()  # [N*k] pair p = token p // k, choice p % k
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()  # host sync: the loop below
    pair_weights = weights.flatten()
    out = torch.zeros_like(x)
    start, touched = 0, 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        pairs = order[start:start + c]
        rows = pairs // k
        y = _expert_mlp(x.index_select(0, rows), gate_up[e], down[e]) * pair_weights[pairs, None]
        out.index_add_(0, rows, y)
        start += c
        touched += 1
    return out, touched


def _touched(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Distinct entries of ``experts`` as a device scalar (no host sync)."""
    hit = torch.zeros(num_experts, dtype=torch.bool, device=experts.device)
    return hit.index_fill_(0, experts.flatten(), True).sum()


def dispatch_grouped(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                     down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert-sorted pairs through grouped GEMMs (static shapes, no host sync).
    Returns ``(out [N, E], distinct experts as a device scalar)``."""
    k = experts.shape[1]
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)  # [N*k] pairs grouped by expert
    counts = torch.zeros(gate_up.shape[0], dtype=torch.long, device=flat.device)  # [X] static size: no host sync
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # (bincount on CUDA reads its size from the device)
    ends = torch.cumsum(counts, 0).to(torch.int32)  # [X] group ends
    rows = order // k
    h = F.grouped_mm(x.index_select(0, rows), gate_up.transpose(1, 2), offs=ends)  # [N*k, 2I]
    gate, up = h.chunk(2, dim=-1)
    y = F.grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=ends)  # [N*k, E]
    y = y * weights.flatten()[order, None]
    return torch.zeros_like(x).index_add_(0, rows, y), _touched(experts, gate_up.shape[0])


def dispatch_dense(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert over every token, combined by the routing weights (static shapes).
    Returns ``(out [N, E], distinct experts as a device scalar)``."""
    combine = torch.zeros(x.shape[0], gate_up.shape[0], dtype=x.dtype, device=x.device)
    combine.scatter_(1, experts, weights)  # [N, X], zero where a token did not route
    y = _expert_mlp(x.unsqueeze(0).expand(gate_up.shape[0], -1, -1), gate_up, down)  # [X, N, E]
    return torch.einsum("nx,xne->ne", combine, y), _touched(experts, gate_up.shape[0])


class MoE(nn.Module):
    """A routed mixture-of-experts MLP (module names: ``router``, ``experts_gate_up``,
    ``experts_down``; state dict: ``router.weight`` and ``experts.{j}.gate/up/down.weight``;
    qwen2_moe also ``shared_expert.gate/up/down.weight`` and ``shared_expert_gate.weight``).

    Attributes:
        dispatch: ``"gather"``, ``"grouped"`` or ``"dense"`` (see the module docstring); graph
            capture runs ``dense`` in place of ``gather``, which cannot be captured.
        touched: ``[]`` int64 device scalar, distinct experts of the last forward.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        e, i, x = args.hidden_size, args.moe_intermediate_size, args.num_experts
        self.num_experts, self.top_k, self.intermediate = x, args.num_experts_per_tok, i
        self.renormalise = args.norm_topk_prob
        self.router = nn.Linear(e, x, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(x, 2 * i, e))
        self.experts_down = nn.Parameter(torch.empty(x, e, i))
        self.shared = args.shared_expert_intermediate_size
        if self.shared:  # qwen2_moe: one always-on expert, fused gate/up like the routed ones
            self.shared_gate_up = nn.Parameter(torch.empty(2 * self.shared, e))
            self.shared_down = nn.Parameter(torch.empty(e, self.shared))
            self.shared_expert_gate = nn.Linear(e, 1, bias=False)
        self.dispatch = "gather"
        self.register_buffer("touched", torch.zeros((), dtype=torch.int64), persistent=False)

    def reset_touched(self, device: torch.device | str) -> None:
        """Place :attr:`touched` on ``device`` (after loading onto it)."""
        self.touched = torch.zeros((), dtype=torch.int64, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., E]`` -> ``[..., E]`` (N tokens); updates :attr:`touched`."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, E]
        weights, experts = route(x, self.router.weight, self.top_k, self.renormalise)
        mode = self.dispatch
        if mode == "gather" and x.is_cuda and torch.cuda.is_current_stream_capturing():
            mode = "dense"
        args = (x, weights, experts, self.experts_gate_up, self.experts_down)
        if mode == "gather":
            out, count = dispatch_gather(*args)
            self.touched.fill_(count)
        else:
            out, touched = (dispatch_grouped if mode == "grouped" else dispatch_dense)(*args)
            self.touched.copy_(touched)
        if self.shared:
            gate = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight))  # [N, 1]
            out = out + gate * _expert_mlp(x, self.shared_gate_up, self.shared_down)
        return out.view(shape)

    # ---- per-expert names in the state dict (Hugging Face's layout) -----------------------------
    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for fused, parts in (("experts_gate_up", ("gate", "up")), ("experts_down", ("down",))):
            keys = [[f"{prefix}experts.{j}.{p}.weight" for p in parts] for j in range(self.num_experts)]
            if all(k in state_dict for row in keys for k in row):
                state_dict[prefix + fused] = torch.stack([torch.cat([state_dict.pop(k) for k in row]) for row in keys])
        for fused, parts in (("shared_gate_up", ("gate", "up")), ("shared_down", ("down",))):
            keys = [f"{prefix}shared_expert.{p}.weight" for p in parts]
            if self.shared and all(k in state_dict for k in keys):
                state_dict[prefix + fused] = torch.cat([state_dict.pop(k) for k in keys])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        out = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        gate_up, down = out.pop(prefix + "experts_gate_up"), out.pop(prefix + "experts_down")
        for j in range(self.num_experts):
            out[f"{prefix}experts.{j}.gate.weight"], out[f"{prefix}experts.{j}.up.weight"] = gate_up[j].chunk(2)
            out[f"{prefix}experts.{j}.down.weight"] = down[j]
        if self.shared:
            gate, up = out.pop(prefix + "shared_gate_up").chunk(2)
            out[f"{prefix}shared_expert.gate.weight"], out[f"{prefix}shared_expert.up.weight"] = gate, up
            out[f"{prefix}shared_expert.down.weight"] = out.pop(prefix + "shared_down")
        return out
