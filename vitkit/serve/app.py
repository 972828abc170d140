"""`vitkit serve`: an HTTP service (FastAPI on uvicorn) for a checkpoint, and its web page.

    POST /predict   an image (multipart field "file", a raw image body, or JSON {"image": base64}) -> top-k
    POST /explain   the same -> top-k, the attention rollout overlay (PNG, base64) and per-layer maps
    GET  /healthz   liveness;  GET /model: config, classes, preprocessing;  GET /metrics: Prometheus text
    GET  /          the web page: drop an image, see the top-5 and what the model attends to

Requests are micro-batched (`engine.MicroBatcher`); decoding and the model run in threads, never on the event
loop. Bad input is a 4xx with a message and costs the service nothing: a body over the upload limit (413), an
image over the pixel limit (413), a non-image or truncated file (400), a wrong content type (415), malformed JSON
or base64 (400), an image too large to decode in memory (413), headers over 32 KiB (431). A full queue answers 503,
as does an upload past the budget of all uploads in flight; a request over its time limit 504. A connection costs
little and is never waited for (`uvicorn_config`): headers not complete within the header timeout get 408 and are
closed (slowloris), an unread answer is dropped after the write timeout, and past the connection limit the
longest-idle connection makes room.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import contextlib
import json
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from starlette.requests import ClientDisconnect
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from uvicorn.protocols.http.h11_impl import H11Protocol
import h11

from ..data.image import ImageDecodeError
from ..errors import UsageError
from ..safety import parse_json
from .engine import MicroBatcher, Predictor, QueueFull, explanations, overlay_png, softmax_top
from PIL import Image
import io

STATIC = Path(__file__).parent / "static"


# The request and response bodies in the OpenAPI schema (/openapi.json, /docs), which schemathesis tests against.
_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
ERROR = {"description": "refused, with the reason", "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
ERROR_RESPONSES = {
    400: {**ERROR, "description": "not an image, a truncated one, malformed JSON, multipart or base64, a bad top_k"},
    401: {**ERROR, "description": "the service has an API key and the request did not send it"},
    413: {**ERROR, "description": "a body over the upload limit, or an image over the pixel limit or too large to "
                                  "decode in memory"},
    415: {**ERROR, "description": "a content type other than multipart, JSON or image/*"},
    503: {**ERROR, "description": "the queue is full: retry shortly"},
    504: {**ERROR, "description": "the request took longer than its time limit"},
}
_TOP = {"type": "array", "items": {"type": "object", "required": ["index", "label", "probability"], "properties": {
    "index": {"type": "integer"}, "label": {"type": "string"}, "probability": {"type": "number"}}}}
PREDICT_OK = {"description": "the top-k classes", "content": {"application/json": {"schema": {
    "type": "object", "required": ["top", "model"], "properties": {"top": _TOP, "model": {"type": "string"}}}}}}
EXPLAIN_OK = {"description": "the top-k classes, the attention rollout overlay and per-layer maps", "content": {
    "application/json": {"schema": {"type": "object", "required": ["top", "model", "class", "overlay_png", "image_png"],
                                    "properties": {"top": _TOP, "model": {"type": "string"}, "class": {"type": "string"},
                                                   "overlay_png": {"type": "string"}, "image_png": {"type": "string"}}}}}}
MAX_TOP_K = 1_000_000
_K = {"type": "integer", "minimum": 1, "maximum": MAX_TOP_K, "description": "how many classes (at most all)"}
_TOP_K = {"name": "top_k", "in": "query", "required": False, "schema": _K}
IMAGE_REQUEST = {
    "parameters": [_TOP_K],
    "requestBody": {"required": True, "content": {
        "multipart/form-data": {"schema": {"type": "object", "required": ["file"], "properties": {
            "file": {"type": "string", "format": "binary"}, "top_k": _K}}},
        "application/json": {"schema": {"type": "object", "required": ["image"], "properties": {
            "image": {"type": "string", "format": "byte", "description": "the image file, base64"},
            "top_k": _K}}},
        "image/png": {"schema": {"type": "string", "format": "binary"}},
        "image/jpeg": {"schema": {"type": "string", "format": "binary"}},
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
    }},
}


@dataclass
class Limits:
    """What one request may cost."""

    max_upload_mb: float = 10.0
    max_pixels: int = 40_000_000
    timeout_s: float = 30.0
    max_batch: int = 8
    max_wait_ms: float = 5.0
    max_queue: int = 64
    top_k: int = 5
    max_patches: int | None = None  # native aspect ratios, packed batches (NaFlex); None: the checkpoint's square size
    max_batch_patches: int | None = None  # the most padded patch tokens in one packed forward (max_batch x max_patches)
    # what one connection may cost (`uvicorn_config`): a slow or idle client is closed, never waited for
    header_timeout_s: float = 5.0  # a request's headers complete within this of their first byte (or the connection's
    #                                opening); else 408 and closed
    keep_alive_s: float = 5.0  # a connection with no request in flight and nothing sent is closed after this
    write_timeout_s: float = 30.0  # a client that reads nothing of its answer for this long is disconnected
    max_connections: int = 2048  # open at once; one more closes the longest-idle one, or is answered 503 if none is idle
    max_uploads_mb: float = 256.0  # the bodies of all requests in flight together; one that passes it is answered 503


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


MAX_HEADER_BYTES = 32 * 1024  # a request's headers (h11 refuses more than 16 KiB arriving in pieces: 400)


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets 413 before the app reads it (Content-Length), or
    as soon as it passes the limit (a chunked body); headers over MAX_HEADER_BYTES get 431. With a `budget`, the
    bodies of all requests in flight together: a request whose body passes it gets 503 (bounded memory however
    many upload at once)."""

    def __init__(self, app, limit: int, budget: int | None = None) -> None:
        self.app, self.limit, self.budget = app, limit, budget
        self.held = 0  # body bytes of the requests in flight

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if sum(len(k) + len(v) + 4 for k, v in scope.get("headers") or []) > MAX_HEADER_BYTES:
            return await _send_error(send, 431, f"the request headers are over {MAX_HEADER_BYTES:,} bytes")
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await _send_error(send, 413, f"the request body is over the upload limit of {self.limit:,} bytes")
        seen = 0
        sent = False

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                n = len(msg.get("body", b""))
                seen += n
                self.held += n
                if seen > self.limit:
                    raise HTTPError(413, f"the request body is over the upload limit of {self.limit:,} bytes")
                if self.budget is not None and self.held > self.budget:
                    raise HTTPError(503, f"the service holds {self.budget:,} bytes of uploads at once already: "
                                         f"retry shortly")
            return msg

        async def tracking_send(msg):
            nonlocal sent
            if msg["type"] == "http.response.start":
                sent = True
            await send(msg)

        try:
            await self.app(scope, limited, tracking_send)
        except HTTPError as e:
            if not sent:
                await _send_error(send, e.status, e.message)
        finally:
            self.held -= seen


