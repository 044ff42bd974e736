"""The OpenAI-compatible HTTP server: ``build_app`` (the ASGI app) and ``serve`` (run it
with graceful drain on SIGTERM)."""
