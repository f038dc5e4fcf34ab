"""Acceptance length and speed of the EAGLE heads on the five corpora, printed as JSON.

For each corpus (held-out ``eval`` prompts via ``refspec.eval.corpora``) and each drafter
configuration (``eagle`` / ``eagle3``, chain of k drafts or EAGLE-2 tree), greedy decoding
reports tau (accepted + 1 per verify step, averaged over active row-steps). Then, in the
same run, tokens per second of plain decoding and of each configuration at batch 1 and 8
on conversation prompts (after one warm-up generation each).

Usage::

    python scripts/eagle_tau.py --model smollm2-135m --prompts 8 --new-tokens 64 > tau.json

Heads are found like ``--drafter eagle`` finds them (``drafters/heads/`` then
``$REFSPEC_HOME/heads/``) unless ``--eagle-head`` / ``--eagle3-head`` name directories.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

import torch

CORPORA = ("conversation", "code", "math", "english", "romansh")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bf16",
                   help="fp32 or bf16 (tau and speed are measured in this dtype; bf16 is emulated, hence slower "
                        "than fp32, on CPUs without AVX512_BF16 or AMX)")
    p.add_argument("--prompts", type=int, default=8, help="eval prompts per corpus for tau")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--k", type=int, default=4, help="chain length")
    p.add_argument("--tree-budget", type=int, default=16)
    p.add_argument("--tree-topk", type=int, default=4)
    p.add_argument("--tree-depth", type=int, default=5)
    p.add_argument("--speed-batches", default="1,8", help="batch sizes timed")
    p.add_argument("--speed-tokens", type=int, default=64, help="tokens per row in the timed runs")
    p.add_argument("--eagle-head", type=Path, default=None)
    p.add_argument("--eagle3-head", type=Path, default=None)
    p.add_argument("--corpora", default=",".join(CORPORA), help="comma-separated corpora for tau")
    p.add_argument("--configs", default="eagle-chain,eagle-tree,eagle3-chain,eagle3-tree",
                   help="comma-separated configurations (head kind - chain or tree)")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-tau", action="store_true")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from refspec.drafters.eagle import TreeConfig, find_head, load_head
    from refspec.eval.corpora.catalog import load_corpus
    from refspec.eval.corpora.prompts import build_prompts
    from refspec.eval.runtime import load_target, parse_dtype, set_threads

    set_threads()
    dtype = parse_dtype(args.dtype)
    target = load_target(args.model, dtype=dtype, device=torch.device("cpu"), progress=False)
    m, tok = target.model, target.tokenizer
    tree = TreeConfig(topk=args.tree_topk, depth=args.tree_depth, budget=args.tree_budget)
    heads = {}
    for kind, path in (("eagle", args.eagle_head), ("eagle3", args.eagle3_head)):
        heads[kind], _ = load_head(path or find_head(args.model, kind), m.args, dtype=dtype)
    configs = {f"{kind}-{mode}": (kind, tree if mode == "tree" else None) for kind in heads for mode in ("chain", "tree")}
    unknown = set(args.configs.split(",")) - configs.keys() | set(args.corpora.split(",")) - set(CORPORA)
    if unknown:
        raise SystemExit(f"unknown configurations or corpora: {sorted(unknown)}")
    configs = {name: configs[name] for name in args.configs.split(",")}
    engine = _engine_factory(m, target.eos_token_ids, heads, configs, args.k)
    prompts = {} if args.skip_tau else {
        name: build_prompts(load_corpus(name, split="eval"), tok, chat=True)[: args.prompts]
        for name in args.corpora.split(",")}
    tau = _taus(engine, configs, prompts, args.new_tokens)
    speed: dict[str, dict[str, float]] = {}
    if not args.skip_speed:
        conv = build_prompts(load_corpus("conversation", split="eval"), tok, chat=True)
        speed = _speed(engine, configs, conv, [int(x) for x in args.speed_batches.split(",")], args.speed_tokens)
    checks = {name: {"conversation<code": tau["conversation"][name] < tau["code"][name],
                     "romansh<english": tau["romansh"][name] < tau["english"][name]}
              for name in configs} if set(CORPORA) <= tau.keys() else {}
    print(json.dumps({"model": args.model, "dtype": args.dtype, "prompts_per_corpus": args.prompts,
                      "new_tokens": args.new_tokens, "k": args.k, "tree": dataclasses.asdict(tree), "tau": tau, "checks": checks, "tokens_per_s": speed,
                      "speedup": {b: {n: round(v / s["plain"], 3) for n, v in s.items() if n != "plain"}
                                  for b, s in speed.items()}}, indent=2))
    return 0


def _engine_factory(m, eos, heads: dict, configs: dict, k: int):
    """``engine(name)``: an engine for configuration ``name`` (None: plain decoding)."""
    from refspec.drafters.eagle import EagleDrafter
    from refspec.engine import Engine, EngineConfig

    def engine(name: str | None) -> Engine:
        if name is None:
            return Engine(m, eos_token_ids=eos)
        kind, t = configs[name]
        return Engine(m, EagleDrafter(heads[kind], m, tree=t), config=EngineConfig(k=k if t is None else t.budget),
                      eos_token_ids=eos)

    return engine


def _taus(engine, configs: dict, prompts: dict[str, list[list[int]]], new_tokens: int) -> dict[str, dict[str, float]]:
    """tau per corpus and configuration, prompts decoded in batches of 8."""
    tau: dict[str, dict[str, float]] = {}
    for corpus, ps in prompts.items():
        tau[corpus] = {}
        for name in configs:
            vals = []
            eng = engine(name)
            for i in range(0, len(ps), 8):
                gen = eng.generate(ps[i:i + 8], max_new_tokens=new_tokens)
                vals += [a + 1 for step in gen.accepted_per_step for a in step if a >= 0]
            tau[corpus][name] = round(sum(vals) / len(vals), 3)
            print(f"tau {corpus:12s} {name:12s} {tau[corpus][name]:.3f}", file=sys.stderr, flush=True)
    return tau


def _speed(engine, configs: dict, conv: list[list[int]], batches: list[int], tokens: int) -> dict[str, dict[str, float]]:
    """tokens/s of plain decoding and of each configuration per batch size (after a warm-up each)."""
    speed: dict[str, dict[str, float]] = {}
    for b in batches:
        batch = conv[-b:]  # prompts not used for tau when there are enough
        speed[str(b)] = {}
        for name in [None, *configs]:
            eng = engine(name)
            eng.generate(batch, max_new_tokens=8)  # warm-up
            t0 = time.perf_counter()
            gen = eng.generate(batch, max_new_tokens=tokens)
            dt = time.perf_counter() - t0
            speed[str(b)][name or "plain"] = round(gen.num_emitted / dt, 2)
            print(f"speed batch {b} {name or 'plain':12s} {gen.num_emitted / dt:.1f} tok/s", file=sys.stderr,
                  flush=True)
    return speed


if __name__ == "__main__":
    sys.exit(main())
