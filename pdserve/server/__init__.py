"""The OpenAI-compatible HTTP server over one engine: protocol (pydantic bodies), serving (the
logic), metrics (Prometheus), app (FastAPI routes, errors, `run_server`). See docs/server.md."""
