"""``python -m refspec.eval bench``: benchmark scripts that print figures (not timed tests).

Three benchmarks, each measured in one process so ratios are comparable (absolute times on a
shared machine are noisy; compare the ratios):

``decode``: refspec plain decoding against ``transformers.generate`` (with its KV cache) on
the same converted weights, at batch 1 and 8, fp32 and bf16, plus the memory-bandwidth floor
of a decode step (weight bytes / bandwidth measured in the same run)::

    python -m refspec.eval bench decode --model smollm2-135m --json

``spec``: refspec plain, refspec with a drafter, and transformers' own speculative method on
the same prompts (prompt lookup for ``ngram``, assisted generation for ``draft-model``)::

    python -m refspec.eval bench spec --model smollm2-135m --drafter ngram --corpus-file prompts.jsonl --json

``roofline``: the roofline model's predicted target-forward time against the measured one for
batch 1..64 and K 0..8 on this CPU (see :mod:`refspec.eval.roofline_check`)::

    python -m refspec.eval bench roofline --model smollm2-135m --plot roofline_cpu.png
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from refspec.eval.bench_timing import (compile_figures, compiled_step, hf_run, interleaved, load_hf, measure_bandwidth,
                                       products_run, refspec_figures, refspec_run, weight_bytes)
from refspec.eval.cli_checks import parse_drafter_options
from refspec.eval.flags import OneLineParser, UsageError, int_list, integer, output_path
from refspec.eval.outputs import check_output
from refspec.eval.runtime import load_target, parse_dtype, set_threads
from refspec.models.calibration import machine_key, notable_cpu_flags
from refspec.models.cpu_speed import weight_copy_kind

log = logging.getLogger(__name__)

# Code-completion prompts written for this benchmark (prompt lookup shines when the output
# repeats identifiers and structure from the prompt).
CODE_PROMPTS = [
    "def add_user(users, name, email):\n    \"\"\"Add a user dict with name and email to users.\"\"\"\n"
    "    users.append({'name': name, 'email': email})\n    return users\n\n\n"
    "def remove_user(users, name):\n    \"\"\"Remove every user dict whose name matches.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def peek(self):\n",
    "import numpy as np\n\n\ndef normalize_rows(matrix: np.ndarray) -> np.ndarray:\n"
    "    norms = np.linalg.norm(matrix, axis=1, keepdims=True)\n    return matrix / norms\n\n\n"
    "def normalize_columns(matrix: np.ndarray) -> np.ndarray:\n",
    "SELECT customers.name, orders.total\nFROM customers\nJOIN orders ON orders.customer_id = customers.id\n"
    "WHERE orders.total > 100;\n\n-- the same query for orders above 500, sorted by total\n",
    "for (let i = 0; i < rows.length; i++) {\n  const row = rows[i];\n  if (row.active) {\n"
    "    activeRows.push(row);\n  }\n}\n// now collect the inactive rows the same way\n",
    "def fizzbuzz(n):\n    for i in range(1, n + 1):\n        if i % 15 == 0:\n            print('FizzBuzz')\n"
    "        elif i % 3 == 0:\n            print('Fizz')\n",
    "struct Point {\n    double x;\n    double y;\n};\n\ndouble point_distance(struct Point a, struct Point b) {\n",
    "# Configuration\nDATABASE_HOST = 'localhost'\nDATABASE_PORT = 5432\nDATABASE_USER = 'admin'\n"
    "CACHE_HOST = 'localhost'\nCACHE_PORT = 6379\n",
]


def bench_decode(model_name: str, *, batches: Sequence[int] = (1, 8), dtypes: Sequence[str] = ("fp32", "bf16"),
                 prompt_len: int = 32, new_tokens: int = 48, repeats: int = 3, compile: bool = False) -> dict[str, Any]:
    """refspec vs transformers decode speed and the bandwidth floor, in one run (each figure is
    the best of ``repeats`` interleaved runs); with ``compile``, refspec's compiled step too
    (``compiled_*`` figures, compiled in the untimed warm-up run)."""
    set_threads()
    device = torch.device("cpu")
    results: dict[str, Any] = {"model": model_name, "cpu": machine_key()["cpu"], "cpu_flags": notable_cpu_flags(),
                               "prompt_len": prompt_len, "new_tokens": new_tokens,
                               "threads": torch.get_num_threads(), "repeats": repeats, "compile": compile, "rows": []}
    g = torch.Generator().manual_seed(0)
    bw = measure_bandwidth()  # one floor for every dtype: weight bytes over the streaming-read bandwidth
    results["bandwidth_GBps"] = bw / 1e9
    for dname in dtypes:
        dtype = parse_dtype(dname)
        target = load_target(model_name, dtype=dtype, device=device)
        vocab = target.model.args.vocab_size
        hf = load_hf(target.path, dtype)
        floor_ms = 1000 * weight_bytes(target.model) / bw
        for b in batches:
            prompts = [torch.randint(100, vocab - 100, (prompt_len - (i % 4),), generator=g).tolist()
                       for i in range(b)]
            # transformers' step time: compare like with like by subtracting a 1-token run (prefill)
            fns = {"refspec": refspec_run(target.model, prompts, new_tokens),
                   "hf": hf_run(hf, prompts, new_tokens, pad_id=0), "hf_prefill": hf_run(hf, prompts, 1, pad_id=0),
                   "products": products_run(target.model, b)}
            step = compiled_step(target) if compile else None
            if step is not None:
                fns["compiled"] = refspec_run(step, prompts, new_tokens)
            best = interleaved(fns, repeats)
            ours = refspec_figures(*best["refspec"])
            hf_wall, hf_prefill = best["hf"][0], best["hf_prefill"][0]
            hf_step_ms = 1000 * (hf_wall - hf_prefill) / (new_tokens - 1)
            row = {"dtype": dname, "batch": b, "refspec_tokens_per_s": ours["tokens_per_s"],
                   "refspec_step_ms": ours["step_ms"], "hf_tokens_per_s": b * new_tokens / hf_wall,
                   "hf_step_ms": hf_step_ms, "bandwidth_GBps": bw / 1e9, "floor_step_ms": floor_ms,
                   "weight_bytes": weight_bytes(target.model), "weight_copies": weight_copy_kind(target.model),
                   "gemm_plan": target.prepared.cpu_plan.describe() or "reference"}
            row["speedup_vs_hf"] = row["refspec_tokens_per_s"] / row["hf_tokens_per_s"]
            row["step_over_floor"] = row["refspec_step_ms"] / floor_ms
            row["products_ms"] = 1000 * best["products"][0]
            row["products_over_floor"] = row["products_ms"] / floor_ms
            if step is not None:
                row.update(_compiled_row(best, row, step, floor_ms))
            results["rows"].append(row)
            log.info("%s batch %d: refspec %.1f tok/s (step %.1f ms, its matrix products alone %.1f ms), "
                     "transformers %.1f tok/s, floor %.1f ms", dname, b, row["refspec_tokens_per_s"],
                     row["refspec_step_ms"], row["products_ms"], row["hf_tokens_per_s"], floor_ms)
        del hf
    return results


def _compiled_row(best: dict[str, tuple[float, Any]], row: dict[str, Any], step, floor_ms: float) -> dict[str, Any]:
    """The compiled step's figures beside the eager ones of the same run."""
    comp = refspec_figures(*best["compiled"])
    out = {"compiled_tokens_per_s": comp["tokens_per_s"], "compiled_step_ms": comp["step_ms"],
           "compiled_speedup_vs_hf": comp["tokens_per_s"] / row["hf_tokens_per_s"],
           "compiled_speedup_vs_eager": comp["tokens_per_s"] / row["refspec_tokens_per_s"],
           "compiled_step_over_floor": comp["step_ms"] / floor_ms,
           "compiled_matches_eager": best["compiled"][1].tokens == best["refspec"][1].tokens}
    return out | compile_figures(step)


