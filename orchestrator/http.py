"""The OpenAI-compatible HTTP API: a thin adapter over the engine, beside gRPC, in its event loop.

POST /v1/completions and /v1/chat/completions (JSON, or server-sent events with `stream`),
GET /v1/models, GET /health, GET /metrics (Prometheus). Tandem's own knobs ride in the body
as extra fields, as vLLM does: `top_k`, `num_speculative_tokens`, `proposer`, `ignore_eos`.
Errors use OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import prometheus_client
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from orchestrator.domain import (
    Delta,
    Event,
    FinishReason,
    GenerationRequest,
    Summary,
    TokenLogprob,
    Usage,
)
from orchestrator.engine import Engine
from tandem.config import MAX_TOP_LOGPROBS
from tandem.errors import (
    DeadlineExceeded,
    InvalidRequest,
    ResourceExhausted,
    TandemError,
    Unavailable,
)
from tandem.grammar import GrammarSpec
from tandem.security import BearerTokenAuth, Reloading

# What a request may set. Unknown fields are refused (400, naming them): a typo such as
# "max_token" silently meaning the default would be worse.
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream",
                 "stream_options", "user", "logprobs", "top_k", "num_speculative_tokens",
                 "proposer", "ignore_eos", "frequency_penalty", "presence_penalty"}
# Structured output: OpenAI's response_format, and vLLM's guided_* fields (one of them).
GRAMMAR_FIELDS = {"response_format", "guided_json", "guided_regex", "guided_grammar"}
COMPLETION_FIELDS = COMMON_FIELDS | GRAMMAR_FIELDS | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | GRAMMAR_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                                                "tool_choice"}
# OpenAI's default; the gRPC API's default is greedy.
DEFAULT_TEMPERATURE = 1.0


class HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind,
                                       "param": self.param, "code": self.code}},
                            status_code=self.status)


def _invalid(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, message, "invalid_request_error", param)


def from_domain_error(exc: TandemError) -> HttpError:
    """The one mapping of the engine's errors to HTTP statuses (gRPC's is tandem.server's)."""
    if isinstance(exc, InvalidRequest):
        # A grammar's errors start with the field the request named it in.
        named = next((f for f in GRAMMAR_FIELDS if str(exc).startswith(f)), None)
        return _invalid(str(exc), named)
    if isinstance(exc, ResourceExhausted):
        return HttpError(429, str(exc), "rate_limit_error", code="resource_exhausted")
    if isinstance(exc, DeadlineExceeded):
        return HttpError(504, str(exc), "timeout_error", code="deadline_exceeded")
    if isinstance(exc, Unavailable):
        return HttpError(503, str(exc), "service_unavailable", code="unavailable")
    return HttpError(500, str(exc), "internal_error")


# --- request parsing --------------------------------------------------------------------------


def _number(body: dict[str, Any], field: str, kind: type, default: Any, low: float,
            high: float) -> Any:
    value = body.get(field)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (kind is int and not float(value).is_integer()):
        raise _invalid(f"{field} must be {'an integer' if kind is int else 'a number'}, got "
                       f"{json.dumps(value)}", field)
    if not (math.isfinite(value) and low <= value <= high):
        raise _invalid(f"{field} must be in [{low:g}, {high:g}], got {value}", field)
    return kind(value)


def _common(body: dict[str, Any], allowed: set[str], max_tokens_fields: tuple[str, ...]
            ) -> dict[str, Any]:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise _invalid(f"unsupported field(s): {', '.join(unknown)}", unknown[0])
    if body.get("best_of", 1) != 1:
        raise _invalid("best_of is not supported (n is: every choice is returned)", "best_of")
    if body.get("echo") or body.get("suffix"):
        field = next(f for f in ("echo", "suffix") if body.get(f))
        raise _invalid(f"{field} is not supported", field)
    if body.get("tools") or body.get("tool_choice"):
        raise _invalid("tools are not supported (response_format with a json_schema is)", "tools")
    for penalty in ("frequency_penalty", "presence_penalty"):
        if body.get(penalty):  # they change the distribution: Tandem samples the target's own
            raise _invalid(f"{penalty} is not supported (only 0)", penalty)
    max_tokens = 0
    for field in max_tokens_fields:
        max_tokens = _number(body, field, int, 0, 1, 2**32 - 1) or max_tokens
    stop = body.get("stop")
    stops: tuple[str, ...] = ()
    if isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    elif stop is not None:
        raise _invalid("stop must be a string or a list of strings", "stop")
    proposer = body.get("proposer") or ""
    if not isinstance(proposer, str):
        raise _invalid("proposer must be a string", "proposer")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _invalid("ignore_eos must be true or false", "ignore_eos")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _invalid("stream_options must be an object", "stream_options")
    return {
        "max_new_tokens": max_tokens,
        "temperature": _number(body, "temperature", float, DEFAULT_TEMPERATURE, 0, math.inf),
        "top_p": _number(body, "top_p", float, 1.0, 0, 1) or 1.0,
        "top_k": _number(body, "top_k", int, 0, 0, 2**32 - 1),
        "seed": _number(body, "seed", int, None, 0, 2**64 - 1),
        "num_speculative_tokens": _number(body, "num_speculative_tokens", int, None, 0, 2**32 - 1),
        "stop_strings": stops, "ignore_eos": ignore_eos, "proposer": proposer,
        "n": _number(body, "n", int, 1, 1, 2**31),
        "grammar": _grammar(body),
    }


