"""The HTTP front end: an OpenAI-compatible server over any `EngineClient`.

    from sparkinfer.serve.server import OpenAIServer, ServeOptions
    OpenAIServer(engine, ServeOptions(port=8000)).run()

Modules: protocol (the wire format: pydantic request and response models, the
error body, the request -> SamplingParams mapping), handlers (completions and chat:
engine calls in, responses and SSE chunks out), state (admission, in-flight
requests, the graceful stop and the failure watch), metrics (Prometheus, the
app's own registry), app (the FastAPI routes), server (uvicorn and signals).
Nothing here knows about ranks or kernels. Importing the package imports nothing;
protocol imports pydantic, and fastapi, uvicorn and prometheus_client are imported
when an app is built (only `sparkinfer serve` does).
"""

__all__: list[str] = []
