"""The FastAPI app of ``h2o-compress serve``: the OpenAI API (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``) on the `Engine`, plus ``/health`` and ``/metrics``.

Every refusal is an OpenAI error object (``{"error": {"message", "type", "param", "code"}}``) with a one-line
message: 400 for a bad request (an unknown field named, a bad ``h2o`` override with the message the CLI would give,
a prompt that cannot fit the model's window), 404 for another model's name, 429 (with ``Retry-After``) when
``max_queue`` requests are waiting, 500 when the request failed while it ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException

from h2o_compress.config import CompressionConfig, check_usable, parse_budget
from h2o_compress.runtime.batch_requests import BatchResult, prepare
from h2o_compress.serving.engine import Engine, Job, QueueFull
from h2o_compress.serving.protocol import ChatRequest, CompletionRequest, H2OOptions, Reply, Sampling, error_body
from h2o_compress.utils.errors import H2OCompressError, one_line, short

#: OpenAI's limit on stop strings per request.
MAX_STOPS = 4
#: Seconds a client is told to wait when the queue is full (``Retry-After``).
RETRY_AFTER_S = 1
#: Seconds between checks that a client waiting for a whole answer is still connected.
DISCONNECT_POLL_S = 0.5
#: The refusal of a request that comes once the server is shutting down (503).
SHUTTING_DOWN = "the server is shutting down and takes no new requests; retry on another server"
#: What a request still running when the grace period of a shutdown is over gets (503).
CANCELLED = "the server shut down before this request finished (its grace period was over); retry"
#: Seconds between checks, during a shutdown's grace period, that every open request is answered.
DRAIN_POLL_S = 0.05


class ApiError(Exception):
    """A refusal: its HTTP ``status``, one-line ``message``, OpenAI error ``kind``, ``param`` and ``headers``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers, self.code = (
            status, one_line(message), kind, param, headers, code)

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.kind, self.param, self.code), self.status,
                            headers=self.headers)


def request_config(base: CompressionConfig, h2o: H2OOptions | None) -> CompressionConfig:
    """``base`` with a request's ``h2o`` overrides (``budget``, ``kv_bits``, ``policy``), validated as the CLI
    validates its flags (``policy="full"`` alone also sets the budget to 1.0).

    Raises:
        ConfigError: the one-line message of the bad value.
    """
    if h2o is None:
        return base
    changes = {}
    if h2o.budget is not None:
        changes["budget"] = parse_budget(str(h2o.budget))
    if h2o.kv_bits is not None:
        changes.update(kv_bits=h2o.kv_bits, k_bits=None, v_bits=None)
    if h2o.policy is not None:
        changes["policy"] = h2o.policy
        if h2o.policy == "full" and h2o.budget is None:
            changes["budget"] = 1.0
    return check_usable(dataclasses.replace(base, **changes))


def check_sampling(body: Sampling, name: str) -> tuple[str, ...]:
    """Refuse what the engine does not do (``n`` other than 1, ``top_p`` other than 1, more than `MAX_STOPS` or
    empty stop strings, another model's name); returns the stop strings.

    Raises:
        ApiError: naming the field.
    """
    if body.model != name:
        raise ApiError(404, f"model {short(body.model)} is not served here; allowed: {name!r}",
                       param="model", code="model_not_found")
    if body.n not in (None, 1):
        raise ApiError(400, f"n={body.n} is not supported; allowed: 1 (one choice per request)", param="n")
    if body.top_p not in (None, 1):
        raise ApiError(400, f"top_p={body.top_p} is not supported; allowed: 1 (the engine samples from the whole "
                       "distribution: use temperature)", param="top_p")
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stops) > MAX_STOPS or not all(stops):
        raise ApiError(400, f"stop {short(body.stop)} is invalid; allowed: at most {MAX_STOPS} non-empty texts",
                       param="stop")
    return stops


