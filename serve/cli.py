"""``python -m refspec.serve``: an OpenAI-compatible server on refspec's engine, with energy per request.

Examples::

    python -m refspec.serve                       # SmolLM2-135M, n-gram drafter, batch 8, on 127.0.0.1:8000
    python -m refspec.serve --model smollm2-135m --drafter none --batch 4 --port 8001 --out serve-plain

The decoder's flags are the eval's (``--model``, ``--drafter``, ``--k``, ``--spec-policy``,
``--tree``, ``--drafter-option``, ``--draft-model``, ``--batch``, sampling, ``--dtype``,
``--device``, ``--meter``, ...), checked and built by the eval's own code, so a served session
runs exactly what ``python -m refspec.eval run`` would. Every request lands in ``DIR/ledger.jsonl``;
at shutdown (SIGTERM or Ctrl-C: stop admitting, let running requests finish within
``--shutdown-timeout``, cancel the rest, exit 0) the session is written as one record to
``DIR/records.jsonl`` with ``summary.json``, ``report.md`` and each request's finish reason in
``finish_reasons.json``, so ``python -m refspec.eval report DIR`` reads it. A bad flag prints one
``error:`` line and exits 2.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from pathlib import Path
from typing import Sequence

from refspec.eval.cli_args import add_engine_flags, add_hardware_flags
from refspec.eval.flags import (EXIT_USAGE, OneLineParser, UsageError, add_sampling_args, finite, integer, one_line,
                                output_path)
from refspec.eval.outputs import RECORDS, check_output_dir, claimed

log = logging.getLogger(__name__)

DEFAULT_BATCH = 8
# run's attributes that a server takes from its clients instead of from flags
_NOT_FLAGS = dict(corpus="conversation", num_prompts=None, schedule="continuous", requests=None, request_rate=None,
                  output_len_dist="auto", no_baseline=False, accept_model=None, export_acceptance=None,
                  latency_target=None, per_request_metrics=None, no_progress=True, force=False)


def _parser(full_help: bool = True) -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m refspec.serve", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("what to serve (the eval's flags)")
    add_engine_flags(g, sweep=False, full=full_help)
    g.add_argument("--batch", type=int, default=DEFAULT_BATCH,
                   help=f"slots B: requests decoded together; more wait in the queue (default {DEFAULT_BATCH})")
    g.add_argument("--max-new-tokens", type=int, default=128,
                   help="the budget of a request that gives no max_tokens (cut to what fits; default 128)")
    add_sampling_args(g)
    g.add_argument("--no-chat", action="store_true", help="serve no chat template: /v1/chat/completions refuses")
    add_hardware_flags(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, loopback only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port, 0 for any free one (default 8000)")
    s.add_argument("--out", type=output_path, default=None, metavar="DIR",
                   help="where ledger.jsonl, records.jsonl, finish_reasons.json, summary.json and report.md go "
                        "(default: refspec-serve-<UTC date-time> in the current directory)")
    s.add_argument("--queue-limit", type=int, default=64,
                   help="requests that may wait beyond the batch; more are refused with HTTP 429 (default 64)")
    s.add_argument("--max-len", type=int, default=None,
                   help="cache slots per row: prompt + max_tokens + look-ahead must fit (default: 2048, or the "
                        "model's context if smaller)")
    s.add_argument("--served-model-name", default=None,
                   help="the name clients pass as model (default: the model id or directory name)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="after SIGTERM or Ctrl-C, seconds running requests may take to finish before they are "
                        "cancelled (default 30)")
    s.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(**_NOT_FLAGS)
    return p


def _check(args: argparse.Namespace) -> None:
    """The server's own flags (torch-free; the decoder's are checked by the eval's plan)."""
    integer("--port", args.port, low=0, high=65535)
    integer("--queue-limit", args.queue_limit, low=0, high=1_000_000)
    integer("--batch", args.batch, low=1, high=4096)
    if args.max_len is not None:
        integer("--max-len", args.max_len, low=2, high=10_000_000)
    finite("--shutdown-timeout", args.shutdown_timeout, low=0)
    if args.tp != 1:
        raise UsageError("--tp: the server runs the target on one device; start it without --tp")
    if args.phase_loops_s is not None:
        raise UsageError("--phase-loops-s: the server runs no phase-isolated loops (a counter meter's split comes "
                         "from the fit over the session's counter windows); drop it")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise UsageError("--served-model-name is empty; give the name clients pass as model")
    if args.out is None:
        args.out = Path(f"refspec-serve-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
    check_output_dir("--out", args.out)
    if (args.out / RECORDS).exists():
        raise UsageError(f"--out {args.out} holds an earlier session's records; give each session its own --out")


def _config(args: argparse.Namespace):  # -> (session kwargs, RunConfig)
    """The eval's plan of this invocation: its one configuration (the drafter's, or the baseline)."""
    from refspec.eval.cli_plan import build_plan

    plan = build_plan(args, sweep=False)
    served = [c for c in plan.configs if not c.is_baseline] or plan.configs
    return plan.session_kwargs, served[0]


def _build(args: argparse.Namespace, out_dir: Path):
    from refspec.eval.cli import apply_threads
    from refspec.eval.session import Session
    from refspec.serve.server import Server, ServeSettings

    session_kwargs, cfg = _config(args)
    apply_threads(args.threads)
    session = Session(**session_kwargs)
    drafter = session.drafter(cfg)
    if drafter is not None and not callable(getattr(drafter, "reset_rows", None)):
        raise UsageError(f"--drafter {cfg.drafter}: it has no per-slot reset (reset_rows), which a server's "
                         f"continuous batch needs")
    settings = ServeSettings(host=args.host, port=args.port, queue_limit=args.queue_limit, max_len=args.max_len,
                             model_name=args.served_model_name, default_max_tokens=args.max_new_tokens,
                             shutdown_timeout_s=args.shutdown_timeout, chat=not args.no_chat)
    return Server(settings, session, cfg, out_dir)


def start(argv: Sequence[str]):  # -> Server
    """Build a server from command-line arguments and serve it on a background thread (tests and
    benchmarks); it holds its ``--out`` directory's lock until the caller's ``Server.stop()``. Its
    engine runs on a thread other than the one that loaded the model, so on a CPU it decodes
    slower than ``python -m refspec.serve`` (:meth:`~refspec.serve.engine_loop.EngineLoop.run_here`)."""
    args = _parser(full_help=False).parse_args(list(argv))
    _check(args)
    with contextlib.ExitStack() as stack:
        out_dir = stack.enter_context(claimed(args.out))
        server = _build(args, out_dir)
        server.start()
        server.held = stack.pop_all()
    return server


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 after a requested stop, 2 for usage errors)."""
    raw = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser(full_help=any(a in ("-h", "--help") for a in raw)).parse_args(raw)
    except SystemExit as exc:
        return int(exc.code or 0)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        _check(args)
        from refspec.eval.interrupts import import_torch

        import_torch()
        with claimed(args.out) as out_dir:
            server = _build(args, out_dir)
            print(f"refspec.serve: listening on {server.url} ({server.cfg.label}, model name "
                  f"{server.app.config.model_name!r}); SIGTERM or Ctrl-C stops it", file=sys.stderr, flush=True)
            code = server.serve_forever()
            if server.record is not None:
                print(f"wrote {out_dir}: ledger.jsonl, records.jsonl, finish_reasons.json, summary.json, "
                      f"report.md ({len(server.record.request_outputs)} requests); "
                      f"python -m refspec.eval report {out_dir} reads it", file=sys.stderr)
            return code
    except KeyboardInterrupt:  # before the server was up
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (UsageError, ValueError, RuntimeError, OSError) as exc:
        if args.debug:
            raise
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE


__all__ = ["main", "start", "DEFAULT_BATCH"]
