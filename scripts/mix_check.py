"""The phase loops checked by a fit over several mixes, on a GPU's counter (or a simulated one).

In one steady run every step drafts, verifies and commits once: no fit over its sub-windows is
determined, and a shift of power between phases that leaves the total unchanged passes every
check the loops have. This script serves an EAGLE-drafting, random-weight target of a real
architecture at several K x batch mixes, each followed by its phase loops (:mod:`refspec.phase_loops`),
then fits one power per phase over the sub-windows of all the mixes and holds each mix's loops
against it (:func:`refspec.energy.accounting.mix_check.mix_check`). Prompts are random token ids: what
the forwards cost does not depend on what they say.

    python3 scripts/mix_check.py --device cuda --meter nvml --out DIR          # on a GPU
    python3 scripts/mix_check.py --device cpu --meter simulated:cpu:period_ms=10:sample_ms=10 --toy

It prints each mix's split gate and the check, and writes ``mix_check.json`` and the ledgers to
``--out``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch

from refspec.energy.ledger.counter_records import counter_ledger
from refspec.energy.ledger.writer import Ledger
from refspec.energy.ledger.read import read_ledger
from refspec.energy.meters.make import make_meter
from refspec.energy.accounting.mix_check import mix_check
from refspec.energy.accounting.phase_energy import phase_energy
from refspec.engine import Engine, EngineConfig
from refspec.phase_loops import LoopTarget, run_phase_loops, shapes_of
from refspec.sampling import SamplingConfig
from refspec.serving import Request


def _target(args: argparse.Namespace) -> tuple[Any, Any]:
    """A random-weight target of ``--arch`` (a toy of its family with ``--toy``) and an EAGLE drafter."""
    from refspec.drafters.eagle import EagleDrafter
    from refspec.drafters.eagle_head import HeadConfig, new_head
    from refspec.models.random_models import random_model, shrunk_config

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    arch = (shrunk_config(args.arch, hidden_size=64, num_layers=2, vocab_size=512, head_dim=16) if args.toy
            else args.arch)
    model = random_model(arch, device=device, dtype=dtype, seed=args.seed)
    torch.manual_seed(args.seed)
    with torch.device(device):
        head = new_head(HeadConfig.for_target("eagle", model.args))
    for p in head.parameters():
        p.data = p.data.to(dtype)
    return model, EagleDrafter(head.eval(), model)


def serve_mix(model: Any, drafter: Any, meter: Any, *, k: int, batch: int, args: argparse.Namespace,
              path: Path) -> list[tuple]:
    """One mix: a closed-loop stream at ``batch`` slots drafting ``k``, then its loops; its ledger's runs."""
    rng = random.Random(args.seed + 1000 * k + batch)
    vocab = model.args.vocab_size
    requests = [Request(id=i, prompt=tuple(rng.randrange(3, vocab) for _ in range(rng.randint(64, 192))),
                        max_new_tokens=rng.randint(args.max_new_tokens // 2, args.max_new_tokens))
                for i in range(args.requests_per_slot * batch)]
    with counter_ledger(meter, Ledger(path, run_id=f"k{k}-b{batch}", meter_source=meter.source,
                                      idle_w=meter.idle_w)) as led:
        engine = Engine(model, drafter, config=EngineConfig(k=k), meter=meter, observers=[led], eos_token_ids=())
        res = engine.serve(requests, batch=batch)
        led.end_run()
        shapes = shapes_of(res.events, batch=batch, k=k, prompts=[q.prompt for q in requests])
        loops = run_phase_loops(LoopTarget(target=model, drafter=drafter, verify_fn=model, sampling=SamplingConfig()),
                                shapes, meter, seed=args.seed)
        for phase, loop in loops.items():
            led.ledger.write_loop(phase, loop, meter.source)
    records = read_ledger(path)
    return [tuple([r for r in records if r.get("kind") == kind] for kind in ("phase", "counter", "loop"))]


def _pct(shares: dict[str, float] | None) -> str:
    return "n/a" if shares is None else ", ".join(f"{p} {100 * x:.1f}%" for p, x in sorted(shares.items()))


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--meter", default="auto", help="the --meter spec (nvml on a GPU)")
    p.add_argument("--arch", default="llama-3.1-8b")
    p.add_argument("--toy", action="store_true", help="a toy of the architecture's family (a CPU rehearsal)")
    p.add_argument("--mixes", default="4x32,2x8,6x16", help="K x batch of each mix (three fit draft, verify, commit)")
    p.add_argument("--requests-per-slot", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    meter = make_meter(args.meter)
    if getattr(meter, "idle_w", None) is None:
        meter.measure_idle_w(5.0)
    model, drafter = _target(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        mixes = {}
        for item in args.mixes.split(","):
            k, batch = (int(x) for x in item.split("x"))
            mixes[f"k{k}-b{batch}"] = runs = serve_mix(model, drafter, meter, k=k, batch=batch, args=args,
                                                       path=out / f"mix-k{k}-b{batch}.jsonl")
            pe = phase_energy(runs, host_w=meter.idle_w)
            gate = "passed" if pe.split_gate.passed else "FAILED: " + "; ".join(pe.split_gate.reasons)
            residual = ("n/a" if pe.interaction_residual is None else
                        f"{pe.interaction_residual:+.2%} (up to {pe.interaction_points:.1f} points of share)")
            print(f"k{k}-b{batch}: {pe.method}; interaction residual {residual}; gate {gate}", flush=True)
        check = mix_check(mixes, host_w=meter.idle_w)
        (out / "mix_check.json").write_text(json.dumps({"meter": meter.source, **dataclasses.asdict(check)},
                                                       indent=1) + "\n")
        print(f"fit over {', '.join(mixes)} ({meter.source}): "
              f"{'determined' if check.fit_determined else 'undetermined'}; powers {check.fit_power_w}")
        for name in mixes:
            print(f"  {name}: fit {_pct(check.share_fit.get(name))}; loops {_pct(check.share_loops[name])}")
        print("mix check passed" if check.passed else "mix check FAILED: " + "; ".join(check.reasons))


if __name__ == "__main__":
    main()