async def _send_error(send, status: int, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _raw_response(status: int, message: str) -> bytes:
    body = json.dumps({"error": message}).encode()
    phrase = {408: b"Request Timeout", 503: b"Service Unavailable"}[status]
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, phrase, len(body)) + body)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 connection (h11: headers over 16 KiB are a 400) with what it lacks against a client that
    is slow on purpose (slowloris): its request headers must be complete within `header_timeout_s` of their first
    byte (a fresh connection: of its opening), else 408 and closed; an answer the client does not read for
    `write_timeout_s` drops the connection; past `max_connections` open, a new one closes the longest-idle
    connection (no request in flight), or is answered 503 when every one is busy. `uvicorn_config` makes a subclass
    bound to a `Limits`."""

    limits = Limits()
    _cycle = None  # the request in flight (uvicorn sets `cycle` as a request's headers complete)
    _busy = False  # a request is in flight
    _partial = False  # bytes of the next request came
    _deadline: asyncio.TimerHandle | None = None  # the headers' deadline
    _write_timer: asyncio.TimerHandle | None = None

    @property
    def cycle(self):
        return self._cycle

    @cycle.setter
    def cycle(self, value) -> None:
        self._cycle = value
        if value is not None:  # a request's headers are complete: from here the app's time limit applies
            self._busy, self._partial = True, False
            self._cancel_deadline()
            self._idle().pop(self, None)

    def _idle(self) -> collections.OrderedDict:
        """The server's connections with no request in flight, longest idle first."""
        return self.server_state.__dict__.setdefault("vitkit_idle", collections.OrderedDict())

    def _open(self) -> set:
        """The server's connections not closing."""
        return self.server_state.__dict__.setdefault("vitkit_open", set())

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        opened, idle = self._open(), self._idle()
        opened.add(self)
        while len(opened) > self.limits.max_connections and idle:  # the longest idle make room
            idle.popitem(last=False)[0]._close()
        if len(opened) > self.limits.max_connections:
            transport.write(_raw_response(503, f"the service has {self.limits.max_connections:,} connections open, "
                                               f"all busy: retry shortly"))
            self._close()
            return
        idle[self] = None
        self._arm_deadline()

    def data_received(self, data: bytes) -> None:
        if not self._busy:
            self._partial = True
            if self._deadline is None:  # the first byte of the next request
                self._arm_deadline()
        super().data_received(data)

    def on_response_complete(self) -> None:
        self._busy = False  # until the next request (pipelined: at once, through `cycle`)
        if not self.transport.is_closing():
            self._idle()[self] = None
        super().on_response_complete()

    def _arm_deadline(self) -> None:
        self._cancel_deadline()
        self._deadline = self.loop.call_later(self.limits.header_timeout_s, self._headers_late)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_late(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self._busy:
            return
        if self._partial and self.conn.our_state is h11.IDLE:  # part of a request came, nothing answered yet
            self.transport.write(_raw_response(408, f"the request headers took longer than "
                                                    f"{self.limits.header_timeout_s} s"))
        self._close()

    def _close(self, abort: bool = False) -> None:
        self._idle().pop(self, None)
        self._open().discard(self)
        self.transport.abort() if abort else self.transport.close()

    def pause_writing(self) -> None:  # the client's receive window and our buffer are full
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout_s, self._close, True)

    def resume_writing(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._idle().pop(self, None)
        self._open().discard(self)
        self._cancel_deadline()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().connection_lost(exc)


def uvicorn_config(app, limits: Limits | None = None, **kwargs):
    """The uvicorn.Config serving `app` (from `create_app`) within the connection limits of `limits` (default: the
    app's): HTTP/1.1 by `GuardedH11Protocol`, keep-alive `keep_alive_s`, no WebSocket. `kwargs` go to uvicorn."""
    import uvicorn

    limits = limits or getattr(app, "limits", None) or Limits()
    protocol = type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})
    return uvicorn.Config(app, **{"http": protocol, "ws": "none", "timeout_keep_alive": limits.keep_alive_s,
                                  "backlog": _backlog(limits.max_connections), "log_level": "warning", **kwargs})


