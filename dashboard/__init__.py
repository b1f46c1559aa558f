"""The live web dashboard (`goodput dashboard`, and `goodput up`'s): a small ASGI app (`app.py`) that
reads the cluster through the user API (`source.py`) and pushes it to a page (`static/`) by
server-sent events; `serve.py` runs it in the caller's asyncio loop, beside its NATS client."""
