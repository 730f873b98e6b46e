"""``GET /``: the live page, so a person who runs ``mepo demo`` sees the learner work without Grafana.

The page is static HTML, CSS and hand-written JavaScript from ``server/web/static`` (no build step, nothing fetched
from the internet). It polls ``/v1/status`` and posts to ``/v1/predict`` with URLs relative to itself, so it works
on any process that serves those routes, behind a path prefix too.

Example:
    >>> from fastapi import FastAPI
    >>> from fastapi.testclient import TestClient
    >>> app = FastAPI()
    >>> app.include_router(router)
    >>> client = TestClient(app)
    >>> "any-time accuracy" in client.get("/").text, client.get("/static/page.js").status_code
    (True, 200)
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter, HTTPException
from fastapi.responses import HTMLResponse, Response

router = APIRouter(tags=["page"], include_in_schema=False)
STATIC = files("server.web") / "static"
ASSETS = {"page.js": "text/javascript; charset=utf-8", "page.css": "text/css; charset=utf-8"}
NO_CACHE = {"Cache-Control": "no-cache"}  # a restarted server with a newer page is picked up on reload


@router.get("/")
def page() -> HTMLResponse:
    """The live page."""
    return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"), headers=NO_CACHE)


@router.get("/static/{name}")
def asset(name: str) -> Response:
    """The page's script and style sheet; only the files listed in ``ASSETS`` are served."""
    if name not in ASSETS:
        raise HTTPException(404, f"no static file {name!r}")
    return Response((STATIC / name).read_bytes(), media_type=ASSETS[name], headers=NO_CACHE)