def _read_prompt_file(path: Path | None, tokenizer) -> list[list[int]]:
    texts: list[str]
    if path is None:
        texts = CODE_PROMPTS
    else:
        from refspec.eval.corpora.sources import CorpusFormatError, jsonl_objects, utf8_text

        try:
            objects = jsonl_objects(utf8_text(path.read_bytes(), f"--corpus-file {path}"), f"--corpus-file {path}")
        except OSError as exc:
            raise UsageError(f"--corpus-file {path}: cannot read it: {exc.strerror}") from None
        except CorpusFormatError as exc:
            raise UsageError(str(exc)) from None
        texts = [obj.get("prompt") for _, obj in objects]
        bad = next((i for (i, _), t in zip(objects, texts) if not isinstance(t, str) or not t.strip()), None)
        if bad is not None or not texts:
            raise UsageError(f"--corpus-file {path}, line {bad or 1}: expected a JSON object with a non-empty string "
                             f"'prompt' field")
    return [tokenizer.encode(t) for t in texts]


def _machine_fields(target: Any) -> dict[str, Any]:
    """The CPU, its notable flags and the paths chosen for it (weight copies, GEMM plan)."""
    return {"cpu": machine_key()["cpu"], "cpu_flags": notable_cpu_flags(),
            "weight_copies": weight_copy_kind(target.model),
            "gemm_plan": target.prepared.cpu_plan.describe() or "reference"}


