"""``python -m refspec.eval generate``: decode prompts with a real model, plain or speculative.

Examples::

    python -m refspec.eval generate --model smollm2-135m --prompt "Write a haiku about tea."
    python -m refspec.eval generate --model smollm2-135m --prompts-file prompts.txt --drafter ngram --k 4
    python -m refspec.eval generate --model /path/to/hf_dir --prompt "def fib(n):" --no-chat --temperature 0.8
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from refspec.eval.cli_checks import check_drafter_options, parse_drafter_options
from refspec.eval.flags import (EXIT_INTERRUPTED, EXIT_USAGE, OneLineParser, UsageError, add_sampling_args,
                                check_sampling, integer, one_line)
from refspec.eval.interrupts import import_torch


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m refspec.eval generate",
        description="Generate text with a refspec target model, plain (no drafter) or speculative. "
                    "Prompts of different lengths run together as one ragged batch.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m",
                   help="model id (python -m refspec.eval assets list) or a Hugging Face directory with safetensors")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    src.add_argument("--prompts-file", type=Path, help="one prompt per line (or JSONL with a 'prompt' field)")
    p.add_argument("--drafter", default="none", help="none, or a registered drafter (ngram, draft-model, eagle, ...)")
    p.add_argument("--k", type=int, default=None, help="drafts per step (default: the drafter's)")
    p.add_argument("--draft-model", default=None, help="for --drafter draft-model: model id, directory or self:N")
    p.add_argument("--drafter-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a drafter option, e.g. max_n=4 (repeatable), as in python -m refspec.eval run")
    p.add_argument("--max-new-tokens", type=int, default=128)
    add_sampling_args(p)
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--dtype", default="auto",
                   help="auto (bf16 on CUDA and on CPUs with avx512_bf16/AMX, else fp32), fp32, bf16 or fp16")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    return p


def _check_flags(args: argparse.Namespace) -> None:
    """Every flag, before the model loads (the same meanings as in ``python -m refspec.eval run``)."""
    integer("--max-new-tokens", args.max_new_tokens, low=1, high=1_000_000)
    check_sampling(args)
    if args.dtype.lower() not in ("auto", "fp32", "float32", "bf16", "bfloat16", "fp16", "float16"):
        raise UsageError(f"--dtype {args.dtype!r} is unknown; use auto, fp32, bf16 or fp16")
    if args.prompt is not None and not all(p.strip() for p in args.prompt):
        raise UsageError("--prompt is empty; give the text to continue")
    if args.drafter == "none":
        if args.k is not None:
            raise UsageError(f"--k {args.k} needs a drafter: --drafter none is plain decoding (drop --k or name one)")
    elif args.k is not None:
        integer("--k", args.k, low=1, fix="k = 0 is plain decoding: use --drafter none")
    check_drafter_options([args.drafter], parse_drafter_options(args.drafter_option, args.draft_model))


def _read_prompts(args) -> list[str]:
    if args.prompt:
        return list(args.prompt)
    if args.prompts_file:
        from refspec.eval.corpora.sources import CorpusFormatError, check_encodable, utf8_text

        source = f"--prompts-file {args.prompts_file}"
        try:
            text = utf8_text(args.prompts_file.read_bytes(), source)
        except OSError as exc:
            raise UsageError(f"{source}: cannot read it: {exc.strerror or exc}") from None
        except CorpusFormatError as exc:
            raise UsageError(str(exc)) from None
        out = []
        for i, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            if not line.lstrip().startswith("{"):
                out.append(line)
                continue
            try:
                prompt = json.loads(line)["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError):
                prompt = None
            if not isinstance(prompt, str) or not prompt.strip():
                raise UsageError(f"{source}:{i}: expected a JSON object with a non-empty string 'prompt' field")
            try:
                check_encodable(prompt, source, i)
            except CorpusFormatError as exc:
                raise UsageError(str(exc)) from None
            out.append(prompt)
        if not out:
            raise UsageError(f"--prompts-file {args.prompts_file} holds no prompts")
        return out
    return ["Explain speculative decoding in two sentences."]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 for usage errors, 130 when interrupted)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        _check_flags(args)
        texts = _read_prompts(args)
        return _generate(args, texts)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (UsageError, ValueError, RuntimeError, OSError) as exc:  # the refspec errors derive from these
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE


def _generate(args: argparse.Namespace, texts: Sequence[str]) -> int:
    import_torch()
    import torch

    from refspec.drafters import registry
    from refspec.engine import Engine, EngineConfig
    from refspec.eval.machine import auto_dtype
    from refspec.eval.runtime import encode_prompt, load_target, parse_dtype, pick_device, set_threads
    from refspec.sampling import SamplingConfig

    set_threads()
    device = pick_device(args.device)
    dtype = parse_dtype(auto_dtype(device) if args.dtype.lower() == "auto" else args.dtype)
    if args.drafter != "none" and args.drafter not in registry.available() and not registry.is_plugin(args.drafter):
        raise UsageError(f"--drafter {args.drafter!r} is unknown; available: none, {', '.join(registry.available())}")
    target = load_target(args.model, dtype=dtype, device=device)
    prompts = [encode_prompt(target, t, chat=not args.no_chat) for t in texts]
    drafter, k = None, 0
    if args.drafter != "none":
        opts = dict(parse_drafter_options(args.drafter_option, args.draft_model))
        ctx = registry.DrafterContext(target=target.model, target_name=args.model,
                                      tokenizer_fingerprint=target.fingerprint, dtype=target.model.dtype,
                                      device=device, options=opts)
        drafter = registry.build(args.drafter, ctx)
        k = args.k if args.k is not None else registry.default_k(args.drafter)
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    engine = Engine(target.prepared, drafter, config=EngineConfig(k=k, sampling=sampling),
                    eos_token_ids=target.eos_token_ids)
    need = max(engine.required_slots(len(p), args.max_new_tokens) for p in prompts)
    ctx = target.model.args.max_position_embeddings
    if need > ctx:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}: the longest prompt ({max(map(len, prompts))} "
                         f"tokens) + budget + look-ahead need {need} positions, beyond the model's context of {ctx}")
    gen_ = torch.Generator(device=device).manual_seed(args.seed)
    t0 = time.perf_counter()
    result = engine.generate(prompts, max_new_tokens=args.max_new_tokens, generator=gen_)
    _print(args, texts, target.tokenizer, result, time.perf_counter() - t0, k, drafter)
    return 0


def _print(args: argparse.Namespace, texts: Sequence[str], tok: Any, result: Any, elapsed: float, k: int,
           drafter: Any) -> None:
    for text, toks in zip(texts, result.tokens):
        out = tok.decode(toks) if tok is not None else " ".join(map(str, toks))
        if args.json:
            print(json.dumps({"prompt": text, "completion": out, "tokens": len(toks)}))
        else:
            print(f"### {text}\n{out}\n")
    n = result.num_emitted
    summary = f"{n} tokens in {elapsed:.2f} s ({n / max(elapsed, 1e-9):.1f} tok/s), {result.steps} steps"
    if drafter is not None:
        summary += f", tau {result.tau:.2f} ({args.drafter}, k={k})"
    print(summary, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
