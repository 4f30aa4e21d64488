"""The streaming gateway: an OpenAI-compatible HTTP server in front of one `Engine`.

`engine_loop` runs the engine on a thread of its own and hands each admitted request's
text to the asyncio side; `app` is the FastAPI application (endpoints, SSE streaming,
push-back headers, errors in the OpenAI shape); `protocol` validates request bodies;
`detokenize` turns tokens into text incrementally and matches stop strings; `metrics`
exports Prometheus figures from the same recorder `serve_bench` uses. Host world: it
never imports jax — `experiments/serve.py` builds the engine and hands it over.
"""
