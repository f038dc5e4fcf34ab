"""``python -m refspec.eval train``: train a drafter (eagle, eagle3, block) on a frozen target.

Examples::

    python -m refspec.eval train --drafter eagle --model smollm2-135m
    python -m refspec.eval train --drafter eagle3 --model smollm2-135m --steps 3000 --max-time-min 25
    python -m refspec.eval train --drafter eagle --model smollm2-135m --resume   # after Ctrl-C

Training text (train splits only, labels the target's own argmax) is built by
:mod:`refspec.eval.train_data`. The sequences are cached in ``$REFSPEC_HOME/train-data/``
(shared by every drafter of one target, as are the target's self-distilled replies), the
target's features in ``OUT/features.safetensors``; ``--resume`` continues from
``OUT/checkpoint.pt``. The default ``OUT`` is ``$REFSPEC_HOME/heads/<model>-<drafter>``,
where ``--drafter eagle`` looks for heads.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from refspec.eval.flags import OneLineParser, UsageError, finite, integer, output_path
from refspec.eval.outputs import check_output, check_output_dir, claimed
from refspec.eval.train_data import DataSpec, ReplyCache, build_sequences, load_sequences, save_sequences

log = logging.getLogger("refspec.eval.train")


def _parser(trainers: dict[str, Any]) -> argparse.ArgumentParser:
    names = ", ".join(f"{n} ({t.description})" for n, t in sorted(trainers.items())) or "none registered"
    p = OneLineParser(
        prog="python -m refspec.eval train",
        description=f"Train a drafter on a frozen target's hidden states. Drafters: {names}.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--drafter", required=True, choices=sorted(trainers), help="what to train")
    p.add_argument("--model", default="smollm2-135m", help="target: model id or Hugging Face directory")
    p.add_argument("--out", type=output_path, default=None,
                   help="output directory (default: $REFSPEC_HOME/heads/<model>-<drafter>)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the drafter's, or 2000)")
    p.add_argument("--batch-size", type=int, default=None, help="training windows per step")
    p.add_argument("--seq-len", type=int, default=None, help="positions per window")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps")
    p.add_argument("--checkpoint-every", type=int, default=200, help="steps between checkpoints")
    p.add_argument("--max-time-min", type=float, default=None, help="stop (and export) after this many minutes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-sequences", type=int, default=0,
                   help="hold this many training sequences out for early stopping: the head exported is the one with "
                        "the best --val-metric on them (0: export the last)")
    p.add_argument("--val-every", type=int, default=100, help="steps between held-out evaluations")
    p.add_argument("--val-batches", type=int, default=8, help="held-out windows, in batches of --batch-size")
    p.add_argument("--val-metric", default="loss",
                   help="what picks the exported head: loss, or a metric the drafter's training logs (e.g. walk@8 "
                        "for block, acc0 for eagle)")
    p.add_argument("--val-goal", choices=("min", "max"), default="min",
                   help="whether a lower or a higher --val-metric wins")
    p.add_argument("--patience", type=int, default=0,
                   help="stop after this many held-out evaluations without a new best (0: never)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="drafter-specific training option (repeatable), e.g. ttt_steps=3, draft_vocab_size=8192 or "
                        "soft_labels=1")
    p.add_argument("--dtype", default="fp32",
                   help="target dtype for self-distillation and features (bf16 is emulated, hence slower than fp32, "
                        "on CPUs without bf16 instructions; `bench decode` shows both on this machine)")
    p.add_argument("--autocast", choices=("none", "bf16"), default="none",
                   help="run the head's forward and loss in bf16 (torch.autocast; weights, gradients and AdamW stay "
                        "fp32): faster where the CPU has bf16 dot products or matrix units, at bf16 rounding; "
                        "may change on --resume")
    p.add_argument("--chat-prompts", type=int, default=DataSpec.chat_prompts)
    p.add_argument("--math-prompts", type=int, default=DataSpec.math_prompts)
    p.add_argument("--code-prompts", type=int, default=DataSpec.code_prompts)
    p.add_argument("--reply-tokens", type=int, default=DataSpec.reply_tokens)
    p.add_argument("--chat-references", type=int, default=DataSpec.chat_references)
    p.add_argument("--math-references", type=int, default=DataSpec.math_references)
    p.add_argument("--code-references", type=int, default=DataSpec.code_references)
    p.add_argument("--prose-chunks", type=int, default=DataSpec.prose_chunks)
    p.add_argument("--max-len", type=int, default=DataSpec.max_len, help="longest training sequence (tokens)")
    p.add_argument("--distill-references", action="store_true",
                   help="self-distill the reference answers' prompts too (their text then trains twice)")
    p.add_argument("--reference-cuts", action="append", default=[], metavar="SOURCE=K",
                   help="also cut every reference answer of SOURCE (conversation, math, code) in the mix at K evenly "
                        "spaced points and train on the target's greedy continuation from each (repeatable)")
    p.add_argument("--data-cache", type=output_path, default=None,
                   help="sequences file (default: $REFSPEC_HOME/train-data/<model>-<hash>.json)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def _options(pairs: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--option expects KEY=VALUE, got {pair!r}")
        key, value = pair.split("=", 1)
        for cast in (int, float):
            try:
                out[key] = cast(value)
                break
            except ValueError:
                continue
        else:
            out[key] = value
    return out


def _cuts(pairs: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """``--reference-cuts`` as sorted (source, K) pairs."""
    out: dict[str, int] = {}
    for pair in pairs:
        source, _, k = pair.partition("=")
        if not k.isdigit():
            raise ValueError(f"--reference-cuts expects SOURCE=K with K a count, got {pair!r}")
        out[source] = int(k)
    return tuple(sorted(out.items()))


def _settings(args: argparse.Namespace, trainer: Any) -> tuple[Any, dict[str, Any], DataSpec]:
    """The loop's settings (the trainer's defaults under the flags), trainer options and the data spec."""
    from refspec.drafters import training

    overrides = {k: v for k, v in {"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
                                   "lr": args.lr, "warmup_steps": args.warmup}.items() if v is not None}
    cfg_kw = {"steps": 2000, **trainer.defaults, **overrides}
    config = training.TrainConfig(**cfg_kw, checkpoint_every=args.checkpoint_every, seed=args.seed,
                                  max_time_s=None if args.max_time_min is None else 60 * args.max_time_min,
                                  autocast=None if args.autocast == "none" else args.autocast,
                                  val_sequences=args.val_sequences, val_every=args.val_every,
                                  val_batches=args.val_batches, val_metric=args.val_metric, val_goal=args.val_goal,
                                  patience=args.patience)
    spec = DataSpec(chat_prompts=args.chat_prompts, math_prompts=args.math_prompts, code_prompts=args.code_prompts,
                    reply_tokens=args.reply_tokens, chat_references=args.chat_references,
                    math_references=args.math_references, code_references=args.code_references,
                    prose_chunks=args.prose_chunks, max_len=args.max_len,
                    seed=args.seed, distill_references=args.distill_references,
                    reference_cuts=_cuts(args.reference_cuts))
    return config, _options(args.option), spec


def _sequences(args: argparse.Namespace, target: Any, spec: DataSpec) -> tuple[list, dict[str, Any], Path]:
    """Training sequences from the cache file, or built by self-distillation and cached there."""
    from refspec.assets import refspec_home

    name = f"{Path(args.model).name}-{spec.key(args.model)}.json"
    data_path = args.data_cache or refspec_home() / "train-data" / name
    if data_path.exists():
        seqs, description = load_sequences(data_path)
        log.info("training sequences from %s (%d sequences)", data_path, len(seqs))
    else:
        replies = ReplyCache(data_path.with_name(f"{Path(args.model).name}-{args.dtype}-replies.json"))
        log.info("building training sequences (self-distillation with %s, %d replies cached in %s); cached in %s",
                 args.model, len(replies), replies.path, data_path)
        seqs, description = build_sequences(target.model, target.tokenizer, spec, replies=replies,
                                            progress=not args.quiet)
        save_sequences(data_path, seqs, description)
    return seqs, description, data_path


def _features(args: argparse.Namespace, layers: tuple[int, ...], target: Any, seqs: list, description: dict[str, Any],
              data_path: Path, out: Path, max_len: int) -> Any:
    """The target's features of ``seqs``: from ``out/features.safetensors`` when its key matches, else collected."""
    from refspec.drafters import training

    feat_path = out / "features.safetensors"
    feat_key = {"data": data_path.name, "layers": list(layers), "dtype": args.dtype, "max_len": max_len}
    if feat_path.exists():
        cached = training.FeatureDataset.load(feat_path)
        if cached.description.get("feature_key") == feat_key:
            log.info("target features from %s", feat_path)
            return cached
    t0 = time.perf_counter()
    dataset = training.collect_features(target.model, seqs, layers, max_len=max_len, progress=not args.quiet,
                                        description={**description, "feature_key": feat_key})
    dataset.save(feat_path)
    log.info("collected %d positions of features in %.0f s", dataset.num_tokens, time.perf_counter() - t0)
    return dataset