def _compiled_rates(row: dict[str, Any], t: dict[str, float], tokens: dict[str, list[list[int]]]) -> None:
    """The compiled engines' tokens/s, speed-up and agreement with eager, added to ``row``."""
    for name in ("plain_compiled", "spec_compiled"):
        row[f"{name}_tokens_per_s"] = sum(map(len, tokens[name])) / t[name]
    row["spec_compiled_speedup_vs_plain_compiled"] = row["spec_compiled_tokens_per_s"] / row[
        "plain_compiled_tokens_per_s"]
    row["compiled_matches_eager"] = tokens["spec_compiled"] == tokens["spec"]


def bench_spec(model_name: str, drafter_name: str, *, corpus_file: Path | None, k: int, batches: Sequence[int],
               dtype_name: str, new_tokens: int, draft_model: str | None = None, repeats: int = 2,
               drafter_options: dict[str, str] | None = None, compile: bool = False) -> dict[str, Any]:
    """refspec plain vs refspec + drafter vs transformers' equivalent, same prompts, one run
    (each chunk of prompts timed as the best of ``repeats`` interleaved runs); with ``compile``,
    plain and speculative refspec through one compiled verify step too (``*_compiled``)."""
    from refspec.drafters import registry
    from refspec.engine import Engine, EngineConfig

    set_threads()
    device = torch.device("cpu")
    dtype = parse_dtype(dtype_name)
    target = load_target(model_name, dtype=dtype, device=device)
    if target.tokenizer is None:
        raise UsageError(f"{target.path} has no tokenizer.json")
    prompts = _read_prompt_file(corpus_file, target.tokenizer)
    opts = dict(drafter_options or {}) | ({"draft_model": draft_model} if draft_model else {})
    drafter = registry.build(drafter_name, registry.DrafterContext(
        target=target.model, target_name=model_name, tokenizer_fingerprint=target.fingerprint, dtype=dtype,
        device=device, options=opts))
    hf = load_hf(target.path, dtype)
    hf_extra, hf_method = _hf_equivalent(drafter_name, opts, model_name, k, dtype)
    out: dict[str, Any] = {"model": model_name, **_machine_fields(target), "drafter": drafter_name,
                           "drafter_options": opts, "k": k, "dtype": dtype_name, "prompts": len(prompts),
                           "new_tokens": new_tokens, "transformers_method": hf_method, "compile": compile, "rows": []}
    engines = {"plain": Engine(target.model), "spec": Engine(target.model, drafter, config=EngineConfig(k=k))}
    step = compiled_step(target) if compile else None
    if step is not None:
        engines |= {"plain_compiled": Engine(step), "spec_compiled": Engine(step, drafter, config=EngineConfig(k=k))}
    hf_once: tuple[float, list[list[int]]] | None = None
    for b in sorted(batches):  # batch 1 first: its transformers run is reused for the others
        with_hf = hf_method is not None and b == 1  # transformers' speculative generate: batch 1 only
        t, tokens, taus = _timed_chunks(engines, hf if with_hf else None, hf_extra, prompts, b, new_tokens, repeats)
        n_tok = sum(map(len, tokens["plain"]))
        row = {"batch": b, "plain_tokens_per_s": n_tok / t["plain"],
               "spec_tokens_per_s": sum(map(len, tokens["spec"])) / t["spec"],
               "tau": statistics.fmean(taus), "spec_matches_plain": tokens["spec"] == tokens["plain"]}
        row["spec_speedup_vs_plain"] = row["spec_tokens_per_s"] / row["plain_tokens_per_s"]
        if step is not None:
            _compiled_rates(row, t, tokens)
        if hf_method is not None:
            if with_hf:
                hf_once = (t["hf"], tokens["hf"])
            elif hf_once is None:
                # transformers' speculative methods run one sequence at a time: batch 1 per prompt,
                # measured once (interleaved with refspec at batch 1 when that batch is asked for)
                hf_once = _hf_one_by_one(hf, hf_extra, prompts, new_tokens, repeats)
            _hf_rates(row, hf_once, tokens["plain"], compiled=step is not None)
        if step is not None:
            row.update(compile_figures(step))  # cumulative over the batches run so far
        out["rows"].append(row)
        log.info("batch %d: plain %.1f tok/s, %s %.1f tok/s (tau %.2f), transformers %s", b,
                 row["plain_tokens_per_s"], drafter_name, row["spec_tokens_per_s"], row["tau"],
                 f"{row.get('hf_tokens_per_s', float('nan')):.1f} tok/s")
    return out


