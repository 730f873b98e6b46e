"""``GET /``: the live page of ``mepo demo``, static files from ``server/web/static`` (nothing from the internet) that
poll ``/v1/status`` and post to ``/v1/predict`` with relative URLs, so it works behind a path prefix too.

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
    return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"), headers=NO_CACHE)


@router.get("/static/{name}")
def asset(name: str) -> Response:
    """The page's script and style sheet; only the files listed in ``ASSETS`` are served."""
    if name not in ASSETS:
        raise HTTPException(404, f"no static file {name!r}")
    return Response((STATIC / name).read_bytes(), media_type=ASSETS[name], headers=NO_CACHE)
