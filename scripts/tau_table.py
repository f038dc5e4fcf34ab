"""Acceptance length tau per corpus and per drafter (chain and tree), greedy and sampled, as JSON.

One ragged batch of held-out ``eval`` prompts per corpus, the same prompts for every drafter;
tau = accepted + 1 per verify step over active rows (``Generation.tau``). Sampled runs use one
seed per (corpus, configuration), so a rerun gives the same figures.

Usage::

    python scripts/tau_table.py --corpora conversation,code,math --prompts 4 --new-tokens 32 \
        --temperatures 0,0.7 > tau.json

N-gram (prompt lookup) needs no head and drafts all K tokens (``trim=false``). Heads: the ones
``--drafter eagle|eagle3|block`` find, or ``--head KIND=DIR`` (repeatable).
Trees: ``--tree-topk/--tree-depth/--tree-budget`` (default 4/5/16; EAGLE-2's own is 10/6/60).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

CONFIGS = ("ngram-chain", "eagle-chain", "eagle-tree", "eagle3-chain", "eagle3-tree", "block-chain")


def _drafter(name: str, target, heads: dict[str, str], tree: dict[str, int]):
    from refspec.drafters import registry

    kind, shape = name.split("-")
    options = {"head": heads[kind]} if kind in heads else {}
    if kind == "ngram":
        options["trim"] = "false"  # acceptance of the full K-token draft, not the cost-trimmed one
    if shape == "tree":
        options.update({"tree": "true", **{f"tree_{key}": str(v) for key, v in tree.items()}})
    ctx = registry.DrafterContext(target=target.model, target_name=target.name, tokenizer_fingerprint=target.fingerprint,
                                  dtype=target.model.dtype, device=target.model.device, options=options)
    return registry.build(kind, ctx)


def main(argv=None) -> int:
    from refspec.engine import Engine, EngineConfig
    from refspec.eval.corpora.catalog import load_corpus
    from refspec.eval.corpora.prompts import build_prompts
    from refspec.eval.runtime import load_target, parse_dtype
    from refspec.sampling import SamplingConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--corpora", default="conversation,code,math,english,romansh")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--k", type=int, default=4, help="chain drafts per step")
    p.add_argument("--tree-budget", type=int, default=16, help="tree nodes verified per step")
    p.add_argument("--tree-topk", type=int, default=4, help="EAGLE-2 tree: children expanded per node and nodes per level")
    p.add_argument("--tree-depth", type=int, default=5, help="EAGLE-2 tree: levels grown")
    p.add_argument("--block-k", type=int, default=None, help="block drafts per step (default: --k)")
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--head", action="append", default=[], metavar="KIND=DIR")
    args = p.parse_args(argv)
    heads = dict(h.split("=", 1) for h in args.head)
    target = load_target(args.model, dtype=parse_dtype(args.dtype), device=torch.device("cpu"), progress=False)
    tree = {"budget": args.tree_budget, "topk": args.tree_topk, "depth": args.tree_depth}
    drafters = {c: _drafter(c, target, heads, tree) for c in args.configs.split(",")}
    chain_k = {"block": args.block_k or args.k}
    rows = []
    for corpus in args.corpora.split(","):
        prompts = build_prompts(load_corpus(corpus, split="eval"), target.tokenizer,
                                        chat=True)[: args.prompts]  # as the eval CLI renders them
        for temp in (float(t) for t in args.temperatures.split(",")):
            for name, drafter in drafters.items():
                k = args.tree_budget if name.endswith("tree") else chain_k.get(name.split("-")[0], args.k)
                cfg = EngineConfig(k=k, sampling=SamplingConfig(temperature=temp))
                gen = torch.Generator().manual_seed(0)
                t0 = time.perf_counter()
                out = Engine(target.model, drafter, config=cfg, eos_token_ids=target.eos_token_ids).generate(
                    prompts, max_new_tokens=args.new_tokens, generator=gen)
                row = {"corpus": corpus, "config": name, "k": k, "temperature": temp, "tau": round(out.tau, 3),
                       "steps": out.steps, "seconds": round(time.perf_counter() - t0, 1)}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"model": args.model, "dtype": args.dtype, "prompts": args.prompts, "new_tokens": args.new_tokens,
                      "tree": tree, "heads": heads, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