POSITIVE = ("steps", "batch_size", "seq_len", "checkpoint_every", "val_every", "val_batches", "max_len")
"""Flags that count something the run cannot do zero times of (None: the drafter's default)."""
COUNTS = ("warmup", "val_sequences", "patience", "chat_prompts", "math_prompts", "code_prompts", "reply_tokens",
          "chat_references", "math_references", "code_references", "prose_chunks", "seed")


def check_train_flags(args: argparse.Namespace) -> None:
    """Every numeric flag in range and the output paths writable, before the target loads.

    Raises:
        UsageError: naming the flag.
    """
    for name in POSITIVE + COUNTS:
        value = getattr(args, name, None)
        if value is not None:
            integer(f"--{name.replace('_', '-')}", value, low=1 if name in POSITIVE else 0, high=2**31 - 1)
    if args.lr is not None:
        finite("--lr", args.lr, low=0, low_open=True, high=1.0, fix="a peak learning rate, e.g. 3e-4")
    if args.max_time_min is not None:
        finite("--max-time-min", args.max_time_min, low=0, low_open=True, fix="minutes of training")
    if args.out is not None:
        check_output_dir("--out", args.out)
    if args.data_cache is not None:  # read when it exists, else written: never a link, FIFO or folder
        check_output("--data-cache", args.data_cache, others=[args.out / "features.safetensors"] if args.out else [])


