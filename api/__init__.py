"""OpenAI-compatible HTTP API: starlette routes, SSE streaming, the engine worker, conversation snapshots."""
