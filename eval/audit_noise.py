"""How far forward shapes move the target's top-2 logit margin: the measurement behind the near-tie bound.

``python -m refspec.eval.audit_noise MODEL_DIR --dtype bf16 [--text FILE]`` cuts 8 rows of 48
tokens from the text, runs the target at batch 1 over each whole row (the reference), then in
other shapes a run meets: the 8 rows as one batch, a prefill followed by one 5-position forward
(a verify), and a prefill followed by one 1-position forward (a decode) at 16 split points. At
every position it reports, in ulps of the reference's top logit magnitude in the model's dtype
(:func:`refspec.eval.audit.ulp`), how far the reference's top-2 margin moved. The near-tie
bound (:func:`refspec.eval.audit.near_tie_bound`) must sit above the worst of these.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

import torch

from refspec.eval.audit import near_tie_bound, ulp

ROWS, LENGTH, VERIFY = 8, 48, 5


def _forward(model: Any, tokens: torch.Tensor, split: int | None = None) -> torch.Tensor:
    """Logits ``[B, S - split, V]`` of the positions after ``split`` (a prefill first), or of all ``S``."""
    b, s = tokens.shape
    pos = torch.arange(s, device=tokens.device).expand(b, s)  # [B, S]
    cache = model.new_cache(b, s)
    if split:
        model.forward(tokens[:, :split], pos[:, :split], cache, logits_at=pos[:, :0])
    return model.forward(tokens[:, split or 0:], pos[:, split or 0:], cache)[0]


def margin_shifts(other: torch.Tensor, ref: torch.Tensor, dtype: Any) -> dict[str, float]:
    """Top-2 margin shift of ``other`` against ``ref`` (both ``[..., V]``), in ulps, and the bound's ulps."""
    shifts, bounds = [], []
    for o, r in zip(other.reshape(-1, other.shape[-1]).float(), ref.reshape(-1, ref.shape[-1]).float()):
        scale = float(r.abs().max())
        top = torch.topk(r, 2).indices
        shifts.append(abs(float((o[top[0]] - o[top[1]]) - (r[top[0]] - r[top[1]]))) / ulp(scale, dtype))
        bounds.append(near_tie_bound(scale, dtype) / ulp(scale, dtype))
    v = torch.tensor(shifts)
    return {"positions": len(shifts), "p50_ulp": float(v.quantile(0.5)), "p99_ulp": float(v.quantile(0.99)),
            "max_ulp": float(v.max()), "bound_ulp_min": min(bounds)}


def measure(model: Any, rows: torch.Tensor) -> dict[str, dict[str, float]]:
    """Margin shifts of every shape against batch-1 whole-row forwards of ``rows`` ``[B, S]``."""
    with torch.no_grad():
        ref = torch.cat([_forward(model, rows[i:i + 1]) for i in range(rows.shape[0])])    # [B, S, V]
        batched = _forward(model, rows)
        verify = _forward(model, rows, rows.shape[1] - VERIFY)
        decode = [(_forward(model, rows[:, :s], s - 1), ref[:, s - 1:s]) for s in range(16, rows.shape[1], 2)]
    dtype = model.dtype
    return {f"batch {rows.shape[0]} vs 1": margin_shifts(batched, ref, dtype),
            f"verify {VERIFY} positions after a prefill": margin_shifts(verify, ref[:, -VERIFY:], dtype),
            "decode 1 position after a prefill": margin_shifts(torch.cat([d for d, _ in decode], 1),
                                                               torch.cat([r for _, r in decode], 1), dtype)}


def main(argv: Sequence[str] | None = None) -> int:
    from refspec.assets.tokenizer import load_tokenizer
    from refspec.models import load_model, prepare_target

    p = argparse.ArgumentParser(prog="python -m refspec.eval.audit_noise", description=__doc__.split("\n")[0])
    p.add_argument("model", type=Path, help="model directory (safetensors and tokenizer.json)")
    p.add_argument("--dtype", default="bf16", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--text", type=Path, default=None, help="text to cut rows from (default: the package docstring)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    import refspec

    text = args.text.read_text() if args.text else (refspec.__doc__ or "") * 4
    ids = load_tokenizer(args.model).encode(text)
    stride = max(1, (len(ids) - LENGTH) // ROWS)
    if len(ids) < LENGTH + ROWS:
        raise SystemExit(f"error: the text has {len(ids)} tokens; give --text with at least {LENGTH + ROWS}")
    rows = torch.tensor([ids[i * stride:i * stride + LENGTH] for i in range(ROWS)], device=args.device)
    model = load_model(args.model, dtype=dtype, device=args.device)
    prepare_target(model)  # the products a run takes (on a CPU, this machine's GEMM plan)
    print(json.dumps({"model": str(args.model), "dtype": args.dtype, "device": args.device,
                      **measure(model, rows)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["measure", "margin_shifts", "main"]
