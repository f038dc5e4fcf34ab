"""What the HTTP layer costs: tokens/s through ``python -m refspec.serve`` against the engine alone.

One request list, two paths, alternating ``--repeats`` times (the best of each is kept, so neither
gains from running second):

* the server: ``python -m refspec.serve`` as its own process (as a user starts it), driven by
  ``--clients`` concurrent streaming clients in a third process (httpx, one stream per request,
  each client sending its next request when its stream ends) over loopback, then stopped by SIGTERM;
* the engine alone: the same configuration, built in this process the way the server builds it
  (target, drafter, engine, ledger) and stopped before anything is timed, serves the same requests
  (the same prompt token ids, each to its budget: ``ignore_eos``) on the same ``--batch`` slots.

Throughput = output tokens / wall time of each; the goal is the server within 10 % of the engine.
``--threads`` sets torch's threads for both.

Usage (a quiet machine; the figures are meaningless while other jobs share the cores)::

    python scripts/serve_overhead.py --model smollm2-135m --batch 8 --clients 16 --requests 64 --max-tokens 64
    python scripts/serve_overhead.py --model /path/to/tiny_model --requests 8 --max-tokens 8   # a smoke run
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = ["Explain speculative decoding in two sentences.", "Write a Python function that reverses a list.",
           "What is the capital of France, and why?", "List three uses of a paperclip.",
           "Summarise the plot of Hamlet in one paragraph.", "def fibonacci(n):",
           "Translate 'good morning' into German, French and Italian.", "Why is the sky blue?"]


def _clients(url: str, model: str, requests: list[list[int]], budget: int, concurrency: int) -> dict:
    """The client process: ``concurrency`` streams over ``requests``; returns tokens and wall time."""
    import httpx

    async def run() -> dict:
        queue: asyncio.Queue = asyncio.Queue()
        for prompt in requests:
            queue.put_nowait(prompt)
        tokens = 0

        async def client(http: httpx.AsyncClient) -> None:
            nonlocal tokens
            while not queue.empty():
                body = {"model": model, "prompt": queue.get_nowait(), "max_tokens": budget, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {") and '"usage"' in line:
                            tokens += json.loads(line[6:])["usage"]["completion_tokens"]

        limits = httpx.Limits(max_connections=concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
            t0 = time.perf_counter()
            await asyncio.gather(*(client(http) for _ in range(concurrency)))
            return {"tokens": tokens, "wall_s": time.perf_counter() - t0}

    return asyncio.run(run())


def _requests(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.encode(f"{PROMPTS[i % len(PROMPTS)]} (request {i})") for i in range(n)]


def _build(args: argparse.Namespace, out: Path):
    """The server's session, configuration and drafter, built in this process; its HTTP side is
    stopped at once (only this thread computes afterwards)."""
    from refspec.serve.cli import start

    server = start(["--port", "0", "--out", str(out), *_flags(args)])
    server.stop()
    return server


def _flags(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--drafter", args.drafter, "--batch", str(args.batch),
            "--queue-limit", str(args.requests), "--dtype", args.dtype, "--max-len", str(args.max_len),
            "--threads", args.threads, *(["--k", str(args.k)] if args.k else [])]


def _through_server(reqs: list[list[int]], args: argparse.Namespace, out: Path) -> dict:
    """``python -m refspec.serve`` in its own process, the clients in another; SIGTERM at the end."""
    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = open(out.parent / f"{out.name}.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "refspec.serve", "--port", str(port), "--out", str(out),
                               *_flags(args)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                model = httpx.get(f"{url}/v1/models", timeout=1).json()["data"][0]["id"]
                break
            except (httpx.HTTPError, KeyError, ValueError):
                if server.poll() is not None:
                    raise RuntimeError(f"the server exited: see {log.name}") from None
                time.sleep(0.5)
        else:
            raise RuntimeError(f"the server did not start within 600 s: see {log.name}")
        job = json.dumps({"url": url, "model": model, "requests": reqs, "budget": args.max_tokens,
                          "concurrency": args.clients})
        r = subprocess.run([sys.executable, __file__, "--client-job", job], capture_output=True, text=True, check=True)
        return json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
        log.close()


def _engine_alone(server, reqs: list[list[int]], args: argparse.Namespace, out: Path) -> dict:
    from refspec.eval import pipeline
    from refspec.eval.run import build_engine
    from refspec.serving import Request

    session, cfg = server.session, server.cfg
    out.mkdir(parents=True, exist_ok=True)
    with pipeline.open_ledger(session.meter, out / "engine-alone.jsonl", "engine-alone", cfg.identity()) as ledger:
        engine = build_engine(session, cfg, server.drafter, None, ledger)
        stream = [Request(id=i, prompt=tuple(p), max_new_tokens=args.max_tokens, ignore_eos=True)
                  for i, p in enumerate(reqs)]
        t0 = time.perf_counter()
        res = pipeline.serve(engine, stream, batch=args.batch, seed=cfg.seed, device=session.device,
                             max_len=server.max_len)
        wall = time.perf_counter() - t0
    return {"tokens": res.num_emitted, "wall_s": wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", default="ngram")
    p.add_argument("--k", type=int, default=None)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", default="auto", help="torch threads for the server and the engine alone")
    p.add_argument("--repeats", type=int, default=2, help="alternating runs of each; the best is kept")
    p.add_argument("--client-job", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client_job:
        job = json.loads(args.client_job)
        print(json.dumps(_clients(job["url"], job["model"], job["requests"], job["budget"], job["concurrency"])))
        return 0
    with tempfile.TemporaryDirectory(prefix="serve-overhead-") as tmp:
        server = _build(args, Path(tmp) / "built")
        reqs = _requests(server.session.target.tokenizer, args.requests)
        runs: dict[str, list[dict]] = {"server": [], "engine": []}
        for i in range(args.repeats):
            runs["server"].append(_through_server(reqs, args, Path(tmp) / f"server-{i}"))
            runs["engine"].append(_engine_alone(server, reqs, args, Path(tmp) / f"alone-{i}"))
    served, alone = (min(r, key=lambda f: f["wall_s"]) for r in (runs["server"], runs["engine"]))
    import torch

    print(f"torch threads {torch.get_num_threads()}; best of {args.repeats} alternating runs each")
    s_tps, e_tps = served["tokens"] / served["wall_s"], alone["tokens"] / alone["wall_s"]
    print(f"{server.cfg.label}, {args.requests} requests x {args.max_tokens} tokens, {args.clients} streaming clients")
    print(f"through the server: {served['tokens']} tokens in {served['wall_s']:.2f} s = {s_tps:.1f} tok/s")
    print(f"engine alone:       {alone['tokens']} tokens in {alone['wall_s']:.2f} s = {e_tps:.1f} tok/s")
    print(f"HTTP-layer cost: {100 * (1 - s_tps / e_tps):+.1f} % of the engine's tokens/s (goal: within 10 %)")
    print("all runs, tok/s: server " + ", ".join(f"{r['tokens'] / r['wall_s']:.1f}" for r in runs["server"])
          + "; engine " + ", ".join(f"{r['tokens'] / r['wall_s']:.1f}" for r in runs["engine"]))
    return 0 if served["tokens"] == alone["tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
