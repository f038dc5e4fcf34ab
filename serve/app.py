"""The HTTP layer: OpenAI's routes over the engine loop (Starlette, any ASGI server).

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (plain JSON or server-sent
events), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text) and
``GET /v1/energy`` (the session's run so far: J/token of the run and of its steady-state
window, the window's validity, the ledger's path). A handler checks the request, encodes its
prompt, submits it to the :class:`~refspec.serve.engine_loop.EngineLoop` and relays what the
request's job delivers; it never touches the model. A client that disconnects has its request
cancelled (its slot is freed before the engine's next step). Every refusal is an OpenAI error
body with a 4xx status (5xx only when the engine itself stopped).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable, Sequence

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from refspec.sampling import SamplingConfig
from refspec.serve.engine_loop import EngineLoop
from refspec.serve.jobs import Finish
from refspec.serve.metrics import CONTENT_TYPE, prometheus_text
from refspec.serve.protocol import ApiError, GenerationParams, parse_request
from refspec.serve.responses import DONE, Reply, sse
from refspec.serve.session import live_energy


@dataclasses.dataclass(frozen=True, kw_only=True)
class AppConfig:
    """What the HTTP layer needs to know of the model and the session.

    Attributes:
        model_name: the name clients pass as ``model`` (``GET /v1/models``).
        max_len: cache slots per row: prompt + budget + look-ahead must fit.
        default_max_tokens: the budget of a request that gives none (cut to what fits).
        sampling: the server's sampling, shared by every request.
        chat: serve ``/v1/chat/completions`` through the tokenizer's chat template.
        vocab_size: token ids of a token-id prompt must lie below it.
        required_slots: ``(prompt tokens, budget) -> cache slots`` a request needs.
        counter_meter: the meter reads a counter that cannot see a phase.
        source: the meter's source string.
    """

    model_name: str
    max_len: int
    default_max_tokens: int
    sampling: SamplingConfig
    chat: bool
    vocab_size: int
    required_slots: Callable[[int, int], int]
    counter_meter: bool
    source: str


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


class ServeApp:
    """The Starlette application of one server session.

    Args:
        config: the model's and session's facts.
        engine_loop: the loop requests are submitted to.
        tokenizer: encodes prompts and chat messages (``refspec.assets.tokenizer.Tokenizer``).
        ledger: the session's ledger (for ``GET /v1/energy``).
    """

    def __init__(self, config: AppConfig, engine_loop: EngineLoop, tokenizer: Any, ledger: Any) -> None:
        self.config, self.loop, self.tokenizer, self.ledger = config, engine_loop, tokenizer, ledger
        self.prefix = uuid.uuid4().hex[:8]
        self.started = int(time.time())
        routes = [Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]), Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.metrics, methods=["GET"]), Route("/v1/energy", self.energy, methods=["GET"])]
        self.app = Starlette(routes=routes, exception_handlers={HTTPException: self._http_error,
                                                                ApiError: lambda _, exc: _error(exc)})

    async def _http_error(self, request: Request, exc: Exception) -> JSONResponse:
        status = getattr(exc, "status_code", 500)
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {getattr(exc, 'detail', '') or 'not served here'}"
        return JSONResponse(ApiError(status, message, kind=kind).body(), status_code=status)

    # ---- the small routes --------------------------------------------------------------------
    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{
            "id": self.config.model_name, "object": "model", "created": self.started, "owned_by": "refspec",
            "max_model_len": self.config.max_len}]})

    async def health(self, request: Request) -> Response:
        if self.loop.error is not None:
            return _error(ApiError(503, f"the engine stopped: {self.loop.error}", kind="server_error"))
        return JSONResponse({"status": "ok", "admitting": self.loop.admitting})

    async def metrics(self, request: Request) -> Response:
        text = prometheus_text(totals=self.loop.book.snapshot(), reasons=dict(self.loop.reasons),
                               running=self.loop.running, prompt_tokens=self.loop.prompt_tokens,
                               batch=self.loop.batch, model=self.config.model_name, source=self.config.source)
        return Response(text, media_type=CONTENT_TYPE)

    async def energy(self, request: Request) -> JSONResponse:
        body = await run_in_threadpool(live_energy, self.ledger, counter=self.config.counter_meter)
        return JSONResponse(body)

    # ---- generation --------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completions")

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    def _encode(self, params: GenerationParams, endpoint: str) -> list[int]:
        if endpoint == "chat":
            if not (self.config.chat and self.tokenizer.has_chat_template):
                raise ApiError(400, "this server renders no chat template (--no-chat, or the tokenizer has none); "
                                    "use /v1/completions", param="messages")
            ids = self.tokenizer.encode_chat(params.prompt)
            if not ids or max(ids) >= self.config.vocab_size:
                raise ApiError(400, "messages: the rendered conversation holds no token, or one beyond the model's "
                                    "vocabulary", param="messages")
            return ids
        ids = self.tokenizer.encode(params.prompt) if isinstance(params.prompt, str) else list(params.prompt)
        if not ids:
            raise ApiError(400, "prompt: it encodes to no token; give some text", param="prompt")
        if max(ids) >= self.config.vocab_size:
            raise ApiError(400, f"prompt: token ids must lie in 0..{self.config.vocab_size - 1}", param="prompt")
        return ids

    def _budget(self, params: GenerationParams, prompt: Sequence[int], endpoint: str) -> int:
        """The request's budget; a prompt and budget beyond the context are refused as OpenAI does."""
        cfg, n = self.config, len(prompt)
        room = cfg.max_len - cfg.required_slots(n, 0)
        budget = params.max_tokens if params.max_tokens is not None else min(cfg.default_max_tokens, room)
        if budget < 1 or cfg.required_slots(n, budget) > cfg.max_len:
            field = "max_tokens" if params.max_tokens is not None else "messages" if endpoint == "chat" else "prompt"
            raise ApiError(400, f"This model's maximum context length is {cfg.max_len} tokens. However, you "
                                f"requested {n + max(budget, 0)} tokens ({n} in the prompt, {max(budget, 0)} for the "
                                f"completion, and the engine keeps {cfg.required_slots(0, 0)} slots of look-ahead); "
                                f"reduce the prompt or max_tokens", param=field, code="context_length_exceeded")
        return budget

    async def _generate(self, request: Request, endpoint: str) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(ApiError(400, f"the request body is not valid JSON: {exc}"))
        try:
            params = parse_request(body, endpoint, self.config.sampling)
            if params.model != self.config.model_name:
                raise ApiError(404, f"The model `{params.model}` does not exist; this server serves "
                                    f"`{self.config.model_name}`", param="model", kind="not_found_error",
                               code="model_not_found")
            prompt = self._encode(params, endpoint)
            budget = self._budget(params, prompt, endpoint)
            queue: asyncio.Queue = asyncio.Queue()
            aio = asyncio.get_running_loop()

            def deliver(item: tuple[str, Any]) -> None:  # from the engine thread
                try:
                    aio.call_soon_threadsafe(queue.put_nowait, item)
                except RuntimeError:  # the event loop has closed: nobody is listening any more
                    pass

            job = self.loop.submit(prompt, budget=budget, stop=params.stop, ignore_eos=params.ignore_eos,
                                   stream=params.stream, deliver=deliver)
        except ApiError as exc:
            return _error(exc)
        reply = Reply(endpoint, job.rid, self.config.model_name, len(prompt), self.prefix)
        if params.stream:
            return StreamingResponse(self._events(job.rid, queue, reply, params), media_type="text/event-stream")
        return await self._whole(request, job.rid, queue, reply, tuple(prompt) if params.return_token_ids else None)

    async def _whole(self, request: Request, rid: int, queue: asyncio.Queue, reply: Reply,
                     prompt: tuple[int, ...] | None) -> Response:
        """Wait for the request's end; a client that leaves first has it cancelled."""
        waiting = asyncio.ensure_future(queue.get())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while True:
                done, _ = await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
                if gone in done:
                    self.loop.cancel(rid)
                    return Response(status_code=499)
                kind, item = waiting.result()
                if kind == "done":
                    return JSONResponse(reply.body(item, prompt))
                if kind == "error":
                    return _error(item)
                waiting = asyncio.ensure_future(queue.get())
        finally:
            for task in (waiting, gone):
                task.cancel()
            self.loop.cancel(rid)  # a no-op once it ended; frees its slot when the handler is torn down

    async def _events(self, rid: int, queue: asyncio.Queue, reply: Reply, params: GenerationParams
                      ) -> AsyncIterator[str]:
        """The request's stream; the ASGI server cancels it when the client disconnects."""
        try:
            if reply.endpoint == "chat":  # the first chunk names the role, as OpenAI's streams do
                yield reply.chunk("", 0 if params.continuous_usage else None)
            while True:
                kind, item = await queue.get()
                if kind == "delta":
                    yield reply.chunk(item.text, item.tokens if params.continuous_usage else None)
                    continue
                if kind == "error":
                    yield sse(item.body())
                    break
                yield self._last(reply, item, params)
                break
            yield DONE
        finally:
            self.loop.cancel(rid)

    def _last(self, reply: Reply, finish: Finish, params: GenerationParams) -> str:
        tokens = len(finish.tokens) if params.continuous_usage else None
        tail = reply.chunk("", tokens, finish.reason)
        if params.include_usage:
            tail += reply.usage_chunk(finish)
        return tail


async def _disconnected(request: Request) -> None:
    """Returns once the client has disconnected."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


__all__ = ["AppConfig", "ServeApp"]
