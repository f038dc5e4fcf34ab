"""Measure the block drafter on a real target: tau per corpus and K, verify width, tokens/s.

One run prints one JSON object on stdout (progress goes to stderr):

* ``tau``: acceptance length (accepted + bonus per verify step, greedy) per drafter, K and
  corpus, on the eval split of each corpus (``load_corpus(name, split="eval")`` +
  ``build_prompts``), for ``block`` at K = 4, 8, 16 and, beside it, ``eagle`` (and ``eagle3``)
  at the same K where a trained head exists;
* ``verified_tokens_per_step``: target positions each verify step computes, batch x (K + 1),
  at batch 1, 8 and 64 (what pushes verification towards the compute-bound regime), with the
  H100/H200 ridge points for reference;
* ``throughput``: emitted tokens per second of ``generate`` at batch 1 and 8 against plain
  decoding, measured on this machine (wall clock, after a warm-up), in the run's dtype.

Usage::

    python scripts/block_tau.py --model smollm2-135m --prompts 16 --max-new-tokens 64 > block_tau.json
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from typing import Any, Sequence

import torch

log = logging.getLogger("block_tau")

CORPORA = ("conversation", "code", "math", "english", "romansh")
RIDGE_FLOP_PER_BYTE = {"h100-sxm": 295, "h200-sxm": 206}  # dense bf16 peak / HBM bandwidth of the SXM parts


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bf16", help="dtype of the tokens/s comparison")
    p.add_argument("--tau-dtype", default=None, help="dtype of the tau runs (default: --dtype)")
    p.add_argument("--corpora", default=",".join(CORPORA))
    p.add_argument("--ks", default="4,8,16", help="draft lengths K")
    p.add_argument("--compare", default="eagle,eagle3", help="other drafters measured at the same K if available")
    p.add_argument("--prompts", type=int, default=16, help="eval prompts per corpus (one ragged batch)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--speed-batches", default="1,8", help="batch sizes of the tokens/s comparison")
    p.add_argument("--speed-corpus", default="conversation")
    p.add_argument("--speed-tokens", type=int, default=64, help="max_new_tokens of the tokens/s runs")
    p.add_argument("--speed-ks", default=None, help="K values of the tokens/s runs (default: --ks)")
    p.add_argument("--head", default=None, help="block head directory (default: the target's trained head)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    return p


def _build(name: str, target, model_name: str, options: dict[str, Any]):
    from refspec.drafters import registry

    ctx = registry.DrafterContext(target=target.model, target_name=model_name, tokenizer_fingerprint=target.fingerprint,
                                  dtype=target.model.dtype, device=target.model.device, options=options)
    return registry.build(name, ctx)


def _drafters(target, model_name: str, block_options: dict[str, Any], compare: Sequence[str]):
    """``block`` and the comparison drafters that can be built (others: the reason why not)."""
    from refspec.drafting import DrafterError

    drafters: dict[str, Any] = {}
    unavailable: dict[str, str] = {}
    for name, o in [("block", block_options)] + [(n, {}) for n in compare]:
        try:
            drafters[name] = _build(name, target, model_name, o)
        except DrafterError as exc:
            unavailable[name] = str(exc).split("\n")[0]
            log.warning("%s unavailable: %s", name, unavailable[name])
    return drafters, unavailable


def _generate(target, drafter, k: int, prompts: Sequence[Sequence[int]], max_new: int):
    from refspec.engine import Engine, EngineConfig

    engine = Engine(target.model, drafter, config=EngineConfig(k=k), eos_token_ids=target.eos_token_ids)
    t0 = time.perf_counter()
    gen = engine.generate(prompts, max_new_tokens=max_new)
    return gen, time.perf_counter() - t0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    from refspec.eval.runtime import load_target, parse_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    ks = [int(x) for x in args.ks.split(",")]
    speed_ks = [int(x) for x in args.speed_ks.split(",")] if args.speed_ks else ks
    tau_dtype = args.tau_dtype or args.dtype
    target = load_target(args.model, dtype=parse_dtype(tau_dtype), device=torch.device("cpu"))
    prompts = _corpus_prompts(args.corpora.split(","), args.prompts, target.tokenizer)
    opts = {"head": args.head} if args.head else {}
    compare = [n for n in args.compare.split(",") if n]
    drafters, unavailable = _drafters(target, args.model, opts, compare)
    if "block" not in drafters:
        print(json.dumps({"error": unavailable.get("block")}))
        return 2
    tau, steps = _taus(target, drafters, ks, prompts, args.max_new_tokens)  # 1. per drafter, K and corpus
    verified = {str(b): {str(k): b * (k + 1) for k in [0] + ks} for b in (1, 8, 64)}  # 2. positions per verify
    if args.dtype != tau_dtype:  # 3. tokens/s against plain decoding, same prompts, one process
        del target, drafters
        target = load_target(args.model, dtype=parse_dtype(args.dtype), device=torch.device("cpu"))
        drafters, _ = _drafters(target, args.model, opts, compare)
    pool = prompts.get(args.speed_corpus) or next(iter(prompts.values()))
    speed = {f"batch{b}": _speed_row(target, drafters, [pool[i % len(pool)] for i in range(b)], speed_ks,
                                     args.speed_tokens) for b in (int(x) for x in args.speed_batches.split(","))}
    head = drafters["block"].head
    out = {
        "model": args.model, "tau_dtype": tau_dtype, "throughput_dtype": args.dtype, "device": "cpu", "torch": torch.__version__,
        "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        "prompts_per_corpus": {c: len(p) for c, p in prompts.items()}, "max_new_tokens": args.max_new_tokens,
        "block_head": {"block_size": head.block_size, "layers": head.num_layers,
                       "feature_layers": list(head.config.feature_layers),
                       "parameters": sum(p.numel() for p in head.parameters()),
                       "provenance": {k: v for k, v in getattr(head, "provenance", {}).items()
                                      if k in ("command", "final_loss", "train_time_s", "steps", "data")}},
        "unavailable": unavailable,
        "tau": tau, "verify_steps": steps,
        "verified_tokens_per_step": verified, "ridge_flop_per_byte": RIDGE_FLOP_PER_BYTE,
        "throughput": speed,
        "notes": ["tau = accepted + 1 per verify step, greedy, mean over active row-steps",
                  "tokens/s is wall clock on this CPU; other processes sharing the cores make it noisy "
                  "(see load_average_1m_at_end)",
                  "UDHR and HumanEval are widely replicated online: acceptance may be inflated by memorisation"],
    }
    print(json.dumps(out, indent=2))
    return 0


def _corpus_prompts(names: Sequence[str], count: int, tokenizer) -> dict[str, list[list[int]]]:
    """The first ``count`` eval prompts of each corpus (all of them for 0), as token ids."""
    from refspec.eval.corpora.catalog import load_corpus
    from refspec.eval.corpora.prompts import build_prompts

    prompts: dict[str, list[list[int]]] = {}
    for name in names:
        rows = load_corpus(name, split="eval").select(range(count)) if count else load_corpus(name)
        prompts[name] = build_prompts(rows, tokenizer, chat=True)
        log.info("%s: %d prompts, %d-%d tokens", name, len(prompts[name]), min(map(len, prompts[name])),
                 max(map(len, prompts[name])))
    return prompts


def _taus(target, drafters: dict[str, Any], ks: Sequence[int], prompts: dict[str, list[list[int]]],
          max_new: int) -> tuple[dict[str, dict[str, dict[str, float]]], dict[str, dict[str, dict[str, int]]]]:
    """tau and verify steps per drafter, K and corpus (one ragged batch per corpus), with each K's mean."""
    from refspec.drafting import DrafterError

    tau: dict[str, dict[str, dict[str, float]]] = {}
    steps: dict[str, dict[str, dict[str, int]]] = {}
    block_size = drafters["block"].block_size
    for name, drafter in drafters.items():
        for k in ks:
            if name == "block" and k > block_size:
                log.warning("block head drafts at most %d; skipping K=%d", block_size, k)
                continue
            for corpus, ps in prompts.items():
                try:
                    gen, dt = _generate(target, drafter, k, ps, max_new)
                except DrafterError as exc:
                    log.warning("%s K=%d: %s", name, k, exc)
                    break
                tau.setdefault(name, {}).setdefault(str(k), {})[corpus] = round(gen.tau, 3)
                steps.setdefault(name, {}).setdefault(str(k), {})[corpus] = gen.steps
                log.info("tau %s K=%d %s: %.3f (%d steps, %.1f s)", name, k, corpus, gen.tau, gen.steps, dt)
        for k, row in tau.get(name, {}).items():
            row["mean"] = round(sum(row[c] for c in prompts) / len(prompts), 3)
    return tau, steps


def _speed_row(target, drafters: dict[str, Any], batch: list[list[int]], ks: Sequence[int],
               max_new: int) -> dict[str, Any]:
    """tokens/s, tau and speed-up over plain decoding of every drafter and K on one batch."""
    _generate(target, None, 0, batch, 8)  # warm-up
    block_size = drafters["block"].block_size
    row: dict[str, Any] = {}
    runs = [("plain", None, 0)] + [(f"{n}_k{k}", d, k) for n, d in drafters.items() for k in ks
                                   if not (n == "block" and k > block_size)]
    for label, drafter, k in runs:
        gen, dt = _generate(target, drafter, k, batch, max_new)
        row[label] = {"tokens_per_s": round(gen.num_emitted / dt, 2), "tau": round(gen.tau, 3),
                      "steps": gen.steps, "wall_s": round(dt, 2)}
        log.info("speed b=%d %s: %.1f tok/s (tau %.2f)", len(batch), label, gen.num_emitted / dt, gen.tau)
    base = row["plain"]["tokens_per_s"]
    for r in row.values():
        r["speedup"] = round(r["tokens_per_s"] / base, 3)
    return row


if __name__ == "__main__":
    sys.exit(main())
