"""``kvrelay serve``: an OpenAI-compatible HTTP gateway whose answers hand each other KV caches.

``protocol`` parses requests and writes OpenAI-shaped bodies, ``chat`` turns messages into tokens,
``handles`` signs and checks context handles, ``replica`` runs one model, ``pool`` holds the
replicas, ``metrics`` counts, ``app`` is the FastAPI application and ``server`` runs it (docs/serve.md).
"""