def _backlog(max_connections: int) -> int:
    """The listen queue, also how many connections asyncio accepts at once, up to three times before the first of
    them counts (`vitkit serve` raises its open-file limit to fit `fds_needed`; out of them, it stops accepting)."""
    return max(16, min(2048, max_connections // 4))


def fds_needed(max_connections: int) -> int:
    """The file descriptors `max_connections` may take at once, beyond what the process holds otherwise."""
    return max_connections + 3 * _backlog(max_connections)


def create_app(predictor: Predictor, limits: Limits | None = None, name: str = "model", api_key: str | None = None):
    """The FastAPI application serving `predictor` within `limits`. With an `api_key`, every endpoint but the page
    and /healthz answers 401 to a request without it (header X-API-Key, or Authorization: Bearer KEY)."""
    limits = limits or Limits()
    c = predictor.config
    names = list(c.class_names or [str(i) for i in range(c.num_classes)])
    if limits.max_patches:
        if predictor.backend != "torch" or getattr(predictor.config, "arch", "vit") != "vit" \
                or getattr(predictor.config, "hybrid_layers", None) is not None:
            raise UsageError("--max-patches (packed batches of mixed sizes) serves a plain ViT on --backend torch")
        predictor.max_patches = limits.max_patches
        if hasattr(predictor, "model"):
            predictor.model.set_dynamic_img_size(True)  # /explain runs the image alone at its own size
    batcher = MicroBatcher(predictor, limits.max_batch, limits.max_wait_ms, limits.max_queue, limits.max_batch_patches)
    decode_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="vitkit-decode")
    registry = CollectorRegistry()
    requests = Counter("vitkit_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=registry)
    latency = Histogram("vitkit_request_seconds", "request latency by endpoint", ["endpoint"], registry=registry,
                        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
    queue_depth = Gauge("vitkit_queue_depth", "requests waiting for the model", registry=registry)
    queue_depth.set_function(lambda: batcher.waiting)
    batches = Gauge("vitkit_batches", "model batches run", registry=registry)
    batches.set_function(lambda: batcher.stats.batches)
    images = Gauge("vitkit_batched_images", "images through the model", registry=registry)
    images.set_function(lambda: batcher.stats.images)
    tokens = Gauge("vitkit_packed_tokens", "patch tokens of packed batches (padding included)", registry=registry)
    tokens.set_function(lambda: batcher.stats.tokens)
    padding = Gauge("vitkit_packed_padding_tokens", "padding tokens of packed batches", registry=registry)
    padding.set_function(lambda: batcher.stats.padding)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        batcher.start()
        yield
        await batcher.stop()
        decode_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="vitkit", description=f"{name}: a Vision Transformer service", docs_url="/docs", lifespan=lifespan)

    async def read_image(request: Request) -> tuple[bytes, dict]:
        """The image bytes of a request and its options, or an HTTPError naming what is wrong."""
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        opts: dict = dict(request.query_params)
        if ctype == "multipart/form-data":
            try:
                form = await request.form(max_files=1, max_fields=8)
            except (HTTPError, ClientDisconnect):  # over a limit while read, or gone
                raise
            except Exception as e:
                raise HTTPError(400, f"malformed multipart body: {e}") from e
            f = form.get("file")
            if f is None or isinstance(f, str):
                raise HTTPError(400, 'a multipart request needs the image in a file field named "file"')
            opts.update({k: v for k, v in form.items() if isinstance(v, str)})
            return await f.read(), opts
        if ctype == "application/json":
            try:
                body = parse_json(await request.body(), "the JSON body")
            except UsageError as e:
                raise HTTPError(400, f"malformed JSON: {e}") from e
            if not isinstance(body, dict) or not isinstance(body.get("image"), str):
                raise HTTPError(400, 'a JSON request needs {"image": "<base64 of the image file>"}')
            try:
                data = base64.b64decode(body["image"], validate=True)
            except (binascii.Error, ValueError) as e:
                raise HTTPError(400, f'"image" is not valid base64: {e}') from e
            opts.update({k: v for k, v in body.items() if k != "image"})
            return data, opts
        if ctype.startswith("image/") or ctype == "application/octet-stream":
            return await request.body(), opts
        raise HTTPError(415, f"unsupported content type {ctype or '(none)'!r}: send multipart/form-data with a \"file\", "
                             f"application/json with base64 \"image\", or a raw image/* body")

    async def decode(data: bytes) -> tuple[np.ndarray, np.ndarray]:
        if not data:
            raise HTTPError(400, "the image is empty")
        try:
            return await asyncio.get_running_loop().run_in_executor(decode_pool, predictor.preprocess, data, limits.max_pixels)
        except ImageDecodeError as e:  # a refusal (over a limit: 413) or not a decodable image (400)
            status = 413 if re.search(r"decompression bomb|refused|over the limit|too large|out of memory", str(e)) else 400
            raise HTTPError(status, re.sub(r"(image )?<_io\.BytesIO object at 0x[0-9a-f]+>", "the upload", str(e))) from e
        except MemoryError as e:  # e.g. 1 x 50,000,000 pixels: within the pixel limit, its resize is not
            raise HTTPError(413, "the image is too large to decode and resize within this service's memory (an "
                                 "extreme aspect ratio?)") from e
        except (UsageError, ValueError) as e:  # an image the model's geometry cannot take
            raise HTTPError(400, f"cannot process the upload: {e}") from e

    def one_k(value) -> int:
        if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d{1,30}\s*", value):
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_TOP_K:
            raise HTTPError(400, f"top_k must be an integer from 1 to {MAX_TOP_K:,}, got {str(value)[:100]!r}")
        return value

    def top_k(opts: dict, query) -> int:
        """The body's top_k (else the query's, else the default), at most every class; the query's is checked too."""
        if "top_k" in query:
            one_k(query["top_k"])
        return min(one_k(opts.get("top_k", limits.top_k)), len(names))

    def authorised(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not secrets.compare_digest(given.encode(), api_key.encode()):
            raise HTTPError(401, "this service needs an API key: send it as the X-API-Key header (or Authorization: "
                                 "Bearer KEY)")

    def denied(request: Request) -> JSONResponse | None:
        try:
            authorised(request)
        except HTTPError as e:
            return JSONResponse({"error": e.message}, status_code=e.status)
        return None

    async def guarded(endpoint: str, work, request: Request):
        t0 = time.perf_counter()
        try:
            authorised(request)
            result = await asyncio.wait_for(work(), limits.timeout_s)
            status, payload = 200, result
        except HTTPError as e:
            status, payload = e.status, {"error": e.message}
        except QueueFull as e:
            status, payload = 503, {"error": f"the service is busy: {e}; retry shortly"}
        except asyncio.TimeoutError:
            status, payload = 504, {"error": f"the request took longer than {limits.timeout_s} s"}
        except ClientDisconnect:  # gone mid-upload: nobody to answer, nothing to log
            status, payload = 499, {"error": "the client disconnected"}
        except MemoryError:  # beyond decoding (there: 413); the service stays up
            status, payload = 503, {"error": "the service ran out of memory for this request: retry shortly"}
        requests.labels(endpoint, str(status)).inc()
        latency.labels(endpoint).observe(time.perf_counter() - t0)
        return JSONResponse(payload, status_code=status)

    @app.post("/predict", openapi_extra=IMAGE_REQUEST, responses={200: PREDICT_OK, **ERROR_RESPONSES})
    async def predict(request: Request):
        async def work():
            data, opts = await read_image(request)
            k = top_k(opts, request.query_params)
            x, _ = await decode(data)
            logits = await batcher.submit(x)
            return {"top": softmax_top(logits, names, k), "model": name}
        return await guarded("predict", work, request)

    @app.post("/explain", openapi_extra=IMAGE_REQUEST, responses={200: EXPLAIN_OK, 501: ERROR, **ERROR_RESPONSES})
    async def explain(request: Request):
        async def work():
            if not predictor.explains:
                raise HTTPError(501, f"explanations need the attention maps of a ViT run by PyTorch "
                                     f"(this is a {predictor.backend} {getattr(c, 'arch', 'model')})")
            data, opts = await read_image(request)
            k = top_k(opts, request.query_params)
            x, shown = await decode(data)
            maps = await batcher.run_exclusive(explanations, predictor.model, x)
            logits = await batcher.submit(x)
            return {"top": softmax_top(logits, names, k), "model": name, "class": names[maps["class_index"]],
                    "overlay_png": base64.b64encode(overlay_png(shown, maps["rollout"][-1])).decode(),  # the final rollout
                    "image_png": base64.b64encode(_plain_png(shown)).decode(), **maps}  # the model's crop, for the page
        return await guarded("explain", work, request)

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "waiting": batcher.waiting}

    @app.get("/model", responses=ERROR_RESPONSES)
    async def model_info(request: Request):
        if (refused := denied(request)) is not None:
            return refused
        keys = ("arch", "img_size", "patch_size", "in_chans", "num_classes", "embed_dim", "depth", "num_heads", "classifier",
                "mean", "std", "interpolation", "crop_pct")
        cfg = {k: getattr(c, k) for k in keys if hasattr(c, k)}
        return {"name": name, "backend": predictor.backend, "config": cfg, "classes": names, "explains": predictor.explains,
                "preprocessing": ({"resize": f"aspect ratio kept, at most {limits.max_patches} patches of "
                                             f"{list(c.patch_size)} pixels; packed batches of mixed sizes",
                                   "interpolation": c.interpolation, "mean": list(c.mean), "std": list(c.std)}
                                  if limits.max_patches else
                                  {"resize": "shorter side to img_size / crop_pct", "crop": "centre", "img_size": list(c.img_size),
                                   "crop_pct": c.crop_pct, "interpolation": c.interpolation, "mean": list(c.mean), "std": list(c.std)}),
                "limits": asdict(limits)}

    @app.get("/metrics", response_class=PlainTextResponse, responses=ERROR_RESPONSES)
    async def metrics(request: Request):
        if (refused := denied(request)) is not None:
            return refused
        return PlainTextResponse(generate_latest(registry).decode(), media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=FileResponse)
    async def page():
        return FileResponse(STATIC / "index.html", media_type="text/html")

    served = BodyLimit(app, int(limits.max_upload_mb * 1024 * 1024), int(limits.max_uploads_mb * 1024 * 1024))
    served.limits = limits  # the connection limits `uvicorn_config` serves it with
    return served


def _plain_png(shown: np.ndarray) -> bytes:

    buf = io.BytesIO()
    Image.fromarray(shown).save(buf, format="PNG")
    return buf.getvalue()
