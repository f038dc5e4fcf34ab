"""The OpenAI response bodies and stream chunks, with refspec's energy and acceptance added.

``usage`` keeps OpenAI's fields (``prompt_tokens``, ``completion_tokens``, ``total_tokens``) and
adds ``energy`` (the request's joules, by phase, the meter's source, the split's method and
gates, and ``ledger_request_id``, the request's id in the session's ledger and record). The
top-level ``metrics.speculative_decoding`` is vLLM's per-request acceptance object
(``--per-request-spec-decode-metrics detailed``) plus ``acceptance_per_position``; it is null
for plain decoding. A streamed response carries both in its last chunk when the client asks for
usage (``stream_options.include_usage``), as vLLM does.
"""
from __future__ import annotations

import json
import time
from typing import Any

from refspec.serve.jobs import Finish

OBJECTS = {"completions": ("text_completion", "text_completion"), "chat": ("chat.completion", "chat.completion.chunk")}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def final_usage(finish: Finish, rid: int) -> dict[str, Any]:
    """``usage`` of a finished request, with its ``energy``."""
    energy = dict(finish.energy)
    n = len(finish.tokens)
    energy["joules_per_output_token"] = energy["joules"] / n if energy["joules"] is not None and n else None
    energy["ledger_request_id"] = rid
    return {**usage(finish.prompt_tokens, n), "energy": energy}


def _choice(endpoint: str, text: str, reason: str | None, *, delta: bool, first: bool = False) -> dict[str, Any]:
    if endpoint == "completions":
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
    if delta:
        content: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": 0, "delta": content if (text or first) else {}, "logprobs": None, "finish_reason": reason}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": reason}


class Reply:
    """Builds one request's response body or stream chunks.

    Args:
        endpoint: ``completions`` or ``chat``.
        rid: the request's ledger id (part of the response id).
        model: the served model name.
        prompt_tokens: tokens in its prompt.
        prefix: the session's random part of every response id.
    """

    def __init__(self, endpoint: str, rid: int, model: str, prompt_tokens: int, prefix: str) -> None:
        self.endpoint, self.rid, self.model, self.prompt_tokens = endpoint, rid, model, prompt_tokens
        self.id = f"{'cmpl' if endpoint == 'completions' else 'chatcmpl'}-{prefix}-{rid}"
        self.created = int(time.time())
        self._first = True

    def _head(self, chunk: bool) -> dict[str, Any]:
        return {"id": self.id, "object": OBJECTS[self.endpoint][chunk], "created": self.created, "model": self.model}

    def body(self, finish: Finish, prompt: tuple[int, ...] | None = None) -> dict[str, Any]:
        """The whole response of a finished request (``prompt``: its token ids, when asked for)."""
        choice = _choice(self.endpoint, finish.text, finish.reason, delta=False)
        if prompt is not None:
            choice.update(prompt_token_ids=list(prompt), token_ids=list(finish.tokens))
        return {**self._head(False), "choices": [choice], "usage": final_usage(finish, self.rid),
                "metrics": {"speculative_decoding": finish.speculative_decoding}}

    def chunk(self, text: str, tokens: int | None, reason: str | None = None) -> str:
        """One server-sent event of streamed text (``tokens``: completion tokens so far, for
        continuous usage; None leaves usage out)."""
        out = {**self._head(True), "choices": [_choice(self.endpoint, text, reason, delta=True, first=self._first)]}
        self._first = False
        if tokens is not None:
            out["usage"] = usage(self.prompt_tokens, tokens)
        return sse(out)

    def usage_chunk(self, finish: Finish) -> str:
        """The last event when usage is asked for: no choices, the usage with its energy, the metrics."""
        return sse({**self._head(True), "choices": [], "usage": final_usage(finish, self.rid),
                    "metrics": {"speculative_decoding": finish.speculative_decoding}})


def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj)}\n\n"


DONE = "data: [DONE]\n\n"

__all__ = ["DONE", "OBJECTS", "Reply", "final_usage", "sse", "usage"]
