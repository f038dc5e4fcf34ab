"""One served request on the engine thread's side: its tokens, its text, its stop strings, its end.

The engine hands a :class:`Job` the request's new tokens after each step (:meth:`Job.feed`, on
the engine thread, before the next step starts). The job turns them into text incrementally
(only a short window of tokens is decoded each time, as vLLM and TGI do, so a long output costs
linear time), looks for the request's stop strings, and says when the request is over: at an
end-of-sequence token (unless it ignores them), at its budget, or at a stop string, after which
the server cancels it in the engine so its row stops before the next step. It streams the text
that can no longer change to the HTTP side through ``deliver`` (thread-safe).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

Deliver = Callable[[tuple[str, Any]], None]
"""Hands an item to the request's HTTP handler: ``("delta", Delta)`` or ``("done", Finish)`` or
``("error", ApiError)``; safe to call from the engine thread."""


@dataclasses.dataclass(frozen=True)
class Delta:
    """New text of a streamed request and the tokens it has got so far."""

    text: str
    tokens: int


@dataclasses.dataclass(frozen=True)
class Finish:
    """How a request ended and what its response carries.

    Attributes:
        reason: ``stop`` (end-of-sequence token or stop string), ``length`` (its budget) or ``abort``.
        text: its whole output text (cut before a stop string).
        tokens: its output token ids (to the one that completed a stop string).
        prompt_tokens: tokens in its prompt.
        energy: the ``usage.energy`` object.
        speculative_decoding: vLLM's ``metrics.speculative_decoding`` object (None without a drafter).
    """

    reason: str
    text: str
    tokens: tuple[int, ...]
    prompt_tokens: int
    energy: dict[str, Any]
    speculative_decoding: dict[str, Any] | None


class Job:
    """A request's text and end, fed token by token.

    Args:
        rid: the engine's request id.
        prompt: its prompt token ids.
        budget: its max_tokens.
        stop: strings that end it (not included in the text).
        ignore_eos: end-of-sequence tokens do not end it.
        eos: the model's end-of-sequence token ids.
        decode: ``ids -> text`` with special tokens skipped.
        deliver: hands items to the HTTP side.
        stream: deliver text deltas (else only the end).
    """

    def __init__(self, rid: int, prompt: Sequence[int], budget: int, *, stop: Sequence[str], ignore_eos: bool,
                 eos: Sequence[int], decode: Callable[[Sequence[int]], str], deliver: Deliver,
                 stream: bool) -> None:
        self.rid, self.prompt, self.budget = rid, tuple(prompt), budget
        self.stop, self.ignore_eos, self.eos = tuple(stop), ignore_eos, frozenset(eos)
        self.decode, self.deliver, self.stream = decode, deliver, stream
        self.tokens: list[int] = []
        self.text = ""
        self.sent = 0  # characters of text delivered
        self._prefix, self._read = 0, 0  # the incremental decoder's window over self.tokens
        self._hold = max((len(s) for s in self.stop), default=1) - 1  # a stop string may still be forming

    def _append(self, token: int) -> str:
        """Add one token; returns the new text it completes (an unfinished character waits)."""
        self.tokens.append(token)
        before = self.decode(self.tokens[self._prefix:self._read])
        after = self.decode(self.tokens[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.tokens)
        return after[len(before):]

    def feed(self, tokens: Sequence[int]) -> str | None:
        """The request's new tokens; returns its finish reason once it is over (``stop`` or ``length``)."""
        reason, cut = None, False
        for token in map(int, tokens):
            start = max(0, len(self.text) - self._hold)  # a stop string may straddle the old end
            self.text += self._append(token)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text, reason, cut = self.text[:min(hits)], "stop", True
                break
            if token in self.eos and not self.ignore_eos:
                reason = "stop"
                break
            if len(self.tokens) >= self.budget:
                reason = "length"
                break
        if reason and not cut:  # an unfinished character at the end is final now
            whole = self.decode(self.tokens)
            self.text = whole if whole.startswith(self.text) else self.text
        if self.stream:
            ready = len(self.text) if reason else max(self.sent, len(self.text) - self._hold)
            if ready > self.sent:
                self.deliver(("delta", Delta(self.text[self.sent:ready], len(self.tokens))))
                self.sent = ready
        return reason

    def finish(self, reason: str, energy: dict[str, Any], speculative: dict[str, Any] | None) -> Finish:
        """The request's end, with its energy and acceptance as the book has them now."""
        return Finish(reason=reason, text=self.text, tokens=tuple(self.tokens), prompt_tokens=len(self.prompt),
                      energy=energy, speculative_decoding=speculative)


__all__ = ["Deliver", "Delta", "Finish", "Job"]