def _hf_rates(row: dict[str, Any], hf_once: tuple[float, list[list[int]]], plain: list[list[int]], *,
              compiled: bool) -> None:
    """transformers' figures beside refspec's in one ``bench spec`` row."""
    t_hf, hf_tokens = hf_once
    row["hf_tokens_per_s"] = sum(map(len, hf_tokens)) / t_hf
    row["hf_batch_note"] = "transformers' speculative generate supports batch 1 only; prompts ran one by one"
    row["spec_speedup_vs_hf"] = row["spec_tokens_per_s"] / row["hf_tokens_per_s"]
    if compiled:
        row["spec_compiled_speedup_vs_hf"] = row["spec_compiled_tokens_per_s"] / row["hf_tokens_per_s"]
    row["hf_matches_plain"] = hf_tokens == plain


def _hf_equivalent(drafter_name: str, opts: dict, model_name: str, k: int,
                   dtype: torch.dtype) -> tuple[dict[str, Any], str | None]:
    """transformers' generate arguments doing what the drafter does, and the method's name (None: none)."""
    if drafter_name == "ngram":
        return {"prompt_lookup_num_tokens": k}, "prompt lookup"
    if drafter_name == "draft-model":
        assistant = load_hf(drafter_path(drafter_name, opts, model_name), dtype)
        assistant.generation_config.num_assistant_tokens = k
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        return {"assistant_model": assistant}, "assisted generation"
    return {}, None


def _timed_chunks(engines: dict[str, Any], hf: Any, hf_extra: dict[str, Any], prompts: list[list[int]], b: int,
                  new_tokens: int, repeats: int) -> tuple[dict[str, float], dict[str, list], list[int]]:
    """Wall time and tokens of every chunk of ``b`` prompts through each engine (``plain``,
    ``spec``, ...) and transformers when ``hf`` is given, each the best of ``repeats`` interleaved
    runs; also the acceptance length of every active row-step of the ``spec`` runs."""
    t = dict.fromkeys([*engines, "hf"], 0.0)
    tokens: dict[str, list] = {name: [] for name in t}
    taus: list[int] = []
    for i in range(0, len(prompts), b):
        chunk = prompts[i:i + b]
        fns = {name: (lambda e=e: e.generate(chunk, max_new_tokens=new_tokens)) for name, e in engines.items()}
        if hf is not None:
            fns["hf"] = hf_run(hf, chunk, new_tokens, pad_id=0, **hf_extra)
        best = interleaved(fns, repeats)
        for name, (wall, result) in best.items():
            t[name] += wall
            tokens[name] += result if name == "hf" else result.tokens
        taus += [a + 1 for step in best["spec"][1].accepted_per_step for a in step if a >= 0]
    return t, tokens, taus


def _hf_one_by_one(hf: Any, hf_extra: dict[str, Any], prompts: list[list[int]], new_tokens: int,
                   repeats: int) -> tuple[float, list[list[int]]]:
    """transformers' generate over the prompts one at a time: total wall time and the tokens."""
    t_hf, hf_tokens = 0.0, []
    for p in prompts:
        best = interleaved({"hf": hf_run(hf, [p], new_tokens, pad_id=0, **hf_extra)}, repeats)
        t_hf += best["hf"][0]
        hf_tokens += best["hf"][1]
    return t_hf, hf_tokens