class Server:
    """The state of one app: the engine, the metrics, the server-wide setting and defaults."""

    def __init__(self, engine: Engine, config: CompressionConfig, name: str, max_tokens: int, temperature: float):
        self.engine, self.metrics, self.config, self.name = engine, engine.metrics, config, name
        self.max_tokens, self.temperature = max_tokens, temperature
        self._checked: dict[int, float] = {}  # by id(job): when its client was last seen connected
        self.draining = False  # set by a shutdown: new requests get 503
        self.open = 0  # requests submitted whose answer is not sent whole yet

    async def job(self, body: Sampling, chat: bool) -> Job:
        """The request checked (its fields, its ``h2o`` setting, its prompt tokenized and fitted to the window).

        Raises:
            ApiError: 400 naming what is wrong (404 for another model's name).
        """
        stops = check_sampling(body, self.name)
        try:
            config = request_config(self.config, body.h2o)
        except H2OCompressError as exc:
            raise ApiError(400, str(exc), param="h2o") from None
        item = {"id": "0", **({"messages": [m.model_dump() for m in body.messages]} if chat else
                              {"prompt": self._prompt(body)})}
        item.update({key: value for key, value in (("max_new_tokens", body.max_tokens),
                    ("temperature", body.temperature), ("seed", body.seed)) if value is not None})
        prepared = await asyncio.to_thread(prepare, self.engine.model, self.engine.tokenizer, item,
                                           self.engine.next_index(), False, self.max_tokens, self.temperature, None)
        if isinstance(prepared, BatchResult):
            raise ApiError(400, prepared.error.replace("max_new_tokens", "max_tokens"))
        try:
            check_usable(config, config.capacity(prepared.ids.numel() + prepared.max_new_tokens))
        except H2OCompressError as exc:
            raise ApiError(400, str(exc), param="h2o") from None
        return Job(prepared, config, asyncio.get_running_loop(), stop=stops)

    @staticmethod
    def _prompt(body: CompletionRequest) -> str:
        if isinstance(body.prompt, str):
            return body.prompt
        if len(body.prompt) != 1:
            raise ApiError(400, f"prompt is a list of {len(body.prompt)} texts; allowed: one text per request",
                           param="prompt")
        return body.prompt[0]

    async def answer(self, body: Sampling, request: Request, chat: bool) -> Response:
        """Run one request: queue it, wait for its first event (so that a refusal still has its HTTP status), then
        its whole answer or its stream (503 while the server shuts down)."""
        if self.draining:
            raise ApiError(503, SHUTTING_DOWN, "server_error")
        job = await self.job(body, chat)
        try:
            self.engine.submit(job)
        except QueueFull as exc:
            raise ApiError(429, f"the server is busy: {exc}; retry later", "rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        self.open += 1
        streaming = False
        try:
            streaming, response = await self._respond(job, body, request, chat)
            return response
        finally:
            if not streaming:
                self.open -= 1

    async def _respond(self, job: Job, body: Sampling, request: Request, chat: bool) -> tuple[bool, Response]:
        """Whether the answer is a stream (which then counts itself out of `open` when it ends), and the response."""
        event = await self._next(job, request)
        if event is None:
            return False, Response(status_code=499)
        self._first(job, event)
        reply = Reply(self.name, chat)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return True, EventSourceResponse(self._chunks(job, reply, event, usage))
        texts = []
        while event[0] == "text":
            texts.append(event[1])
            event = await self._next(job, request)
            if event is None:
                return False, Response(status_code=499)
        self._ended(job, event)
        return False, JSONResponse(reply.whole("".join(texts), *event[1:]))

    async def _next(self, job: Job, request: Request) -> tuple | None:
        """The job's next event; ``None`` (the job cancelled, its row freed) if the client went away meanwhile
        (checked every `DISCONNECT_POLL_S` seconds, whether events come or not)."""
        while True:
            if time.monotonic() - self._checked.get(id(job), 0.0) >= DISCONNECT_POLL_S:
                self._checked[id(job)] = time.monotonic()
                if await request.is_disconnected():
                    self._cancel(job)
                    return None
            try:
                return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue

    def _cancel(self, job: Job) -> None:
        self._checked.pop(id(job), None)
        self.engine.cancel(job)
        self.metrics.requests.labels("cancelled").inc()

    def _first(self, job: Job, event: tuple) -> None:
        """Time to first token, at the first event; an error event is raised as its refusal."""
        if event[0] == "error":
            self._ended(job, event)
        self.metrics.ttft.observe(time.perf_counter() - job.arrived)

    def _ended(self, job: Job, event: tuple) -> None:
        """Count a request that ended with ``event`` (``done`` or ``error``, raised as an `ApiError`)."""
        self._checked.pop(id(job), None)
        self.metrics.latency.observe(time.perf_counter() - job.arrived)
        if event[0] == "error":
            self.metrics.requests.labels("error").inc()
            raise ApiError(event[1], event[2], "server_error" if event[1] >= 500 else "invalid_request_error")
        self.metrics.requests.labels(event[1]).inc()

    async def _chunks(self, job: Job, reply: Reply, event: tuple, usage: bool = False):
        """The server-sent events of a streamed answer: a chunk per piece of text, the last chunk with its
        ``finish_reason`` (with ``usage``: then a chunk of the usage), then ``[DONE]`` (an error once streaming: an
        error object). A client that goes away cancels the request (its row is freed)."""
        first, finished = True, False
        try:
            while True:
                if event[0] == "text":
                    yield {"data": json.dumps(reply.chunk(event[1], first=first))}
                    first = False
                else:
                    finished = True
                    try:
                        self._ended(job, event)
                    except ApiError as exc:
                        yield {"data": json.dumps(error_body(exc.message, exc.kind))}
                        return
                    yield {"data": json.dumps(reply.chunk(None, event[1], first=first))}
                    if usage:
                        yield {"data": json.dumps(reply.usage_chunk(*event[2:]))}
                    yield {"data": "[DONE]"}
                    return
                event = await job.events.get()
        finally:
            self.open -= 1
            if not finished:
                self._cancel(job)


def validation_error(exc: RequestValidationError) -> ApiError:
    """The first problem of a request body as a one-line 400 naming the field (an unknown field by its name)."""
    problem = exc.errors()[0]
    tags = ("int", "float", "str", "bool", "list[str]")
    parts = [str(p) for p in problem.get("loc", ()) if p != "body" and str(p) not in tags]
    name = ".".join(parts) or None
    kind = problem.get("type")
    if kind == "extra_forbidden":
        return ApiError(400, f"unknown field {name!r}: this server does not take it", param=name)
    if name is None or kind == "json_invalid":
        return ApiError(400, f"the request body is not a JSON object of the API's fields ({problem.get('msg')})")
    if kind == "missing":
        return ApiError(400, f"field {name!r} is required", param=name)
    return ApiError(400, f"field {name!r}: {problem.get('msg')} (got {short(problem.get('input'))})", param=name)


def create_app(engine: Engine) -> FastAPI:
    """The app serving ``engine`` (started with the app, stopped at its shutdown) with its request's settings
    (trusted: validated when made): the server-wide compression setting ``config`` (a request's ``h2o`` object
    goes over it), the model id ``name`` the API lists and requests name, and the defaults ``max_tokens`` and
    ``temperature`` (0: greedy) of a request without them.
    """
    request = engine.request
    server = Server(engine, request.config, request.name, request.max_tokens, request.temperature)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="h2o-compress", lifespan=lifespan)
    app.state.server = server
    _routes(app, server)
    _error_handlers(app)
    return app


