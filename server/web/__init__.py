"""The web layer: the FastAPI app, its routers and middleware, and the page; it sees a running service only as a
``ServingModel`` (``server.serving``)."""
