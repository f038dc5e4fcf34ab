"""The engine's online hooks a server drives: requests from a source while the engine runs, each
request's tokens handed over as they are emitted, cancellation freeing a slot at the next step,
and a request that ignores end-of-sequence tokens (tiny llama, fp32, greedy)."""
from __future__ import annotations

import threading

import pytest
import torch

from refspec.drafters.ngram import NgramDrafter
from refspec.energy.ledger.writer import Ledger
from refspec.energy.ledger.read import read_ledger
from refspec.engine import Engine, EngineConfig, GenerationError
from refspec.serving import Request

LENS = [5, 17, 9, 30, 12, 7]
BUDGETS = [8, 20, 12, 6, 16, 9]
MAX_LEN = 96


def _requests() -> list[Request]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 96, (m,), generator=g).tolist() for m in LENS]
    prompts[1] = prompts[1][:6] * 3  # repeats: the n-gram drafter finds matches
    return [Request(id=i, prompt=tuple(p), max_new_tokens=b) for i, (p, b) in enumerate(zip(prompts, BUDGETS))]


class ListSource:
    """A scripted source: hands out one batch of requests per ``take`` and cancellations when asked."""

    def __init__(self, batches: list[list[Request]], cancel_after: dict[int, int] | None = None) -> None:
        self.batches = list(batches)
        self.cancel_after = dict(cancel_after or {})  # request id -> cancel once it has this many tokens
        self.seen: dict[int, int] = {}
        self.pending: list[int] = []
        self.waits = 0

    def take(self, *, wait: bool) -> list[Request] | None:
        if not self.batches:
            return None
        if wait:
            self.waits += 1
        return self.batches.pop(0)

    def cancelled(self) -> list[int]:
        out, self.pending = self.pending, []
        return out

    def on_tokens(self, new: dict[int, list[int]]) -> None:
        for rid, toks in new.items():
            self.seen[rid] = self.seen.get(rid, 0) + len(toks)
            if self.seen[rid] >= self.cancel_after.get(rid, float("inf")):
                del self.cancel_after[rid]
                self.pending.append(rid)


def _engine(model, drafter=True, observers=(), on_tokens=None, eos=(2,)) -> Engine:
    d = NgramDrafter() if drafter else None
    return Engine(model, d, config=EngineConfig(k=3 if drafter else 0), eos_token_ids=eos, observers=observers,
                  on_tokens=on_tokens)


@pytest.mark.parametrize("drafter", [False, True], ids=["plain", "ngram"])
def test_a_source_serves_the_same_tokens_as_a_given_stream_and_streams_them_all(tiny_models, drafter):
    model, reqs = tiny_models["llama"], _requests()
    offline = _engine(model, drafter).serve(reqs, batch=2, max_len=MAX_LEN)
    streamed: dict[int, list[int]] = {}

    def on_tokens(new):
        for rid, toks in new.items():
            streamed.setdefault(rid, []).extend(toks)

    source = ListSource([reqs[:2], [], reqs[2:4], [], [], reqs[4:]])
    online = _engine(model, drafter, on_tokens=on_tokens).serve([], batch=2, max_len=MAX_LEN, source=source)
    assert [r.tokens for r in online.requests] == [r.tokens for r in offline.requests], \
        "requests taken from a source while the engine runs must decode exactly as the same stream given up front"
    assert streamed == {r.id: r.tokens for r in online.requests}, \
        "on_tokens must hand over every emitted token of every request exactly once, in order"


class WaitingSource(ListSource):
    """Hands out its first batch at once and each later one only to a waiting engine."""

    started = False

    def take(self, *, wait: bool) -> list[Request] | None:
        if wait or not self.started:
            self.started = True
            return super().take(wait=wait)
        return [] if self.batches else None


def test_the_engine_waits_on_the_source_when_idle_and_ends_when_it_closes(tiny_models):
    reqs = _requests()
    source = WaitingSource([reqs[:1], reqs[1:2]])
    res = _engine(tiny_models["llama"], False).serve([], batch=2, max_len=MAX_LEN, source=source)
    assert [r.id for r in res.requests] == [0, 1], "both requests served, the second after an idle wait"
    assert source.waits == 1, "with every slot empty the engine must wait on the source for the second request"