def main(argv: Sequence[str] | None = None) -> int:
    from refspec.drafters import training

    trainers = training.load_trainers()
    args = _parser(trainers).parse_args(argv)
    try:
        check_train_flags(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    from refspec.eval import machine

    if args.autocast == "bf16" and not machine.cpu_has_fast_bf16():
        log.warning("this CPU has no bf16 instructions (avx512_bf16 or AMX): --autocast bf16 is emulated "
                    "and far slower than fp32 here")
    try:
        from refspec.drafters.head_files import head_dir_name, user_heads_dir
        from refspec.eval.runtime import load_target, parse_dtype, set_threads

        set_threads()
        trainer = trainers[args.drafter]
        out = args.out or user_heads_dir() / head_dir_name(args.model, args.drafter)
        config, options, spec = _settings(args, trainer)
        t_start = time.perf_counter()
        target = load_target(args.model, dtype=parse_dtype(args.dtype), device=torch.device("cpu"),
                             progress=not args.quiet)
        if target.tokenizer is None:
            raise ValueError(f"{target.path} has no tokenizer.json; training text cannot be tokenized")
        seqs, description, data_path = _sequences(args, target, spec)
        data_time = time.perf_counter() - t_start
        with claimed(out):  # one command trains into a folder at a time
            layers = tuple(trainer.feature_layers(target.model, options))
            dataset = _features(args, layers, target, seqs, description, data_path, out, spec.max_len)
            feature_time = time.perf_counter() - t_start - data_time
            model = target.model.float()  # the loss runs the target's embedding / LM head in float32
            command = "python -m refspec.eval train " + " ".join(argv if argv is not None else sys.argv[1:])
            provenance = {"target": args.model, "target_path": str(target.path), "command": command,
                          "data_prep_s": round(data_time, 1), "feature_s": round(feature_time, 1),
                          "date": time.strftime("%Y-%m-%d %H:%M:%S %z")}
            result = training.train(trainer, model, dataset, config, out, options=options, resume=args.resume,
                                    provenance=provenance, progress=not args.quiet)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; continue with the same command plus --resume", file=sys.stderr)
        return 130
    print(json.dumps({"drafter": args.drafter, "out": str(result.export_path), "steps": result.steps,
                      "final_loss": round(result.final_loss, 4), "train_time_s": round(result.train_time_s, 1),
                      "stopped_early": result.stopped_early, "best_step": result.best_step,
                      "best_value": result.best_value, "metrics": result.metrics}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
