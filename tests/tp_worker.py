"""One rank of the tensor-parallel engine check (run as N processes by tests/test_tp.py).

Every rank loads each tiny family whole (the TP 1 reference, decoded on its own, no collective)
and as its share (TP N), decodes the same prompts with each drafter greedily and sampled with one
seed, and compares token for token. Rank 0 writes ``{case: {"tp1": tokens, "tpn": tokens}}`` as
JSON to the file named by its first argument. A llama loaded whole and cut to the rank's share
in memory (``prepare_target(model, tp=group)``) decodes as the share read from its files does.
With ``cuda`` (one GPU per rank, NCCL) the greedy cases run eager and through CUDA graphs, whose
capture records the all-reduces.

Usage: python tests/tp_worker.py OUT.json MODELS_DIR [cuda]
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from refspec.drafters.draft_model import DraftModelDrafter
from refspec.drafters.eagle import EagleDrafter
from refspec.drafters.eagle_body import HeadConfig
from refspec.drafters.eagle_head import new_head
from refspec.drafters.ngram import NgramDrafter
from refspec.engine import Engine, EngineConfig
from refspec.models import load_model, prepare_target
from refspec.models.tp.group import init_tensor_parallel
from refspec.models.tp.loading import load_sharded
from refspec.sampling import SamplingConfig
from refspec.serving import Request

FAMILIES = ("llama", "llama3", "qwen2", "qwen3", "gemma3")
EAGLE_FAMILIES = ("llama", "qwen3")
PROMPTS = [[5, 9, 11, 5, 9, 11, 5, 9], [7, 3, 8, 20, 21, 7, 3], [40, 41, 42, 40, 41, 42, 40, 41, 42, 13]]


def drafters(model, full, family: str) -> dict:
    """Builders of each drafter for ``model`` (``full``: the unsharded model, for a replicated draft model)."""
    out = {"none": lambda: None, "ngram": lambda: NgramDrafter(max_n=3),
           "draft-model-self": lambda: DraftModelDrafter(model.truncated(1), target_vocab_size=model.args.vocab_size),
           "draft-model-replicated": lambda: DraftModelDrafter(full.truncated(1),
                                                               target_vocab_size=model.args.vocab_size)}
    if family in EAGLE_FAMILIES:
        def eagle():
            torch.manual_seed(7)  # the same untrained head on every rank and for both targets
            head = new_head(HeadConfig.for_target("eagle", model.args)).to(model.device).eval().requires_grad_(False)
            return EagleDrafter(head, model)
        out["eagle"] = eagle
    return out


def decode(model, drafter, sampled: bool, serve: bool, graphs: bool = False) -> list[list[int]]:
    sampling = SamplingConfig(temperature=0.8, top_k=20) if sampled else SamplingConfig()
    k = 0 if drafter is None else 3
    target = prepare_target(model, cuda_graphs=graphs)
    engine = Engine(target, drafter, config=EngineConfig(k=k, sampling=sampling), eos_token_ids=())
    gen = torch.Generator(device=model.device).manual_seed(11)
    if serve:  # continuous batching: 5 requests on 2 slots, so refills prefill into freed rows
        reqs = [Request(id=i, prompt=tuple(PROMPTS[i % 3]), max_new_tokens=6 + 2 * i) for i in range(5)]
        return [r.tokens for r in engine.serve(reqs, batch=2, generator=gen).requests]
    return engine.generate(PROMPTS, max_new_tokens=12, generator=gen).tokens


def cases(family: str) -> list[tuple[str, bool, bool]]:
    """(drafter, sampled, serve) decoded for ``family``: every drafter greedy; plain and n-gram
    sampled and served; on llama also the replicated draft model and EAGLE sampled."""
    out = [(d, False, False) for d in ("none", "ngram", "draft-model-self")]
    out += [("none", True, False), ("ngram", True, False), ("ngram", False, True), ("none", True, True)]
    if family in EAGLE_FAMILIES:
        out.append(("eagle", False, False))
    if family == "llama":
        out += [("draft-model-replicated", False, False), ("draft-model-replicated", True, False),
                ("draft-model-self", True, False), ("eagle", True, False)]
    return out


def main(out_path: str, models_dir: str, device: str = "cpu") -> int:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(int(os.environ["WORLD_SIZE"]), device)
    results = {}
    for family in FAMILIES:
        path = Path(models_dir) / family
        full, shard = load_model(path, device=tp.device), load_sharded(path, tp, device=tp.device)
        make_tpn, make_tp1 = drafters(shard, full, family), drafters(full, full, family)
        todo = [(n, s, v, False) for n, s, v in cases(family)]
        if device == "cuda":
            todo += [(n, False, False, True) for n in ("none", "ngram")]
        for name, sampled, serve, graphs in todo:
            case = (f"{family}/{name}/{'sampled' if sampled else 'greedy'}/{'serve' if serve else 'batch'}"
                    f"{'/graphs' if graphs else ''}")
            results[case] = {"tp1": decode(full, make_tp1[name](), sampled, serve, graphs),
                             "tpn": decode(shard, make_tpn[name](), sampled, serve, graphs)}
        if family == "llama":
            cut = prepare_target(load_model(path, device=tp.device), tp=tp).model
            results[f"{family}/ngram-cut-in-memory/greedy/batch"] = {
                "tp1": decode(full, NgramDrafter(max_n=3), False, False),
                "tpn": decode(cut, NgramDrafter(max_n=3), False, False)}
    if tp.rank == 0:
        Path(out_path).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
