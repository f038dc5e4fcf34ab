"""The GPU-marked tests, in a subprocess (its GPU memory is freed when it exits)."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def run_gpu_tests(root: Path, timeout_s: float) -> dict[str, Any]:
    """``pytest -m gpu tests/test_cuda_graphs.py`` with this interpreter; counts and output tail."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rs", "-p", "no:cacheprovider",
           "tests/test_cuda_graphs.py"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout_s)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        out += f"\n[gpu_check] pytest timed out after {timeout_s:.0f} s"
        rc = -1
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", out)}
    failed = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    return {"command": " ".join(cmd), "returncode": rc, "seconds": time.perf_counter() - t0,
            "passed": counts.get("passed", 0), "failed": failed, "skipped": counts.get("skipped", 0),
            "output_tail": out[-4000:]}


def tests_failed(record: dict[str, Any]) -> bool:
    """Whether a test record says something failed (no tests collected, rc 5, is not a failure)."""
    return isinstance(record.get("failed"), int) and (record["failed"] > 0 or record["returncode"] not in (0, 5))
