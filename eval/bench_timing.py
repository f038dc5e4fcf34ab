"""Timing helpers of ``python -m refspec.eval bench``: best-of-N and interleaved wall times, the
memory-bandwidth floor, and calls of refspec's engine and of ``transformers.generate`` ready to time.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Best wall time of ``repeats`` runs (after one warm-up) and the last result."""
    fn()
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, tuple[float, Any]]:
    """Best wall time of each function and the result of that same run (so figures taken
    from the result, such as per-step times, describe the run the wall time describes), after
    one warm-up each, running the functions in turn ``repeats`` times so a slow spell of a
    shared machine hits them alike."""
    for fn in fns.values():
        fn()
    best: dict[str, tuple[float, Any]] = {name: (float("inf"), None) for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            out = fn()
            wall = time.perf_counter() - t0
            if wall < best[name][0]:
                best[name] = (wall, out)
    return best


def measure_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes/s of a streaming read of ``mib`` MiB (a sum over an fp32 tensor): the floor of a
    decode step that reads every weight once, whatever the weights' dtype."""
    buf = torch.ones(mib * 2**20 // 4)
    t, _ = _timed(lambda: buf.sum(), repeats)
    return buf.numel() * 4 / t


def weight_bytes(model) -> int:
    """Bytes of distinct parameters read by one decode step (tied head counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def refspec_run(model, prompts: list[list[int]], new_tokens: int) -> Callable[[], Any]:
    from refspec.engine import Engine

    engine = Engine(model)  # no EOS: every row decodes the full budget
    return lambda: engine.generate(prompts, max_new_tokens=new_tokens)


def products_run(model, rows: int) -> Callable[[], Any]:
    """One decode step's matrix products alone (every block matrix and the LM head, ``rows``
    rows each, in the forms the model's plan chose): the part of a step no fusion of the other ops removes."""
    from refspec.models.cpu_speed import copied_linears
    from refspec.models.gemm_forms import linear

    g = torch.Generator().manual_seed(0)
    lins = copied_linears(model)
    xs = [torch.randn(rows, lin.weight.shape[1], generator=g).to(model.dtype) for lin in lins]
    return lambda: [linear(x, lin.weight, None, lin.gemm) for x, lin in zip(xs, lins)]


def compiled_step(target) -> Any:
    """The loaded target's model through the opt-in compiled step of ``bench --compile``, under
    the same CPU plan (:func:`refspec.models.prepare_target`)."""
    from refspec.models import prepare_target

    return prepare_target(target.model, cpu_plan=target.prepared.cpu_plan, compile=True)


def compile_figures(compiled) -> dict[str, Any]:
    """What a compiled target's step cost to build: compiles, recompiles, seconds, eager fallbacks."""
    st = compiled.step.stats
    return {"compile_s": st.compile_s, "compiles": st.compiles, "recompiles": st.recompiles,
            "compiled_calls": st.compiled_calls, "compile_eager_calls": st.eager_calls}


def refspec_figures(wall: float, gen) -> dict[str, float]:
    """tokens/s over the whole call and the mean decode step (draft + verify + commit)."""
    steps = [e.measurement.time_s for e in gen.events if e.phase in ("draft", "verify", "commit")]
    return {"tokens_per_s": gen.num_emitted / wall, "step_ms": 1000 * sum(steps) / gen.steps, "wall_s": wall}


def hf_run(hf, prompts: list[list[int]], new_tokens: int, pad_id: int, **extra) -> Callable[[], list[list[int]]]:
    """A call of transformers.generate on left-padded prompts returning the new tokens per row."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        att[i, width - len(p):] = 1

    def run():
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=att, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id, **extra)
        return [row[width:].tolist() for row in out]

    return run


def load_hf(path: Path, dtype: torch.dtype):
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.generation_config.eos_token_id = None  # decode the whole budget, as refspec does here
    return model.eval()


__all__ = ["measure_bandwidth", "weight_bytes", "compiled_step", "compile_figures", "interleaved", "load_hf", "hf_run",
           "refspec_run", "refspec_figures", "products_run"]
