"""`hippo serve`: an OpenAI-compatible chat-completions server on the batch engine (`hippo.service`).

Endpoints: `POST /v1/chat/completions` (messages with `text` and `video_url` parts, as vLLM takes
them; `stream` gives server-sent events in OpenAI's chunk format, usage in the last chunk), `GET
/v1/models`, `GET /health`, `GET /metrics` (Prometheus text). Every answer is the target's own, as
`hippo generate` gives it; hippo's extras (MAT, the plan, the token ids) ride in a `hippo` field.

Every OpenAI field is honoured, refused by name or (carrying no semantics) ignored: docs/serving-api.md.
Errors are OpenAI's JSON, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad request
(malformed JSON, a bad or unsupported field, a missing video or a path no file can have, a prompt
longer than the context, video options past the context or memory, another Host than
`--allowed-hosts`), 401 without the `--api-key`, 403 for a video outside `--media-dir`, 404 for
another model, 429 with Retry-After when the queue is full, 503 when a context cannot fit in memory
or the server is stopping. SIGTERM stops accepting, lets the
requests in flight finish for up to `--drain` seconds and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import secrets
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlparse

from hippo.errors import ConfigError, HippoError, InputError, MemoryBudgetError, one_line
from hippo.service import Overloaded, Request, Service, check_media

try:
    import prometheus_client as prom
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from pydantic import BaseModel, ConfigDict, Field
    from starlette.exceptions import HTTPException
except ImportError as exc:  # pragma: no cover - the serve extra is missing
    raise ConfigError(
        f"hippo serve needs FastAPI, uvicorn and prometheus_client ({exc.name} is missing): "
        "pip install 'hippo[serve]'"
    ) from None


# ---- the request, as OpenAI's chat completions take it --------------------------------------------
#: fields that change nothing in an answer: accepted and ignored
IGNORED = ("user", "store", "metadata", "service_tier")

#: OpenAI fields hippo serve does not support, each with the values that mean "not used" (accepted)
REFUSED: dict[str, tuple] = {
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "verbosity": (None,),
    "prompt_cache_key": (None,),
    "safety_identifier": (None,),
    "best_of": (None, 1),
    "echo": (None, False),
    "min_p": (None, 0, 0.0),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # `unsupported` refuses what is not declared here

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1)
    repetition_penalty: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = Field(default=None)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # the video's frames (hippo's extras, as `hippo generate` takes them; extra_body in the client)
    frames: int | None = Field(default=None, ge=1)
    fps: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    max_pixels: int | None = Field(default=None, ge=1)


def unsupported(body: ChatRequest) -> None:
    """BadRequest naming the first field that hippo serve would otherwise silently drop."""
    for name, value in (body.model_extra or {}).items():
        if name in IGNORED:
            continue
        if name not in REFUSED:
            raise BadRequest(400, f"{name}: unknown field; hippo serve does not take it", name)
        if value not in REFUSED[name]:
            raise BadRequest(
                400,
                f"{name}: not supported by hippo serve (it answers with the target's own tokens only); "
                "leave it out",
                name,
            )
    if body.top_logprobs is not None and not body.logprobs:
        raise BadRequest(400, "top_logprobs: set logprobs to true to use it", "top_logprobs")
    if body.stream_options is not None and not body.stream:
        raise BadRequest(400, "stream_options: only allowed with stream: true", "stream_options")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > 4 or not all(stops):
        raise BadRequest(400, "stop: at most 4 non-empty strings", "stop")


class BadRequest(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    kind: str = "invalid_request_error",
    headers: dict | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def parse_messages(
    messages: list[dict[str, Any]], media_dir: str
) -> tuple[str, list[tuple[str, str | None]], str | None]:
    """(the video's path, the (question, answer) turns, the system turn or None): system and developer
    messages (text) come first and are joined into the system turn; the first user message holds one
    video_url part; user and assistant messages alternate after it, ending with a user message."""
    video, turns, system = None, [], []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(400, f"{where} must be an object with role and content", where)
        role, content = m.get("role"), m.get("content")
        if role in ("system", "developer"):
            if turns:
                raise BadRequest(
                    400,
                    f"{where} is a {role} message after the conversation started; put system and "
                    "developer messages first",
                    where,
                )
            system.append(_text_only(content, where))
            continue
        if role not in ("user", "assistant"):
            raise BadRequest(
                400,
                f"{where}.role is {role!r}; hippo serve takes system, developer, user and assistant messages",
                f"{where}.role",
            )
        expected = "user" if not turns or turns[-1][1] is not None else "assistant"
        if role != expected:
            raise BadRequest(
                400,
                f"{where} is a {role} message but a {expected} message must come here; "
                "user and assistant messages alternate, starting and ending with user",
                where,
            )
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list):
            raise BadRequest(400, f"{where}.content must be a string or a list of parts", f"{where}.content")
        texts = []
        for j, part in enumerate(parts):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind == "video_url" and role == "user" and not turns and video is None:
                video = _video_path(part.get("video_url"), f"{where}.content[{j}].video_url", media_dir)
            elif kind == "video_url":
                raise BadRequest(
                    400,
                    f"{where}.content[{j}]: only one video, in the first user message, is supported",
                    f"{where}.content[{j}]",
                )
            elif kind == "text":
                raise BadRequest(
                    400, f"{where}.content[{j}].text must be a string", f"{where}.content[{j}].text"
                )
            else:
                raise BadRequest(
                    400,
                    f"{where}.content[{j}] has type {kind!r}; supported parts are 'text' and 'video_url'",
                    f"{where}.content[{j}].type",
                )
        text = "".join(texts)
        if role == "user":
            turns.append((text, None))
        else:
            turns[-1] = (turns[-1][0], text)
    if video is None:
        raise BadRequest(
            400,
            "no video: the first user message needs a video_url part "
            '({"type": "video_url", "video_url": {"url": "file:///..."}})',
            "messages[0].content",
        )
    if turns[-1][1] is not None:
        raise BadRequest(
            400, "the last message must be the user's question", f"messages[{len(messages) - 1}]"
        )
    return video, turns, "\n".join(system) if system else None


def _text_only(content: Any, where: str) -> str:
    """A system or developer message's text (a string, or text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise BadRequest(400, f"{where}.content must be text (a string or text parts)", f"{where}.content")


def _video_path(value: Any, where: str, media_dir: str) -> str:
    url = value.get("url") if isinstance(value, dict) else None
    if not isinstance(url, str):
        raise BadRequest(
            400, f"{where}.url is missing; give a file:// URL under the media directory", f"{where}.url"
        )
    parsed = urlparse(url)
    if parsed.scheme != "file":
        raise BadRequest(
            403 if parsed.scheme in ("http", "https") else 400,
            f"{where}.url {url!r} is not a file:// URL; hippo serve reads local files under "
            "--media-dir and fetches no URL",
            f"{where}.url",
        )
    if parsed.netloc not in ("", "localhost"):  # file://clip.mp4 names a host, not a file
        raise BadRequest(
            400,
            f"{where}.url {url!r} names the host {parsed.netloc!r}; give an absolute path after "
            "file:// (file:///path/to/clip.mp4)",
            f"{where}.url",
        )
    path = unquote(parsed.path)
    try:
        real = check_media(path, media_dir)
        is_file = Path(real).is_file()
    except PermissionError as exc:
        raise BadRequest(403, str(exc), f"{where}.url", "permission_error") from None
    except (InputError, OSError, ValueError) as exc:  # a NUL byte, a name over the OS's limit
        raise BadRequest(400, f"{where}.url: {one_line(exc)}", f"{where}.url") from None
    if not is_file:
        raise BadRequest(400, f"{where}.url: no such video file {path!r}", f"{where}.url")
    return real


def generation_of(body: ChatRequest, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """`generate`'s settings: `defaults` (the server's), overridden by the request's. Temperature 0
    decodes greedily; a temperature > 0, top_p or top_k samples."""
    gen = dict(defaults or {"do_sample": False})
    max_new = body.max_completion_tokens or body.max_tokens
    if max_new is not None:
        gen["max_new_tokens"] = max_new
    if body.temperature == 0:
        gen["do_sample"] = False
    elif body.temperature is not None or body.top_p is not None or body.top_k is not None:
        gen["do_sample"] = True
        for key in ("temperature", "top_p", "top_k"):
            if getattr(body, key) is not None:
                gen[key] = getattr(body, key)
    if not gen.get("do_sample"):
        for key in ("temperature", "top_p", "top_k"):
            gen.pop(key, None)
    if body.repetition_penalty is not None:
        gen["repetition_penalty"] = body.repetition_penalty
    if body.seed is not None:
        gen["seed"] = body.seed
    return gen


# ---- metrics ----------------------------------------------------------------------------------------
class Metrics:
    def __init__(self, service: Service):
        self.registry = r = prom.CollectorRegistry()
        self.requests = prom.Counter("hippo_requests", "requests by outcome", ["status"], registry=r)
        self.tokens = prom.Counter("hippo_generated_tokens", "tokens generated", registry=r)
        self.prompt_tokens = prom.Counter("hippo_prompt_tokens", "prompt tokens", registry=r)
        self.ttft = prom.Histogram(
            "hippo_time_to_first_token_seconds",
            "time to first token",
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, math.inf),
        )
        self.latency = prom.Histogram(
            "hippo_request_latency_seconds",
            "request latency",
            registry=r,
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, math.inf),
        )
        self.mat = prom.Gauge("hippo_mean_accepted_tokens", "MAT of the last finished request", registry=r)
        self.acceptance = prom.Gauge(
            "hippo_acceptance_rate", "draft acceptance of the last request", registry=r
        )
        queue = prom.Gauge("hippo_queue_depth", "requests waiting", registry=r)
        queue.set_function(lambda: service.queue_depth)
        live = prom.Gauge("hippo_batch_size", "rows decoding now", registry=r)
        live.set_function(lambda: service.batch_size)
        cache = prom.Gauge("hippo_video_cache_bytes", "bytes of prepared video contexts", registry=r)
        cache.set_function(lambda: service.contexts.nbytes)

    def finished(self, info: dict[str, Any], first_token: float | None) -> None:
        self.requests.labels("ok").inc()
        self.tokens.inc(info["completion_tokens"])
        self.prompt_tokens.inc(info["prompt_tokens"])
        self.latency.observe(info["seconds"])
        if first_token is not None:
            self.ttft.observe(first_token)
        stats = info["stats"]
        if stats.rounds:
            self.mat.set(stats.mat)
            self.acceptance.set(stats.acceptance_rate)


