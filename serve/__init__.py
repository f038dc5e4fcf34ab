"""An OpenAI-compatible HTTP server on refspec's engine, with energy and acceptance per request.

``python -m refspec.serve`` (:mod:`refspec.serve.cli`) is an adapter above the eval's pipeline:
one thread owns the model and runs the eval's continuous-batching engine
(:mod:`refspec.serve.engine_loop`); the HTTP layer (:mod:`refspec.serve.app`) only checks
requests (:mod:`refspec.serve.protocol`), queues them and streams their text
(:mod:`refspec.serve.jobs`, :mod:`refspec.serve.responses`). Every phase lands in the session's
ledger and is split among its requests as it is reported (:mod:`refspec.serve.book`), so each
response carries its joules and its acceptance; ``/metrics`` (:mod:`refspec.serve.metrics`)
and ``/v1/energy`` give the run's figures, and at shutdown the session becomes an eval record
(:mod:`refspec.serve.session`). :mod:`refspec.serve.server` puts it together.

Nothing in refspec imports this package; it needs the ``serve`` extra (Starlette, uvicorn).
"""
