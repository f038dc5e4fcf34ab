"""The OpenAI request bodies the server takes, checked into typed parameters, and its error bodies.

Every field is checked for its type and range before anything is queued; an unknown field, a bad
type or an unsupported value is an :class:`ApiError` (HTTP 4xx) with OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``, and the server goes on serving.

Sampling is the server's: one continuous batch decodes every request with the one
``--temperature`` / ``--top-k`` / ``--top-p`` it was started with. A request may repeat those
values or leave them out; another value is refused rather than silently ignored. A ``seed`` has
no effect on greedy decoding; under sampling the rows of a batch share one generator, so a
per-request seed is refused. Extensions of vLLM the benchmark clients send are taken:
``top_k``, ``ignore_eos``, ``stream_options.continuous_usage_stats`` and ``return_token_ids``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

from refspec.sampling import SamplingConfig

MAX_STOP = 4
"""Stop strings one request may give (OpenAI's limit)."""


class ApiError(Exception):
    """A request the server refuses, with its HTTP status and OpenAI error fields.

    Args:
        status: HTTP status (400 bad request, 404 unknown model, 429 queue full, 503 draining).
        message: one line a user can act on.
        param: the request field at fault.
        kind: OpenAI's error ``type``.
        code: OpenAI's error ``code``.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationParams:
    """One checked request (either endpoint).

    Attributes:
        model: the model name the client asked for.
        prompt: text (a completion), token ids (a completion), or chat messages.
        max_tokens: the budget, or None for the server's default.
        stop: strings that end the output (not included in it).
        stream: answer with server-sent events.
        include_usage: streaming: a last chunk with ``usage`` (and the energy and acceptance).
        continuous_usage: streaming: ``usage`` so far in every chunk.
        ignore_eos: generate past end-of-sequence tokens until ``max_tokens``.
        return_token_ids: add the prompt's and the output's token ids to the choice.
    """

    model: str
    prompt: str | tuple[int, ...] | tuple[Mapping[str, Any], ...]
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    continuous_usage: bool
    ignore_eos: bool
    return_token_ids: bool


def _bad(field: str, need: str, value: Any) -> ApiError:
    return ApiError(400, f"{field}: expected {need}, got {json_type(value)} {value!r:.80}", param=field)


def json_type(value: Any) -> str:
    """The JSON name of ``value``'s type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def _number(field: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise _bad(field, f"a number in [{low:g}, {high:g}]", value)
    return float(value)


def _integer(field: str, value: Any, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise _bad(field, f"an integer {span}", value)
    return value


def _boolean(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad(field, "true or false", value)
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > MAX_STOP or not all(isinstance(s, str) and s for s in items):
        raise _bad("stop", f"a non-empty string or a list of at most {MAX_STOP}", value)
    return tuple(items)


def _absent_or(field: str, value: Any, allowed: tuple[Any, ...], why: str) -> None:
    """A field the server knows but does not implement: only its neutral values pass."""
    if value is not None and not any(value == a and type(value) is type(a) for a in allowed):
        raise ApiError(400, f"{field}={value!r:.60} is not supported: {why}", param=field)


# Fields every generation endpoint takes, and those it knows but only in their neutral value.
_COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options",
           "user", "ignore_eos", "return_token_ids", "presence_penalty", "frequency_penalty", "logit_bias",
           "logprobs")
_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "presence_penalty": ((0, 0.0), "no penalties are applied"),
    "frequency_penalty": ((0, 0.0), "no penalties are applied"),
    "logit_bias": (({},), "logits are not biased"),
    "logprobs": ((False, 0), "log-probabilities are not returned"),
    "top_logprobs": ((0,), "log-probabilities are not returned"),
    "echo": ((False,), "the prompt is not echoed"),
    "best_of": ((1,), "one sequence per request (n=1)"),
    "suffix": (("",), "no insertion after the completion"),
    "response_format": (({"type": "text"},), "output is free text"),
    "tools": (([],), "no tool calling"),
    "tool_choice": (("none",), "no tool calling"),
    "parallel_tool_calls": ((False, True), ""),
}
FIELDS = {"completions": _COMMON + ("prompt", "echo", "best_of", "suffix"),
          "chat": _COMMON + ("messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                             "tool_choice", "parallel_tool_calls")}


def _sampling(body: Mapping[str, Any], server: SamplingConfig) -> None:
    """The request's sampling values equal the server's (or are absent)."""
    given = {"temperature": (body.get("temperature"), server.temperature, 0.0, 2.0),
             "top_p": (body.get("top_p"), server.top_p, 0.0, 1.0)}
    for field, (value, own, low, high) in given.items():
        if value is not None and _number(field, value, low, high) != own:
            raise ApiError(400, f"{field}={value}: this server decodes every request with {field}={own:g} (one "
                                f"continuous batch, one sampling setting); leave it out or start the server with "
                                f"--{field.replace('_', '-')} {value}", param=field)
    top_k = body.get("top_k")
    if top_k is not None and _integer("top_k", top_k, -1) not in ((0, -1) if server.top_k == 0 else (server.top_k,)):
        raise ApiError(400, f"top_k={top_k}: this server decodes every request with top_k={server.top_k}; leave it "
                            f"out or start the server with --top-k {top_k}", param="top_k")
    if body.get("seed") is not None:
        _integer("seed", body["seed"], -(2**63), 2**64 - 1)
        if not server.greedy:
            raise ApiError(400, "seed: the rows of one batch share the server's generator (--seed), so a request's "
                                "own seed cannot be honoured; leave it out", param="seed")


def _prompt(value: Any) -> str | tuple[int, ...]:
    """A completion's one prompt: a string or token ids (or a list holding exactly one of them)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                 for t in value):
        return tuple(value)
    raise _bad("prompt", "one non-empty string or one non-empty list of token ids (one prompt per request)", value)


def _messages(value: Any) -> tuple[Mapping[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise _bad("messages", "a non-empty array of messages", value)
    out = []
    for i, m in enumerate(value):
        field = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise _bad(field, "an object with role system, developer, user, assistant or tool", m)
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is served
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise _bad(f"{field}.content", "a string or text parts ({\"type\": \"text\", \"text\": ...})",
                           content)
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _bad(f"{field}.content", "a string", content)
        out.append({"role": m["role"], "content": content})
    return tuple(out)


def parse_request(body: Any, endpoint: str, server: SamplingConfig) -> GenerationParams:
    """Check a request body of ``endpoint`` (``completions`` or ``chat``).

    Args:
        body: the decoded JSON body.
        endpoint: which endpoint's fields apply.
        server: the server's sampling, which every request shares.

    Raises:
        ApiError: an unknown field, a bad type or value, or a value the server does not serve.
    """
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {json_type(body)}")
    unknown = sorted(set(body) - set(FIELDS[endpoint]))
    if unknown:
        raise ApiError(400, f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise _bad("model", "the name of the model to use (GET /v1/models lists it)", body.get("model"))
    for field, (allowed, why) in _NEUTRAL.items():
        if field in body:
            _absent_or(field, body[field], allowed, why)
    if body.get("n") is not None and _integer("n", body["n"], 1) != 1:
        raise ApiError(400, "n: one choice per request is served (n=1)", param="n")
    _sampling(body, server)
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    budget = body.get(field)
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict)
                                or set(options) - {"include_usage", "continuous_usage_stats"}):
        raise _bad("stream_options", "an object with include_usage and continuous_usage_stats", options)
    options = options or {}
    flag: Callable[[str, Any], bool] = lambda f, v: False if v is None else _boolean(f, v)  # noqa: E731
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _bad("user", "a string", body["user"])
    return GenerationParams(
        model=body["model"],
        prompt=_prompt(body.get("prompt")) if endpoint == "completions" else _messages(body.get("messages")),
        max_tokens=None if budget is None else _integer(field, budget, 1), stop=_stop(body.get("stop")),
        stream=flag("stream", body.get("stream")),
        include_usage=flag("stream_options.include_usage", options.get("include_usage")),
        continuous_usage=flag("stream_options.continuous_usage_stats", options.get("continuous_usage_stats")),
        ignore_eos=flag("ignore_eos", body.get("ignore_eos")),
        return_token_ids=flag("return_token_ids", body.get("return_token_ids")))


__all__ = ["ApiError", "GenerationParams", "parse_request", "json_type", "FIELDS", "MAX_STOP"]
