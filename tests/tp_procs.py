"""Start N processes as torchrun does (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in their
environment), so each rank's exit status and output can be checked on its own."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, size: int, port: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", REFSPEC_GEMM_PLAN="reference",
               REFSPEC_TP_TIMEOUT_S="60", PYTHONPATH=f"{REPO / 'tests'}{os.pathsep}{env.get('PYTHONPATH', '')}")
    env.update(extra or {})
    return env


def launch(args: Sequence[str], size: int, *, timeout: float = 600, cwd: Path | None = None,
           extra_env: dict[str, str] | None = None,
           preexec: Callable[[], None] | None = None) -> list[subprocess.CompletedProcess]:
    """Run ``python ARGS`` as ``size`` ranks; returns each rank's finished process (rank order)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, *args], cwd=cwd or REPO, env=rank_env(r, size, port, extra_env),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec)
             for r in range(size)]
    out = []
    for r, p in enumerate(procs):
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]
