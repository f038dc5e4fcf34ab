"""One server session put together: target, engine, ledger, engine loop, HTTP app, ASGI server.

:class:`Server` builds everything from the eval's :class:`~refspec.eval.session.Session` and one
``RunConfig`` (the same target, drafter, K, policy, dtype, meter and batch a ``run`` would use,
through the eval's own :func:`~refspec.eval.run.build_engine`), listens on a socket it binds
itself, and on its way out (SIGTERM, Ctrl-C, or :meth:`Server.stop`) stops admitting, lets the
running requests finish within ``shutdown_timeout_s``, cancels the rest, ends the ledger run and
writes the session's record.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from refspec.serve.app import AppConfig, ServeApp
from refspec.serve.book import RequestBook
from refspec.serve.engine_loop import EngineLoop
from refspec.serve.session import SERVED_CORPUS, write_session_record

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServeSettings:
    """The server's own settings (the decoder's are the eval's ``RunConfig``).

    Attributes:
        host: address to bind (loopback by default).
        port: TCP port (0: any free one).
        queue_limit: requests that may wait beyond the batch; more are refused with 429.
        max_len: cache slots per row (prompt + budget + look-ahead), None for the default.
        model_name: the name clients pass as ``model``, None for the model's.
        default_max_tokens: the budget of a request that gives none.
        shutdown_timeout_s: how long running requests may take to finish after a stop.
        chat: serve chat completions through the tokenizer's chat template.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    queue_limit: int = 64
    max_len: int | None = None
    model_name: str | None = None
    default_max_tokens: int = 128
    shutdown_timeout_s: float = 30.0
    chat: bool = True


DEFAULT_MAX_LEN = 2048
"""Cache slots per row unless ``--max-len`` says otherwise (capped at the model's context)."""


def _uvicorn_server(app: Any, timeout_s: float, on_exit: Any) -> Any:
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:  # stop admitting the moment the signal arrives
            on_exit()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=max(timeout_s, 0.1),
                            access_log=False)
    return _Server(config)


class Server:
    """A served session.

    Args:
        settings: the server's settings.
        session: the eval session (target, meter, drafters).
        cfg: the configuration served (its corpus is :data:`~refspec.serve.session.SERVED_CORPUS`).
        out_dir: where the ledger, the record, the summary and the report go.
    """

    def __init__(self, settings: ServeSettings, session: Any, cfg: Any, out_dir: Path) -> None:
        from refspec.energy.accounting.per_request import split_profile
        from refspec.eval import pipeline
        from refspec.eval.outputs import LEDGER
        from refspec.eval.run import build_engine, resolve_defaults

        self.started_s = time.perf_counter()
        self.sock = socket.create_server((settings.host, settings.port))  # a busy port fails before the model loads
        self.settings, self.session, self.out_dir = settings, session, out_dir
        self.cfg = cfg = resolve_defaults(session, dataclasses.replace(cfg, corpus=SERVED_CORPUS))
        target, meter = session.target, session.meter
        self.drafter = drafter = session.drafter(cfg)
        ctx = target.model.args.max_position_embeddings
        self.max_len = min(settings.max_len or DEFAULT_MAX_LEN, ctx)
        run_id = f"{cfg.config_id}.{uuid.uuid4().hex[:6]}.b0"
        labels = {**cfg.identity(), "config_id": cfg.config_id, "batch_index": 0, "batches": 1, "served": "http"}
        self.ledger = pipeline.open_ledger(meter, out_dir / LEDGER, run_id, labels)
        self.counter = pipeline.reads_counter(meter)  # phases metered only over counter windows
        profile = split_profile(session.roofline_profile, [meter.source])
        self.book = RequestBook(profile, source=meter.source, speculative=drafter is not None, k=cfg.k)
        engine = build_engine(session, cfg, drafter, None, self.ledger)
        engine.observers.append(self.book)
        tok = target.tokenizer
        session.warm(engine, cfg, [tok.encode("Hello, how are you?") or [0]])
        gen = torch.Generator(device=session.device).manual_seed(cfg.seed)
        self.loop = EngineLoop(engine, self.book, batch=cfg.batch, max_len=self.max_len,
                               queue_limit=settings.queue_limit, eos=target.eos_token_ids, generator=gen,
                               decode=lambda ids: tok.decode(ids, skip_special_tokens=True))
        name = settings.model_name or Path(str(cfg.model)).name
        app_config = AppConfig(model_name=name, max_len=self.max_len, default_max_tokens=settings.default_max_tokens,
                               sampling=engine.config.sampling, chat=settings.chat,
                               vocab_size=target.model.args.vocab_size, required_slots=engine.required_slots,
                               counter_meter=self.counter, source=meter.source)
        self.app = ServeApp(app_config, self.loop, tok, self.ledger)
        self.uvicorn = _uvicorn_server(self.app.app, settings.shutdown_timeout_s, self.loop.stop_admitting)
        self._thread: threading.Thread | None = None
        self.held = contextlib.ExitStack()  # what a background server releases at its stop (its --out lock)
        self.record: Any = None  # the session's RunRecord, once written

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://{host}:{port}"

    # ---- running ------------------------------------------------------------------------------
    def serve_forever(self) -> int:
        """Serve until SIGTERM or Ctrl-C, then shut down; returns the exit status.

        The engine runs on this (main) thread, the one that loaded the model
        (:meth:`EngineLoop.run_here` says why); the HTTP server runs on a thread of its own and,
        once it has stopped, ends the engine's run.
        """
        previous = {sig: signal.signal(sig, self.uvicorn.handle_exit) for sig in (signal.SIGTERM, signal.SIGINT)}
        http = threading.Thread(target=self._serve_http, name="refspec-http")
        try:
            http.start()
            log.info("serving %s on %s (ledger %s)", self.cfg.label, self.url, self.ledger.path)
            self.loop.run_here()
        finally:
            self.uvicorn.should_exit = True  # the engine loop died: the HTTP server stops too
            if http.ident is not None:
                http.join()
            code = self.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return code

    def _serve_http(self) -> None:
        try:
            self.uvicorn.run(sockets=[self.sock])
        finally:  # the last response has gone: the running requests finish, then the engine's run ends
            self.loop.finish(self.settings.shutdown_timeout_s)

    def start(self) -> None:
        """Serve on a background thread (tests, benchmarks); :meth:`stop` ends it."""
        self.loop.start()
        self._thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                        name="refspec-http")
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.uvicorn.started:
            raise RuntimeError("the HTTP server did not start")

    def stop(self) -> int:
        """What SIGTERM does to a served session: stop admitting, drain, end the run; the exit status."""
        self.uvicorn.handle_exit(signal.SIGTERM, None)
        if self._thread is not None:
            self._thread.join()
        with self.held:
            return self.shutdown()

    def shutdown(self) -> int:
        """After the HTTP server has stopped: end the engine loop and the ledger run, write the record."""
        result = self.loop.close(self.settings.shutdown_timeout_s)
        failed = self.loop.error is not None
        self.ledger.close("aborted" if failed else "complete", type(self.loop.error).__name__ if failed else None)
        if failed or result is None:
            log.error("the engine loop stopped with %r; the ledger run is marked aborted", self.loop.error)
            return 1
        self.record = write_session_record(self.session, self.cfg, drafter=self.drafter, out_dir=self.out_dir,
                                           ledger=self.ledger, result=result, submitted=self.loop.submitted,
                                           reasons=self.loop.reasons, started_s=self.started_s)
        return 0


__all__ = ["DEFAULT_MAX_LEN", "Server", "ServeSettings"]