def test_a_cancelled_request_stops_at_the_next_step_and_frees_its_slot(tiny_models, tmp_path):
    model, reqs = tiny_models["llama"], _requests()
    offline = _engine(model).serve(reqs, batch=2, max_len=MAX_LEN)
    source = ListSource([reqs], cancel_after={1: 3})
    with Ledger(tmp_path / "l.jsonl") as ledger:
        res = _engine(model, observers=[ledger], on_tokens=source.on_tokens).serve(
            [], batch=2, max_len=MAX_LEN, source=source)
    cut = res.requests[1]
    assert cut.cancelled and not cut.finished_by_eos, "the cancelled request must say so"
    assert 3 <= len(cut.tokens) < len(offline.requests[1].tokens), "it stops soon after the cancellation"
    assert cut.tokens == offline.requests[1].tokens[:len(cut.tokens)], "what it got before is unchanged"
    others = [r.tokens for r in res.requests if r.id != 1]
    assert others == [r.tokens for r in offline.requests if r.id != 1], "no other request's tokens change"
    assert not any(r.cancelled for r in res.requests if r.id != 1)
    phases = [r for r in read_ledger(tmp_path / "l.jsonl") if r.get("kind") == "phase"]
    last_step = max(r["step"] for r in phases if r["phase"] == "commit" and 1 in r["slot_requests"]
                    and r["row_lengths"][r["slot_requests"].index(1)] > 0)
    refill = [r for r in phases if r["phase"] == "prefill" and r["step"] >= last_step and 2 in r["slot_requests"]]
    assert refill and refill[0]["step"] <= last_step + 1, \
        "the freed slot must take the next request at the next step, not when the request's budget would have run out"


def test_a_request_that_ignores_eos_runs_to_its_budget(tiny_models):
    model, reqs = tiny_models["llama"], _requests()[:2]
    plain = _engine(model, False, eos=()).serve(reqs, batch=2, max_len=MAX_LEN)
    stop = plain.requests[0].tokens[2]  # a token the model emits: make it the end-of-sequence token
    ended = _engine(model, False, eos=(stop,)).serve(reqs, batch=2, max_len=MAX_LEN)
    assert ended.requests[0].finished_by_eos and len(ended.requests[0].tokens) <= 3
    ignoring = [Request(id=r.id, prompt=r.prompt, max_new_tokens=r.max_new_tokens, ignore_eos=True) for r in reqs]
    res = _engine(model, True, eos=(stop,)).serve(ignoring, batch=2, max_len=MAX_LEN)
    assert [r.tokens for r in res.requests] == [r.tokens for r in plain.requests], \
        "ignore_eos must decode to the budget as if no token ended the request"
    assert not any(r.finished_by_eos for r in res.requests)


def test_a_source_needs_a_cache_size_and_requests_that_fit_it(tiny_models):
    eng = _engine(tiny_models["llama"], False)
    with pytest.raises(GenerationError, match="max_len"):
        eng.serve([], batch=2, source=ListSource([]))
    too_long = Request(id=0, prompt=tuple(range(3, 90)), max_new_tokens=20)
    with pytest.raises(GenerationError, match="cache holds"):
        eng.serve([], batch=2, max_len=MAX_LEN, source=ListSource([[too_long]]))


def test_a_source_fed_from_another_thread(tiny_models):
    """The server's shape: one thread runs the engine, another puts requests in and closes."""
    from queue import Empty, Queue

    reqs = _requests()
    offline = _engine(tiny_models["llama"]).serve(reqs, batch=3, max_len=MAX_LEN)

    class QueueSource:
        def __init__(self):
            self.q: Queue = Queue()
            self.closed = False

        def take(self, *, wait):
            out = []
            try:
                item = self.q.get(timeout=10) if wait and not self.closed else self.q.get_nowait()
                while True:
                    if item is None:
                        self.closed = True
                        return out or None
                    out.append(item)
                    item = self.q.get_nowait()
            except Empty:
                return None if self.closed and not out else out

        def cancelled(self):
            return []

    src = QueueSource()
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("res", _engine(tiny_models["llama"]).serve(
        [], batch=3, max_len=MAX_LEN, source=src)), daemon=True)
    t.start()
    for r in reqs:
        src.q.put(r)
    src.q.put(None)
    t.join(timeout=60)
    assert not t.is_alive(), "the engine must end once the source closes and its requests are done"
    assert [r.tokens for r in box["res"].requests] == [r.tokens for r in offline.requests]
