"""The GPU check's serving point reads its window and percentiles as the accounting does.

One served run (the dry-run bench's toy target, a ledger written beside the check's tiles):
the check's figures must equal :func:`refspec.energy.accounting.account` of that ledger.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    from gpucheck.bench import build_bench, load_target

    out = tmp_path_factory.mktemp("out")
    args = gpu_check.parse_args(["--dry-run", "--blocks", "core", "--batches", "2", "--drafters", "none:0",
                                 "--prompt-len", "16", "--new-tokens", "12", "--kv-bucket", "16", "--out", str(out)])
    b = build_bench(args)
    load_target(b, args, "llama-3.1-8b", max_batch=2, max_k=0)
    return args, b


def _served(bench, tmp_path, requests):
    """The check's served run and figures, and the accounting of the ledger the same run wrote."""
    from refspec.energy.accounting import account
    from refspec.energy.ledger import Ledger, read_ledger
    from refspec.engine import Engine, EngineConfig

    from gpucheck.serving import served_figures, served_run

    args, b = bench
    path = tmp_path / "ledger.jsonl"
    with Ledger(path, run_id="served") as ledger:
        factory = (lambda on_step: Engine(b.target, None, config=EngineConfig(k=0, kv_bucket=args.kv_bucket),
                                          verify_fn=b.target_runner, observers=[ledger], on_step=on_step))
        res, tiles, _ = served_run(b, factory, requests, 2)
    return served_figures(b, res, tiles, None), account(read_ledger(path, strict=True)), res


def test_closed_loop_window_and_percentiles_are_the_accountings(bench, tmp_path):
    from gpucheck.serving import stream

    fig, acc, _ = _served(bench, tmp_path, stream(2, bench[0], bench[1].target.args.vocab_size))
    (s0, s1), = acc.window.bounds
    assert fig["window_steps"] == [max(s0, 1), s1]  # step 0 has no tile: the meter opens after it
    for name in ("tpot_p99_s", "ttft_p50_s", "ttft_p99_s"):
        assert fig[name] == pytest.approx(getattr(acc, name), rel=1e-9, abs=1e-12), name
    assert fig["tpot_s"] == pytest.approx(acc.tpot_p50_s, rel=1e-9, abs=1e-12)


def test_open_loop_gap_keeps_the_window_open_as_the_accounting_does(bench, tmp_path):
    from gpucheck.serving import stream

    requests = stream(2, bench[0], bench[1].target.args.vocab_size)
    # request 1 finishes early; the last request arrives long after: a slot stays empty while the queue is not
    requests = [dataclasses.replace(r, arrival_s=0.0 if r.id < 3 else 1e3,
                                    max_new_tokens=3 if r.id == 1 else 12) for r in requests]
    fig, acc, res = _served(bench, tmp_path, requests)
    (s0, s1), = acc.window.bounds
    assert fig["window_steps"] == [max(s0, 1), s1]
    assert any(-1 in slots for slots in res.slot_requests_per_step[s0:s1])  # it spans a step with an empty slot
