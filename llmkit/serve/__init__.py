"""Serving: ``llmkit export`` (the static model file) and ``llmkit serve`` (an OpenAI-compatible server).

==============  ===============================================================================
``protocol``    OpenAI request models (pydantic) and response builders
``serving``     engine glue: requests -> engine requests -> JSON or SSE, usage, cancellation
``app``         the Starlette routes, errors, API key, /health, /metrics
``metrics``     Prometheus metrics
``server``      ``llmkit serve``: uvicorn, graceful shutdown
``export``      ``llmkit export`` (the only module here that imports model code)
==============  ===============================================================================

Importing this package imports nothing: the server process must never load ``llmkit.models``.
"""

MAX_REQUEST_BYTES = 4 << 20  # a request body's default limit (about a million tokens of text)