def _routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.answer(body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await server.answer(body, request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": 0,
                                            "owned_by": "h2o-compress"}]}

    @app.get("/health")
    async def health():
        if server.draining:
            raise ApiError(503, SHUTTING_DOWN, "server_error")
        if not server.engine.alive:
            raise ApiError(503, "the engine thread has stopped", "server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.text(), media_type=CONTENT_TYPE_LATEST)


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        return ApiError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def crashed(request, exc: Exception):
        return ApiError(500, f"{type(exc).__name__}: {exc}", "server_error").response()


def run(app: FastAPI, host: str, port: int, log_level: str = "info", grace_period: float = 30.0) -> None:
    """Serve ``app`` with uvicorn until SIGINT or SIGTERM, and return: a stop by SIGTERM ends the command with exit
    code 0.

    On SIGTERM new requests get 503 while the open ones (streamed or not) run on for up to ``grace_period`` seconds;
    what is still open then gets a 503 error (a stream: an error event), and uvicorn shuts down (`Graceful`).
    SIGINT (Ctrl-C) stops as uvicorn does.
    """
    import uvicorn  # deferred: imported by the server alone (the tests run their own uvicorn.Server)

    # after its graceful shutdown uvicorn re-raises the signal under the handler it found: for SIGTERM, this one,
    # which lets the command return (the default handler would end the process with 143)
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level)
        graceful(uvicorn.Server)(config, app.state.server, grace_period).run()
    finally:
        signal.signal(signal.SIGTERM, previous)


def graceful(base: type) -> type:
    """``uvicorn.Server`` (``base``: uvicorn is imported by the server alone) whose SIGTERM drains first: the
    server refuses new requests at once (`Server.draining`) and lets uvicorn shut down (``should_exit``, which also
    ends sse-starlette's streams) once no request is open or the grace period is over, when what is left is
    cancelled (`Engine.cancel_all`)."""

    class Graceful(base):
        def __init__(self, config, server: Server, grace_period: float):
            super().__init__(config)
            self.server, self.grace_period, self.loop = server, grace_period, None

        async def serve(self, sockets=None):
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig, frame):
            if sig != signal.SIGTERM or self.server.draining or self.loop is None:
                if self.server.draining:  # a second signal: no more waiting
                    self.server.engine.cancel_all(CANCELLED)
                super().handle_exit(sig, frame)
                return
            self.server.draining = True
            self.loop.call_soon_threadsafe(self.loop.create_task, self._drain(sig, frame))

        async def _drain(self, sig, frame):
            deadline = time.monotonic() + self.grace_period
            while self.server.open > 0 and time.monotonic() < deadline and not self.should_exit:
                await asyncio.sleep(DRAIN_POLL_S)
            if self.server.open > 0:
                self.server.engine.cancel_all(CANCELLED)
                await asyncio.sleep(DRAIN_POLL_S)  # the error events reach their handlers before the streams end
            super().handle_exit(sig, frame)

    return Graceful