def drafter_path(drafter_name: str, opts: dict, model_name: str) -> Path:
    from refspec.assets import resolve_model

    spec = opts.get("draft_model") or "qwen2.5-coder-0.5b"
    if str(spec).startswith("self:"):
        raise UsageError("transformers' assisted generation needs a separate draft model, not self:N")
    return resolve_model(str(spec))


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m refspec.eval bench", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("decode", help="refspec vs transformers decode speed and the bandwidth floor")
    d.add_argument("--model", default="smollm2-135m")
    d.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    d.add_argument("--dtype", default="fp32,bf16", help="comma-separated dtypes")
    d.add_argument("--new-tokens", type=int, default=48)
    d.add_argument("--repeats", type=int, default=3,
                   help="interleaved timed runs of refspec and transformers; the best of each is kept")
    d.add_argument("--json", action="store_true", help="print the figures as JSON")
    d.add_argument("--compile", action="store_true",
                   help="also time refspec's opt-in compiled step (torch.compile; compiled in the warm-up)")
    s = sub.add_parser("spec", help="refspec plain vs speculative vs transformers' speculative method")
    s.add_argument("--model", default="smollm2-135m")
    s.add_argument("--drafter", default="ngram")
    s.add_argument("--draft-model", default=None, help="for draft-model: model id or directory")
    s.add_argument("--drafter-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a drafter option, e.g. min_n=1 or max_n=4 for ngram (repeatable)")
    s.add_argument("--corpus-file", type=Path, default=None,
                   help="JSONL with a 'prompt' field (default: built-in code-completion prompts)")
    s.add_argument("--k", type=int, default=4)
    s.add_argument("--batch", default="1,8")
    s.add_argument("--dtype", default="bf16")
    s.add_argument("--new-tokens", type=int, default=64)
    s.add_argument("--repeats", type=int, default=2,
                   help="interleaved timed runs of plain, speculative and transformers; the best of each is kept")
    s.add_argument("--json", action="store_true")
    s.add_argument("--compile", action="store_true",
                   help="also time plain and speculative refspec through the opt-in compiled verify step")
    r = sub.add_parser("roofline", help="roofline-predicted vs measured target step times on this CPU")
    r.add_argument("--model", default="smollm2-135m")
    r.add_argument("--batch", default="1,2,4,8,16,32,64", help="comma-separated batch sizes")
    r.add_argument("--k", default="0,1,2,4,8", help="comma-separated draft lengths (0 = plain decoding)")
    r.add_argument("--dtype", default="fp32")
    r.add_argument("--new-tokens", type=int, default=12, help="tokens per row; the first 2 steps are not timed")
    r.add_argument("--plot", type=output_path, default=None, help="write measured vs predicted to this PNG")
    r.add_argument("--json", action="store_true")
    return p


BATCH_MAX = 1024
"""Most rows a benchmark batch takes (each row holds a KV cache of its whole context)."""
NEW_TOKENS_MAX = 4096


def check_bench_flags(args: argparse.Namespace) -> None:
    """Every numeric flag of the sub-command, before torch loads a model.

    Raises:
        UsageError: naming the flag.
    """
    for batch in int_list("--batch", args.batch, low=1):
        integer("--batch", batch, low=1, high=BATCH_MAX)
    integer("--new-tokens", args.new_tokens, low=3 if args.cmd == "roofline" else 1, high=NEW_TOKENS_MAX,
            fix="the first 2 steps are not timed" if args.cmd == "roofline" else "")
    if args.cmd == "roofline":
        int_list("--k", args.k, low=0)
    else:
        integer("--repeats", args.repeats, low=1, high=100)
    if args.cmd == "spec":
        integer("--k", args.k, low=1, high=64)
    if getattr(args, "plot", None) is not None:
        check_output("--plot", args.plot)


def _roofline(args) -> int:
    from refspec.eval.roofline_check import check_roofline, format_check, plot_check

    set_threads()
    target = load_target(args.model, dtype=parse_dtype(args.dtype), device=torch.device("cpu"))
    res = check_roofline(target.model, batches=int_list("--batch", args.batch, low=1), ks=int_list("--k", args.k),
                         new_tokens=args.new_tokens)
    res["model"] = args.model
    if args.plot is not None:
        res["plot"] = str(plot_check(res, args.plot))
    print(json.dumps(res, indent=2) if args.json else format_check(res))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        check_bench_flags(args)
        if args.cmd == "roofline":
            return _roofline(args)
        if args.cmd == "decode":
            res = bench_decode(args.model, batches=int_list("--batch", args.batch, low=1), dtypes=args.dtype.split(","),
                               new_tokens=args.new_tokens, repeats=args.repeats, compile=args.compile)
        else:
            res = bench_spec(args.model, args.drafter, corpus_file=args.corpus_file, k=args.k,
                             batches=int_list("--batch", args.batch, low=1), dtype_name=args.dtype, new_tokens=args.new_tokens,
                             draft_model=args.draft_model, repeats=args.repeats,
                             drafter_options=dict(parse_drafter_options(args.drafter_option)), compile=args.compile)
    except (UsageError, ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        for row in res["rows"]:
            print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