def _grammar(body: dict[str, Any]) -> GrammarSpec | None:
    """The grammar a request names: response_format (json_schema, json_object; text is none),
    or one of vLLM's guided_json, guided_regex and guided_grammar (Lark)."""
    named = [f for f in ("response_format", "guided_json", "guided_regex", "guided_grammar") if body.get(f)]
    if len(named) > 1:
        raise _invalid(f"set one of {', '.join(named)}: each names a grammar", named[1])
    if not named:
        return None
    field, value = named[0], body[named[0]]
    if field == "guided_json":
        text = value if isinstance(value, str) else json.dumps(value)
        return GrammarSpec("json_schema", text, label=field)
    if field in ("guided_regex", "guided_grammar"):
        if not isinstance(value, str):
            raise _invalid(f"{field} must be a string", field)
        return GrammarSpec("regex" if field == "guided_regex" else "lark", value, label=field)
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", label=field)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
            raise _invalid("response_format.json_schema.schema must be a JSON schema (an object)",
                           "response_format")
        return GrammarSpec("json_schema", json.dumps(spec["schema"]), label="response_format.json_schema.schema")
    raise _invalid(f"response_format.type must be text, json_object or json_schema, got {json.dumps(kind)}",
                   "response_format")


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many top tokens each token's log-probability comes with (None: none asked for):
    completions' logprobs (an integer), chat's logprobs (true) with top_logprobs."""
    if not chat:
        return _number(body, "logprobs", int, None, 0, MAX_TOP_LOGPROBS)  # type: ignore[no-any-return]
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise _invalid("logprobs must be true or false", "logprobs")
    top = _number(body, "top_logprobs", int, None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise _invalid("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


def completion_request(body: dict[str, Any]) -> GenerationRequest:
    fields = _common(body, COMPLETION_FIELDS, ("max_tokens",))
    fields["logprobs"] = _logprobs(body, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return GenerationRequest(prompt=prompt, **fields)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in prompt):
        return GenerationRequest(prompt_token_ids=tuple(prompt), **fields)
    raise _invalid("prompt must be a non-empty string or list of token ids (one prompt)", "prompt")


def chat_request(body: dict[str, Any], template: Callable[[list[dict[str, Any]]], str]
                 ) -> GenerationRequest:
    fields = _common(body, CHAT_FIELDS, ("max_tokens", "max_completion_tokens"))
    fields["logprobs"] = _logprobs(body, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages):
        raise _invalid("messages must be a non-empty list of {role, content} objects with text "
                       "content", "messages")
    try:
        prompt = template(messages)
    except Exception as exc:  # noqa: BLE001 - the model's own Jinja template decides what it accepts
        raise _invalid(f"the model's chat template refused these messages: {exc}",
                       "messages") from None
    return GenerationRequest(prompt=prompt, **fields)


# --- responses --------------------------------------------------------------------------------


def finish_reason(reason: FinishReason) -> str:
    """OpenAI's reasons; a grammar that allows no further token says so in its own."""
    if reason is FinishReason.GRAMMAR_DEAD_END:
        return str(reason.value)
    return "length" if reason is FinishReason.LENGTH else "stop"


