"""``molt view RUN_DIR [RUN_DIR ...]``: a run browser on 127.0.0.1, from the curves down to each token.

Pages (``templates/``): the runs given and a compare form (``/``); a run's curves, a point clicked opens its step
(``/run/I``); a step's groups side by side (``/run/I/step/S``); a sample's conversation, every token coloured by a
chosen field (``.../sample/G/M``); a sample not trained on (``/run/I/outcast/K``); the trainer's phases and the groups'
generation on wall time (``/run/I/timeline``); search over recorded samples (``/run/I/samples``); 2-4 runs' curves
overlaid with molt-bench's verdict (``/compare``). ``/api/run/I/curves`` feeds the charts (a run still going is
polled).

Built on what the package already has: Starlette and uvicorn serve it, Jinja2 renders the pages, and the charts are
Plotly's, its ``plotly.min.js`` served from the ``plotly`` wheel (no JavaScript build step, nothing from a CDN: it
works on an offline cluster). The only JavaScript written here is ``static/view.js`` (the charts' click-through and
the token colouring).

Safe by default: bound to 127.0.0.1; another host needs ``--token`` (asked of every request, as ``?token=`` once, then
a cookie). Runs are addressed by their index among the folders given and static files by a fixed list, so no URL
names a path: the server reads nothing outside the run folders it was given.
"""

from __future__ import annotations

import argparse
import hmac
import math
import os
import secrets
from pathlib import Path

from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from . import pages
from .runs import Run, expand

HERE = Path(__file__).parent


def _plotly_js() -> Path:
    import plotly

    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


STATIC = {"view.js": (HERE / "static" / "view.js", "text/javascript"),
          "view.css": (HERE / "static" / "view.css", "text/css"),
          "plotly.min.js": (None, "text/javascript")}  # from the plotly wheel


def app(folders: list[str], token: str | None = None) -> Starlette:
    """The viewer's ASGI app over ``folders`` (``token``: required of every request when given)."""
    runs = expand(folders)
    env = Environment(loader=PackageLoader("molt_lightning.view"), autoescape=select_autoescape())
    env.filters["num"] = _num

    def html(name: str, **context) -> HTMLResponse:
        return HTMLResponse(env.get_template(name).render(runs=runs, **context))

    def run_of(request: Request) -> Run:
        i = request.path_params["i"]
        if not 0 <= i < len(runs):
            raise _NotFound(f"no run {i}: molt view was given {len(runs)} folders")
        return runs[i].refresh()

    async def index(request: Request) -> Response:
        for r in runs:
            r.refresh()
        return html("index.html", metrics=pages.compare_metrics(runs))

    async def overview(request: Request) -> Response:
        run = run_of(request)
        return html("run.html", run=run, i=request.path_params["i"], data=pages.curves(run))

    async def curves(request: Request) -> Response:
        run = run_of(request)
        name = request.query_params.get("metric")
        return JSONResponse(pages.metric_series(run, name) if name else pages.curves(run))

    async def step(request: Request) -> Response:
        run, s = run_of(request), request.path_params["s"]
        return html("step.html", run=run, i=request.path_params["i"], **pages.step(run, s))

    async def sample(request: Request) -> Response:
        run, p = run_of(request), request.path_params
        return html("sample.html", run=run, i=p["i"], **pages.sample(run, p["s"], p["g"], p["m"]))

    async def outcast(request: Request) -> Response:
        run, p = run_of(request), request.path_params
        return html("outcast.html", run=run, i=p["i"], **pages.outcast(run, p["k"]))

    async def timeline(request: Request) -> Response:
        run, q = run_of(request), request.query_params
        return html("timeline.html", run=run, i=request.path_params["i"],
                    **pages.timeline(run, _int(q.get("from")), _int(q.get("to"))))

    async def samples(request: Request) -> Response:
        run = run_of(request)
        return html("samples.html", run=run, i=request.path_params["i"],
                    **pages.search(run, dict(request.query_params)))

    async def compare(request: Request) -> Response:
        chosen = [int(x) for x in request.query_params.getlist("runs") if x.isdigit() and int(x) < len(runs)]
        metric = request.query_params.get("metric") or "reward"
        return html("compare.html", metric=metric, **pages.compare([runs[i].refresh() for i in chosen], metric))

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC:
            return PlainTextResponse("not found", status_code=404)
        path, media = STATIC[name]
        return FileResponse(path or _plotly_js(), media_type=media, headers={"Cache-Control": "max-age=3600"})

    routes = [Route("/", index), Route("/run/{i:int}", overview), Route("/api/run/{i:int}/curves", curves),
              Route("/run/{i:int}/step/{s:int}", step),
              Route("/run/{i:int}/step/{s:int}/sample/{g:int}/{m:int}", sample),
              Route("/run/{i:int}/outcast/{k:int}", outcast), Route("/run/{i:int}/timeline", timeline),
              Route("/run/{i:int}/samples", samples), Route("/compare", compare), Route("/static/{name}", static)]
    middleware = [Middleware(_Token, token=token)] if token else []
    return Starlette(routes=routes, middleware=middleware, exception_handlers={_NotFound: _not_found})


class _NotFound(Exception):
    pass


async def _not_found(request: Request, exc: Exception) -> Response:
    return PlainTextResponse(str(exc), status_code=404)


class _Token(BaseHTTPMiddleware):
    """Every request carries the token: ``?token=`` (then kept as a cookie) or the cookie."""

    def __init__(self, app, token: str):
        super().__init__(app)
        self.token = token

    async def dispatch(self, request: Request, call_next):
        given = request.query_params.get("token") or request.cookies.get("molt_view_token") or ""
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            return PlainTextResponse("molt view: this server needs its token (?token=...)", status_code=403)
        response = await call_next(request)
        response.set_cookie("molt_view_token", self.token, httponly=True, samesite="strict")
        return response


def _int(x: str | None) -> int | None:
    return int(x) if x is not None and x.lstrip("-").isdigit() else None


def _num(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="molt view", description="A run browser for run folders (molt fit's, molt-bench's"
                                "): curves, steps, samples down to each token, a timeline, compare.")
    p.add_argument("folders", nargs="+", metavar="RUN_DIR", help="run folders, e.g. runs/default/version_0")
    p.add_argument("--port", type=int, default=8050, help="0: any free port (default 8050)")
    p.add_argument("--host", default="127.0.0.1", help="another address than 127.0.0.1 needs --token")
    p.add_argument("--token", default=None, help="asked of every request; with --host, `--token new` makes one")
    args = p.parse_args(argv)
    missing = [f for f in args.folders if not os.path.isdir(f)]
    if missing:
        p.error(f"not a folder: {', '.join(missing)} (give run folders, e.g. runs/default/version_0)")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.token:
        p.error(f"--host {args.host} serves the runs to other machines: add --token SECRET (or --token new)")
    token = secrets.token_urlsafe(16) if args.token == "new" else args.token
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        p.error(f"cannot listen on {args.host}:{args.port} ({e.strerror}): choose another --port (0: any free one)")
    port = sock.getsockname()[1]
    print(f"molt view: http://{args.host}:{port}/" + (f"?token={token}" if token else "") + " (Ctrl-C stops it)",
          flush=True)
    server = uvicorn.Server(uvicorn.Config(app(args.folders, token), log_level="warning"))
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
