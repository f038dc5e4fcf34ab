"""What a server must survive, in-process on a tiny llama decoding one token per step (no drafter,
one slot, a queue of one): concurrency above the batch queues and past the queue limit answers
429; a client that disconnects mid-stream has its slot freed at the next step and its energy up to
then kept in the ledger under its request (in the session's record, its finish reason ``abort``);
a stop admits nothing more (503) and the session's ledger run ends complete."""
from __future__ import annotations

import json
import threading
import time

import pytest

from test_serve import SERVER_FLAGS, model_dir, one_thread, prompt_words  # noqa: F401  (fixtures)

LONG = 240  # tokens: a request that keeps its slot busy for many steps


def _flags() -> list[str]:
    flags = list(SERVER_FLAGS)
    for flag, value in (("--batch", "1"), ("--drafter", "none")):
        flags[flags.index(flag) + 1] = value
    i = flags.index("--k")
    del flags[i:i + 2]
    return [*flags, "--queue-limit", "1"]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory, one_thread):
    from refspec.serve.cli import start

    srv = start(["--model", str(model_dir), "--out", str(tmp_path_factory.mktemp("survive")), *_flags()])
    yield srv
    if srv.record is None and not srv.uvicorn.should_exit:
        srv.stop()


def _body(server, i: int, n: int = LONG, **extra) -> dict:
    return {"model": server.app.config.model_name, "prompt": prompt_words(i), "max_tokens": n, "ignore_eos": True,
            **extra}


def _wait(predicate, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_requests_beyond_the_queue_limit_get_429_and_the_rest_are_served(server):
    import httpx

    results: dict[int, int] = {}

    def post(i: int) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            results[i] = c.post("/v1/completions", json=_body(server, i)).status_code

    first = threading.Thread(target=post, args=(0,))
    first.start()
    assert _wait(lambda: server.loop.book.snapshot()["emitted"] > 0), "the first request must start decoding"
    second = threading.Thread(target=post, args=(1,))
    second.start()
    assert _wait(lambda: server.loop.running == 2), "the second request waits in the queue"
    with httpx.Client(base_url=server.url, timeout=60) as c:
        refused = c.post("/v1/completions", json=_body(server, 2, 4))
    assert refused.status_code == 429, "one slot and a queue of one: a third request is refused"
    assert refused.json()["error"]["code"] == "queue_full"
    first.join(60)
    second.join(60)
    assert results == {0: 200, 1: 200}, "the decoding and the queued request are both served"


def test_a_client_that_leaves_mid_stream_frees_its_slot(server):
    import httpx

    before = server.loop.book.snapshot()["emitted"]
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=_body(server, 5, LONG, stream=True)) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
        # the connection is closed here, long before the request's 200 tokens
    assert _wait(lambda: server.loop.running == 0), "the engine must free the slot of a client that left"
    aborted = [rid for rid, reason in server.loop.reasons.items() if reason == "abort"]
    assert len(aborted) == 1
    assert server.loop.book.snapshot()["emitted"] - before < LONG, "it stopped well before its budget"
    with httpx.Client(base_url=server.url, timeout=60) as c:
        ok = c.post("/v1/completions", json=_body(server, 6, 3))
    assert ok.status_code == 200, "the freed slot serves the next request"


def test_a_stop_admits_nothing_more_and_keeps_the_aborted_request_in_the_ledger(server):
    import httpx

    from refspec.energy.ledger.read import read_ledger
    from refspec.serve.session import FINISH_REASONS

    server.loop.stop_admitting()  # what SIGTERM does first
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/completions", json=_body(server, 7, 3))
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert server.stop() == 0
    records = read_ledger(server.ledger.path)
    assert [r["status"] for r in records if r.get("kind") == "end"] == ["complete"]
    out = {o.id: o for o in server.record.request_outputs}
    on_disk = json.loads((server.out_dir / FINISH_REASONS).read_text())["finish_reasons"]
    reasons = {int(k): v for k, v in on_disk.items()}
    assert set(reasons) == set(out), "every request of the record has its finish reason beside it"
    aborted = [out[rid] for rid, reason in reasons.items() if reason == "abort"]
    assert len(aborted) == 1, "the request whose client left is in the record, named abort"
    a = aborted[0]
    assert 1 <= a.output_tokens < LONG and a.energy_j > 0, "its energy up to the cancellation is charged to it"
    steps = [r for r in records if r.get("kind") == "phase" and a.id in r["slot_requests"]]
    assert steps and all(r["run_id"] == server.ledger.run_id for r in steps)
    assert sum(reason == "length" for reason in reasons.values()) == 3
