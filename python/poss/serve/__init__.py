"""``poss serve``: an OpenAI-compatible HTTP server on the speculative loop.

Layers, each in its own module:

- :mod:`poss.serve.backend`: the step-wise batch interface (:class:`Backend`) and its continuous
  batching implementation on :class:`poss.decode.engine.DecodeEngine`. The only module that touches
  the loop.
- :mod:`poss.serve.engine`: one worker thread owns the backend; a bounded waiting queue in front of it;
  per-request event queues towards the asyncio handlers.
- :mod:`poss.serve.protocol`: OpenAI request validation and response shapes (no model, no HTTP).
- :mod:`poss.serve.app`: the FastAPI app (endpoints, SSE, errors, body limit).
- :mod:`poss.serve.metrics`: Prometheus metrics.

The ``poss serve`` command (arguments, model loading, uvicorn) is :mod:`poss.cli.serve`.
"""