def usage_json(*choices: Usage) -> dict[str, Any]:
    """A request's usage, over its choices: the prompt (and what its prefill took from the
    prefix caches, the same for every choice) once, the rest added up."""
    def total(field: str) -> Any:
        return sum(getattr(u, field) for u in choices)

    usage = choices[0]
    completion = total("completion_tokens")
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": completion,
            "total_tokens": usage.prompt_tokens + completion,
            # OpenAI's: the prompt tokens the target's prefix cache served (a session rebuilt after
            # a replica lost it may reuse generated tokens too: capped at the prompt).
            "prompt_tokens_details": {"cached_tokens": min(usage.target_cached_tokens, usage.prompt_tokens)},
            "draft_cached_tokens": usage.draft_cached_tokens,
            # Tandem's own: how much speculation saved, per request.
            "drafted_tokens": total("drafted_tokens"), "accepted_tokens": total("accepted_tokens"),
            "suffix_drafted_tokens": total("suffix_drafted_tokens"),
            "suffix_accepted_tokens": total("suffix_accepted_tokens"),
            "target_forward_passes": total("target_forward_passes"), "proposer": usage.proposer,
            "draft_wait_ms": round(total("draft_wait_ms"), 3), "draft_cache_hits": total("draft_cache_hits"),
            "draft_cache_misses": total("draft_cache_misses")}


@dataclass(frozen=True)
class Shape:
    """How one endpoint writes its objects: completions and chat differ only here."""

    object: str
    chunk_object: str
    id_prefix: str
    chat: bool

    def choice(self, text: str, reason: str | None, *, chunk: bool, first: bool = False, index: int = 0,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if not self.chat:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        if chunk:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else \
                ({"content": text} if text else {})
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": reason}

    def logprobs(self, tokens: Sequence[TokenLogprob], text: Callable[[int], str]) -> dict[str, Any]:
        """Tokens' log-probabilities as the endpoint writes them: chat's `content` list, or
        completions' parallel lists (`text`: a token id's text)."""
        if self.chat:
            def entry(token: int, logprob: float) -> dict[str, Any]:
                return {"token": text(token), "logprob": logprob, "bytes": list(text(token).encode())}
            return {"content": [{**entry(t.token_id, t.logprob),
                                 "top_logprobs": [entry(i, lp) for i, lp in zip(t.top_token_ids, t.top_logprobs,
                                                                                strict=True)]}
                                for t in tokens]}
        return {"tokens": [text(t.token_id) for t in tokens], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{text(i): lp for i, lp in zip(t.top_token_ids, t.top_logprobs, strict=True)}
                                 for t in tokens]}


COMPLETIONS = Shape("text_completion", "text_completion", "cmpl-", chat=False)
CHAT = Shape("chat.completion", "chat.completion.chunk", "chatcmpl-", chat=True)


async def _error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HttpError)
    return exc.response()


