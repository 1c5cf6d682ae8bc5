"""``recap serve``: an OpenAI-compatible chat-completions server around one target model.

`chat` parses requests and shapes responses, `tenants` maps keys to tenants and their
memories, `engine` steps every admitted request in one batched forward (continuous
batching), `app` is the FastAPI application, `metrics` its Prometheus counters;
``playground.html`` is the page at ``/``.
``recap serve --replicas``: `scale` (the only module that imports Ray) runs `engine`s as Ray
replicas behind the same app, `router` picks a tenant's replica, `shared` keeps the memory
folder right across processes (file locks and versions).
"""

from recap.serve.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