# ---- the app ------------------------------------------------------------------------------------------
def create_app(
    service: Service,
    model: str,
    media_dir: str,
    drain: float = 30.0,
    generation: dict[str, Any] | None = None,  # the defaults of a request's settings
    video: dict[str, Any] | None = None,  # the defaults of its frames, fps, max_pixels
    api_key: str | None = None,  # /v1 asks for `Authorization: Bearer <api_key>`
    allowed_hosts: Sequence[str] | None = None,  # Host headers served (None: any)
) -> FastAPI:
    """The FastAPI app serving `service` under the model name `model`."""
    video_defaults = video
    metrics = Metrics(service)
    started = int(time.time())
    tokenizer = service.tokenizer

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(service.close, drain)  # uvicorn has drained the connections by now

    app = FastAPI(title="hippo", lifespan=lifespan)
    app.state.service, app.state.metrics = service, metrics
    app.add_middleware(Guard, api_key=api_key, allowed_hosts=allowed_hosts)

    @app.exception_handler(HTTPException)
    async def _http_error(request: HTTPRequest, exc: HTTPException) -> JSONResponse:
        """FastAPI's own refusals (a body it cannot parse, a route or method it has not) in OpenAI's JSON."""
        if exc.status_code < 500:
            metrics.requests.labels("bad_request").inc()
        return error_response(exc.status_code, str(exc.detail), None, headers=getattr(exc, "headers", None))

    @app.exception_handler(RecursionError)
    @app.exception_handler(ValueError)
    @app.exception_handler(TypeError)
    @app.exception_handler(LookupError)
    @app.exception_handler(OSError)
    @app.exception_handler(HippoError)
    async def _failed_request(request: HTTPRequest, exc: Exception) -> JSONResponse:
        """Whatever one request's own input made fail (a value no check foresaw) is a 400 naming it;
        the connection and the requests after it go on."""
        metrics.requests.labels("bad_request").inc()
        if isinstance(exc, MemoryBudgetError):
            return error_response(503, one_line(exc), None, "service_unavailable", {"Retry-After": "5"})
        return error_response(400, f"the request cannot be answered: {one_line(exc)}")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = [x for x in first.get("loc", ()) if x != "body"]
        param = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".") or None
        if first.get("type") == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {first.get('msg')}")
        metrics.requests.labels("bad_request").inc()
        return error_response(400, f"{param or 'body'}: {first.get('msg')}", param)

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok" if service.thread.is_alive() and service.accepting else "stopping"}

    @app.get("/v1/models")
    def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": model, "object": "model", "owned_by": "hippo", "created": started}],
        }

    @app.get("/metrics")
    def prometheus() -> PlainTextResponse:
        return PlainTextResponse(prom.generate_latest(metrics.registry), media_type=prom.CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: HTTPRequest):
        try:
            if body.model != model:
                raise BadRequest(
                    404,
                    f"model {body.model!r} is not served here; this server serves {model!r}",
                    "model",
                    "not_found_error",
                )
            unsupported(body)
            path, turns, system = parse_messages(body.messages, media_dir)
            stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
            options = {
                k: getattr(body, k) for k in ("frames", "fps", "max_pixels") if getattr(body, k) is not None
            }
            defaults = dict(video_defaults or {})
            if options.keys() & {"frames", "fps"}:  # one of them: the request's replaces the server's
                defaults.pop("frames", None), defaults.pop("fps", None)
            options = {**defaults, **options}
            top = (body.top_logprobs or 0) if body.logprobs else None
            request = Request(path, turns, options, generation_of(body, generation), stop, system, top)
        except BadRequest as exc:
            metrics.requests.labels("bad_request").inc()
            return error_response(exc.status, exc.message, exc.param, exc.kind)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        try:
            ticket = service.submit(request, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        except Overloaded as exc:
            metrics.requests.labels("overloaded").inc()
            return error_response(429, str(exc), None, "rate_limit_error", {"Retry-After": "1"})
        except InputError as exc:  # stopping
            return error_response(503, str(exc), None, "service_unavailable")
        first = await events.get()
        if first[0] == "error":
            return _failed(first[1], metrics)
        reply = Reply(model, tokenizer)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(
                _stream(reply, events, ticket, service, metrics, usage), media_type="text/event-stream"
            )
        collect = asyncio.ensure_future(_collect(events))
        gone = asyncio.ensure_future(_disconnected(http))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client went away (or this task was cancelled): free its row
                collect.cancel()
                service.cancel(ticket)
                metrics.requests.labels("disconnected").inc()
        if not collect.done():
            return error_response(499, "the client closed the connection")  # nobody reads it
        text, info, t_first, logprobs = collect.result()
        if isinstance(info, BaseException):
            return _failed(info, metrics)
        metrics.finished(info, t_first)
        return JSONResponse(reply.whole(text, info, logprobs if body.logprobs else None))

    return app


def _failed(error: BaseException, metrics: Metrics) -> JSONResponse:
    if isinstance(error, MemoryBudgetError):
        metrics.requests.labels("overloaded").inc()
        return error_response(503, one_line(error), None, "service_unavailable", {"Retry-After": "5"})
    metrics.requests.labels("bad_request").inc()
    return error_response(400, one_line(error), getattr(error, "param", None))


async def _collect(events: asyncio.Queue) -> tuple[str, Any, float | None, list]:
    text, logprobs, t_first, t0 = [], [], None, time.perf_counter()
    while True:
        ev = await events.get()
        if ev[0] == "delta":
            if t_first is None:
                t_first = time.perf_counter() - t0
            text.append(ev[1])
            logprobs += ev[3]
        elif ev[0] == "end":
            return "".join(text), ev[1], t_first, logprobs
        elif ev[0] == "error":
            return "", ev[1], t_first, logprobs


async def _disconnected(http: HTTPRequest) -> None:
    """Returns once the client has closed the connection (the body was read already)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


class Guard:
    """ASGI middleware: the Host header must be one of `allowed_hosts` (400 otherwise; `*` and
    `*.domain` patterns, as Starlette's TrustedHostMiddleware), and /v1 must carry
    `Authorization: Bearer <api_key>` when there is one (401 otherwise, as vLLM's --api-key)."""

    def __init__(self, app: Any, api_key: str | None = None, allowed_hosts: Sequence[str] | None = None):
        self.app, self.api_key = app, api_key
        self.hosts = None if not allowed_hosts or "*" in allowed_hosts else list(allowed_hosts)

    def _host_ok(self, host: str) -> bool:
        host = host.rsplit(":", 1)[0] if not host.endswith("]") else host  # drop the port
        host = host.strip("[]").lower()
        return any(
            host == h or (h.startswith("*.") and host.endswith(h[1:]))
            for h in (x.lower() for x in self.hosts)
        )

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            response = None
            if self.hosts is not None and not self._host_ok(headers.get("host", "")):
                response = error_response(400, f"invalid Host header {headers.get('host', '')!r}", None)
            elif self.api_key is not None and scope["path"].startswith("/v1"):
                given = headers.get("authorization", "")
                if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                    response = error_response(
                        401,
                        "missing or wrong API key: send Authorization: Bearer <the server's --api-key>",
                        None,
                        "authentication_error",
                        {"WWW-Authenticate": "Bearer"},
                    )
            if response is not None:
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Reply:
    """OpenAI's response objects for one request."""

    def __init__(self, model: str, tokenizer: Any = None):
        self.id, self.model, self.created = f"chatcmpl-{uuid.uuid4().hex}", model, int(time.time())
        self.tokenizer = tokenizer

    def logprobs(self, pairs: Sequence[tuple[int, Any]]) -> dict:
        """OpenAI's `logprobs` object: each token's text, log-prob and bytes, and its top alternatives."""

        def one(token: int, lp: float | None) -> dict:
            text = self.tokenizer.decode([token])
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

        content = []
        for token, entry in pairs:
            lp, top = entry if entry is not None else (None, [])
            content.append({**one(token, lp), "top_logprobs": [one(i, v) for i, v in top]})
        return {"content": content, "refusal": None}

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @staticmethod
    def usage(info: dict) -> dict:
        p, c = info["prompt_tokens"], info["completion_tokens"]
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    @staticmethod
    def extras(info: dict) -> dict:
        s = info["stats"]
        return {
            "token_ids": info["token_ids"],
            "mat": s.mat if s.rounds else None,
            "acceptance_rate": s.acceptance_rate if s.rounds else None,
            "plan": s.plan,
            "visual_tokens": s.visual_tokens,
            "kept_visual_tokens": s.kept_visual_tokens,
        }

    def whole(self, text: str, info: dict, logprobs: list | None = None) -> dict:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None if logprobs is None else self.logprobs(logprobs),
            "finish_reason": info["finish_reason"],
        }
        return {
            **self._base("chat.completion"),
            "choices": [choice],
            "usage": self.usage(info),
            "hippo": self.extras(info),
        }

    def chunk(
        self,
        delta: dict,
        finish: str | None = None,
        info: dict | None = None,
        logprobs: dict | None = None,
        choices: bool = True,
    ) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        out = {**self._base("chat.completion.chunk"), "choices": [choice] if choices else []}
        if info is not None:
            out["usage"], out["hippo"] = self.usage(info), self.extras(info)
        return f"data: {json.dumps(out, default=str)}\n\n"


async def _stream(
    reply: Reply,
    events: asyncio.Queue,
    ticket: Any,
    service: Service,
    metrics: Metrics,
    include_usage: bool = False,  # stream_options.include_usage: a last chunk of usage, no choices
):
    """The answer as server-sent events; a client that goes away cancels its row. The usage (and
    hippo's extras) ride in the chunk with the finish reason too."""
    t0, t_first, done = time.perf_counter(), None, False
    wants_logprobs = ticket.request.logprobs is not None
    try:
        yield reply.chunk({"role": "assistant", "content": ""})
        while True:
            ev = await events.get()
            if ev[0] == "delta":
                if t_first is None:
                    t_first = time.perf_counter() - t0
                if ev[1] or (wants_logprobs and ev[3]):
                    lp = reply.logprobs(ev[3]) if wants_logprobs else None
                    yield reply.chunk({"content": ev[1]}, logprobs=lp)
            elif ev[0] == "end":
                metrics.finished(ev[1], t_first)
                yield reply.chunk({}, ev[1]["finish_reason"], ev[1])
                if include_usage:
                    yield reply.chunk({}, info=ev[1], choices=False)
                break
            else:
                body = {
                    "error": {"message": one_line(ev[1]), "type": "server_error", "param": None, "code": 500}
                }
                yield f"data: {json.dumps(body)}\n\n"
                break
        done = True
        yield "data: [DONE]\n\n"
    finally:
        if not done:
            metrics.requests.labels("disconnected").inc()
            service.cancel(ticket)


# ---- the command ------------------------------------------------------------------------------------------
def check_serve_options(args: argparse.Namespace) -> None:
    if not Path(args.media_dir).is_dir():
        raise ConfigError(
            f"--media-dir {args.media_dir!r} is not a directory; create it and put the videos there"
        )
    if args.max_batch < 1 or args.max_queue < 0 or not args.cache_gb > 0 or args.drain < 0:
        raise ConfigError("--max-batch must be >= 1, --max-queue >= 0, --cache-gb > 0 and --drain >= 0")
    if args.prefill_chunk < 0:
        raise ConfigError(
            f"--prefill-chunk must be >= 0 tokens (0: a prefill in one piece), got {args.prefill_chunk}"
        )
    if not 0 <= args.prefill_seconds < math.inf:
        raise ConfigError(
            f"--prefill-seconds must be >= 0 seconds (0: one step a round), got {args.prefill_seconds}"
        )


def access_options(args: argparse.Namespace) -> tuple[str | None, list[str] | None]:
    """(the API key: --api-key, else $HIPPO_API_KEY; the allowed Host names: --allowed-hosts)."""
    key = getattr(args, "api_key", None) or os.environ.get("HIPPO_API_KEY") or None
    hosts = getattr(args, "allowed_hosts", None)
    names = [h.strip() for h in hosts.split(",") if h.strip()] if hosts else None
    if hosts is not None and not names:
        raise ConfigError("--allowed-hosts needs host names, comma-separated (or '*' for any)")
    return key, names


def build_app(args: argparse.Namespace) -> tuple[FastAPI, Any, str]:
    """(the app, its pipeline, the served model name) for `hippo serve`'s arguments: one pipeline and
    one `Service` loop behind the app (in this process, or in one Ray Serve replica)."""
    from hippo.builder import PipelineBuilder
    from hippo.cli.video_commands import generation_kwargs, pipeline_config, prepare, quiet_transformers
    from hippo.registry import lookup

    check_serve_options(args)
    cfg = pipeline_config(args)
    builder = PipelineBuilder.from_config(cfg)  # names and options are validated here
    defaults = generation_kwargs(args)
    if args.seed is not None:
        defaults["seed"] = args.seed
    video = {k: getattr(args, k) for k in ("frames", "fps", "max_pixels") if getattr(args, k) is not None}
    with quiet_transformers(args.debug, False):
        ready = prepare(args, cfg, lookup("schedulers", cfg.scheduler.name).needs_draft)
        pipe = builder.build()
    try:
        if not pipe.can_batch():
            raise ConfigError(
                f"scheduler {cfg.scheduler.name!r} with drafter {cfg.drafter.name!r} has no batched form, "
                "and serve decodes its requests together: use a schedule with one (auto, serial, pearl, "
                "hippo, autoregressive) and the 'chain' drafter (token trees decode one request at a time)"
            )
        name = args.served_model_name or Path(cfg.target).name
        service = Service(
            pipe,
            ready["tokenizer"],
            max_batch=args.max_batch,
            max_queue=args.max_queue,
            cache_bytes=int(args.cache_gb * (1 << 30)),
            prefill_rows=args.prefill_chunk or None,
            prefill_seconds=args.prefill_seconds,
        )
        app = create_app(service, name, args.media_dir, args.drain, defaults, video, *access_options(args))
        return app, pipe, name
    except BaseException:
        pipe.close()
        raise


def cmd_serve(args: argparse.Namespace) -> int:
    if args.ray is not None:
        from hippo.cli.serve_ray import serve_on_ray

        return serve_on_ray(args)

    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn's server, but a drained shutdown on SIGTERM or SIGINT exits 0 (uvicorn re-raises
        the signal after its graceful shutdown, which kills the process with it)."""

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                self._captured_signals.clear()

    app, pipe, name = build_app(args)
    try:
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="warning",
            timeout_graceful_shutdown=math.ceil(args.drain),
        )
        print(f"hippo serve: {name} on http://{args.host}:{args.port}/v1", flush=True)
        _Server(config).run()
    finally:
        pipe.close()
    return 0