class HttpApi:
    """The Starlette app over an engine; `serve()` runs it on the current event loop."""

    def __init__(self, engine: Engine, port: int, token: str | Reloading[tuple[str, ...]] | None = None,
                 served_model_name: str = "") -> None:
        self.engine, self.port = engine, port
        self.auth = BearerTokenAuth(token) if token else None
        self._served_model_name = served_model_name
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ], exception_handlers={HttpError: _error_response})
        self._server: Any = None

    @property
    def model_name(self) -> str:
        if self._served_model_name:
            return self._served_model_name
        return self.engine.target_info.model if self.engine.target_info else ""

    # --- endpoints ---

    async def health(self, request: Request) -> Response:
        if self.engine.ready:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "loading"}, status_code=503)

    async def metrics(self, request: Request) -> Response:
        """The Prometheus metrics of --metrics-port, on the API's port too, as model servers
        serve them: an endpoint picker scrapes the port it routes to (InferencePool
        targetPorts). Like /health, without the token."""
        return Response(prometheus_client.generate_latest(), media_type=prometheus_client.CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        self._admit(request)
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "tandem"}]})

    async def completions(self, request: Request) -> Response:
        body = await self._body(request)
        return await self._respond(body, completion_request(body), COMPLETIONS)

    async def chat_completions(self, request: Request) -> Response:
        body = await self._body(request)
        return await self._respond(body, chat_request(body, self._chat_template), CHAT)

    # --- the shared path ---

    def _chat_template(self, messages: list[dict[str, Any]]) -> str:
        text: str = self.engine.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)
        return text

    def _admit(self, request: Request) -> None:
        """Authentication, then readiness: before the body is read."""
        if self.auth is not None:
            refusal = self.auth.refusal([("authorization", v) for v in
                                         request.headers.getlist("authorization")])
            if refusal:
                raise HttpError(401, refusal, "authentication_error", code="invalid_api_key")
        if not self.engine.ready:
            raise HttpError(503, "the orchestrator is still connecting to its replicas",
                            "service_unavailable", code="unavailable")

    async def _body(self, request: Request) -> dict[str, Any]:
        """The request's JSON object, once it may be read; a request for another model is 404."""
        self._admit(request)
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            raise _invalid(f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise _invalid("the body must be a JSON object")
        model = body.get("model")
        if model not in (None, "", self.model_name):
            raise HttpError(404, f"model {model!r} is not served here; GET /v1/models lists "
                            f"{self.model_name!r}", "invalid_request_error", "model",
                            "model_not_found")
        return body

    async def _respond(self, body: dict[str, Any], gen: GenerationRequest, shape: Shape
                       ) -> Response:
        stream = bool(body.get("stream"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if gen.n > self.engine.config.max_choices:
            raise _invalid(f"n must be in [1, {self.engine.config.max_choices}], got {gen.n}", "n")
        events = self.engine.generate(gen)
        # The first event settles the status: validation, admission and the first step's
        # errors become an HTTP error; later ones end the stream with an error event.
        try:
            first = await events.__anext__()
        except TandemError as exc:
            raise from_domain_error(exc) from None
        ident, created = shape.id_prefix + uuid.uuid4().hex, int(time.time())
        head = {"id": ident, "created": created, "model": self.model_name}
        if stream:
            return StreamingResponse(self._sse(first, events, head, shape, include_usage, gen),
                                     media_type="text/event-stream",
                                     headers={"cache-control": "no-cache"})
        texts: list[list[str]] = [[] for _ in range(gen.n)]
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(gen.n)]
        summaries: dict[int, Summary] = {}
        try:
            event: Event | None = first
            while event is not None:
                if isinstance(event, Delta):
                    texts[event.choice].append(event.text)
                    logprobs[event.choice].extend(event.logprobs)
                else:
                    summaries[event.choice] = event
                event = await anext(events, None)
        except TandemError as exc:
            raise from_domain_error(exc) from None
        assert len(summaries) == gen.n
        return JSONResponse({**head, "object": shape.object,
                             "choices": [shape.choice("".join(texts[i]), finish_reason(summaries[i].finish_reason),
                                                      chunk=False, index=i,
                                                      logprobs=self._logprobs(shape, logprobs[i], gen))
                                         for i in range(gen.n)],
                             "usage": usage_json(*(summaries[i].usage for i in range(gen.n)))})

    def _logprobs(self, shape: Shape, tokens: Sequence[TokenLogprob], gen: GenerationRequest
                  ) -> dict[str, Any] | None:
        if gen.logprobs is None:
            return None
        decode = self.engine.tokenizer.decode  # an end-of-sequence token's text is "", as in the reply
        return shape.logprobs(tokens, lambda token: str(decode([token], skip_special_tokens=True)))

    async def _sse(self, first: Event, events: AsyncGenerator[Event, None], head: dict[str, Any],
                   shape: Shape, include_usage: bool, gen: GenerationRequest) -> AsyncIterator[bytes]:
        choices = gen.n
        def frame(payload: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

        def chunk(choice: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            payload = {**head, "object": shape.chunk_object, "choices": choice}
            if include_usage:
                payload["usage"] = usage
            return frame(payload)

        opened: set[int] = set() if shape.chat else set(range(choices))  # chat's first chunk names the role
        usages: list[Usage] = []
        try:
            event: Event | None = first
            while event is not None:
                i = event.choice
                if isinstance(event, Delta):
                    if event.text or event.logprobs or i not in opened:
                        yield chunk([shape.choice(event.text, None, chunk=True, first=i not in opened, index=i,
                                                  logprobs=self._logprobs(shape, event.logprobs, gen))])
                        opened.add(i)
                else:
                    yield chunk([shape.choice("", finish_reason(event.finish_reason),
                                              chunk=True, first=i not in opened, index=i)])
                    usages.append(event.usage)
                    if include_usage and len(usages) == choices:
                        yield chunk([], usage_json(*usages))
                event = await anext(events, None)
        except TandemError as exc:
            error = from_domain_error(exc)
            yield frame({"error": {"message": error.message, "type": error.kind,
                                   "param": error.param, "code": error.code}})
        finally:
            await events.aclose()  # a client that went away: the generation stops, caches freed
        yield b"data: [DONE]\n\n"

    # --- running ---

    async def start(self, host: str) -> str:
        """Listen on host:self.port (0: a free port) in this event loop; where, as a line."""
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, self.port))
        sock.listen(2048)
        sock.setblocking(False)
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=5)
        config.load()
        # uvicorn's startup and shutdown, not its serve(): that one installs signal handlers
        # of its own, and the gRPC bootstrap owns SIGTERM (a drain of both front ends).
        self._server = uvicorn.Server(config)
        self._server.lifespan = config.lifespan_class(config)
        self._sock = sock
        await self._server.startup(sockets=[sock])
        self.port = sock.getsockname()[1]
        return f"http on {host}:{self.port}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await asyncio.wait_for(self._server.shutdown(sockets=[self._sock]), timeout=10)
            self._server = None
