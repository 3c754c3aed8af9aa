"""The FastAPI app: routes, API-key check, and the engine thread's lifetime (lifespan)."""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.server.async_engine import AsyncEngine
from engine.server.bodies import BodyParser
from engine.server.engine_process import EngineHandle
from engine.server.engine_thread import EngineThread
from engine.server.errors import APIError, error_response, install_error_handlers
from engine.server.fields import check_request_fields
from engine.server.guard import GuardMiddleware, GuardSettings
from engine.server.metrics import ServerMetrics
from engine.server.params import ModelInfo, chat_prompt, check_prompt_size, check_token_ids
from engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from engine.server.replicas import ReplicaSet
from engine.server.serving import Serving
from engine.structured.limits import GrammarLimits

logger = logging.getLogger(__name__)

API_KEY_ENV = "ENGINE_API_KEY"
SHUTDOWN_MARGIN_S = 1.0  # open requests are failed this long before uvicorn's shutdown deadline
GRAMMAR_START_WAIT_S = 60.0  # the most start-up waits for the grammar compiler processes before serving anyway


def default_model_name(engine: Engine | EngineHandle) -> str:
    model = engine.config.model if isinstance(engine, Engine) else engine.info.model if engine.info else None
    if model is None:
        return "SmolLM2-135M-Instruct"
    return os.path.basename(os.path.normpath(model)) or str(model)


@dataclass
class ServerSettings:
    """What the operator decides about the HTTP side (flags of `engine serve`, docs/server.md)."""

    api_key: str | None = None
    open_metrics: bool = False  # /metrics without the key (prefix-cache counters reveal others' prompts)
    enable_docs: bool = False  # /docs, /redoc and /openapi.json (behind the key when one is set)
    allowed_hosts: tuple[str, ...] | None = None  # Host header allow-list; None: any
    max_body_bytes: int = 8 * 2**20
    body_timeout_s: float = 10.0
    max_pending_requests: int = 1024  # engine requests (prompts x n) queued or running; more: 503 + Retry-After
    trust_request_chat_template: bool = False  # let requests supply their own Jinja chat template
    allow_unknown_fields: bool = False  # ignore request fields this server does not know (engine/server/fields.py)
    tool_call_parser: str | None = None  # how tool calls are read for tool_choice "auto" (engine/server/tools.py)
    reasoning_parser: str | None = None  # how reasoning_content is split from content (engine/server/reasoning.py)
    # Request grammars: size, nesting, compile deadline, compiler processes (docs/structured_output.md).
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)


def build_app(
    engine: Engine | EngineHandle,
    model_name: str | None = None,
    api_key: str | None = None,
    settings: ServerSettings | None = None,
    engine_thread: EngineThread | None = None,
) -> FastAPI:
    """An app serving `engine` (an Engine, run on a thread, or a started EngineHandle: an EngineProcess, a
    ReplicaSet, an extra API server's EngineClient); the
    engine loop starts and stops with the app's lifespan.

    engine_thread: the thread the engine was built on (`engine serve` builds it there), which then
    runs its loop; by default a new thread."""
    settings = settings or ServerSettings()
    settings.api_key = api_key or settings.api_key or os.environ.get(API_KEY_ENV) or None
    api_key = settings.api_key
    name = model_name or default_model_name(engine)
    # The server tokenizes on its own worker thread while the engine thread decodes: separate
    # objects, so the two threads never share a tokenizer's mutable state.
    if not isinstance(engine, Engine):
        assert engine.info is not None, "start the engine process before building the app"
        # Unpickled from the engine process: already an object of this process alone.
        model = ModelInfo(
            name, engine.info.max_model_len, engine.info.vocab_size, engine.info.tokenizer, engine.info.lora_adapters
        )
        async_engine = AsyncEngine.over_process(engine)  # type: ignore[arg-type] (a ReplicaSet acts as one)
    else:
        tokenizer = copy.deepcopy(engine.tokenizer) if engine.tokenizer is not None else None
        model = ModelInfo(
            name,
            engine.max_model_len,
            int(engine.model_config.vocab_size),
            tokenizer,
            engine.lora_adapters() if engine.lora is not None else None,
        )
        async_engine = AsyncEngine(engine, thread=engine_thread)
    metrics = ServerMetrics(lambda: async_engine.snapshot, name)
    if isinstance(engine, ReplicaSet):
        metrics.replicas = engine.counts
    async_engine.observer = metrics.observer()
    serving = Serving(
        async_engine,
        model,
        settings.max_pending_requests,
        settings.trust_request_chat_template,
        settings.tool_call_parser,
        settings.reasoning_parser,
        settings.grammar_limits,
    )
    metrics.grammar_counts = serving.grammars.counts
    metrics.pending = lambda: serving.pending
    bodies = BodyParser()  # large bodies are parsed off the event loop (engine/server/bodies.py)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        if model.tokenizer is not None:
            # Ready only once the grammar compiler processes are up: their fork server imports xgrammar and
            # torch, seconds of a core that the first requests' steps would otherwise share with it.
            started = time.perf_counter()
            if await asyncio.to_thread(serving.grammars.wait_started, GRAMMAR_START_WAIT_S):
                logger.info("grammar compiler processes ready (waited %.1f s)", time.perf_counter() - started)
            else:
                logger.warning("grammar compiler processes not started within %.0f s; serving", GRAMMAR_START_WAIT_S)
        watcher = asyncio.ensure_future(_end_streams_before_the_deadline(app, async_engine))
        logger.info(
            "serving %s (context %d tokens)%s", name, model.max_model_len, ", API key required" if api_key else ""
        )
        try:
            yield
        finally:
            watcher.cancel()
            # Uvicorn has already waited for open responses (its graceful-shutdown timeout);
            # anything still queued now is aborted and its stream told so.
            async_engine.shutdown()
            serving.close()
            bodies.close()

    docs = {} if settings.enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="graph-engine OpenAI-compatible API", lifespan=lifespan, **docs)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.settings = settings
    install_error_handlers(app)
    open_paths = {"/health"} | ({"/metrics"} if settings.open_metrics else set())
    guard = GuardSettings(
        api_key, frozenset(open_paths), settings.allowed_hosts, settings.max_body_bytes, settings.body_timeout_s
    )
    app.state.open_requests = guard.open_requests  # ended with a JSON 503 just before the shutdown deadline
    app.add_middleware(GuardMiddleware, settings=guard)

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.alive:
            return error_response("the engine thread is not running", 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def card() -> ModelCard:
        return ModelCard(id=name, created=created, root=name, max_model_len=model.max_model_len)

    def adapter_cards() -> list[ModelCard]:
        """Each loaded LoRA adapter, as vLLM lists them: its name, its folder as root, the base model as parent."""
        return [
            ModelCard(id=lora, created=created, root=path, parent=name, max_model_len=model.max_model_len)
            for lora, path in sorted((model.lora_adapters or {}).items())
        ]

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card(), *adapter_cards()])

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> ModelCard:
        for found in [card(), *adapter_cards()]:
            if found.id == model_id:
                return found
        raise APIError(
            f"The model `{model_id}` does not exist; this server serves `{name}`.", status=404, param="model"
        )

    async def change_adapters(op: str, lora_name: str, lora_path: str | None) -> None:
        if model.lora_adapters is None:
            raise APIError("LoRA is off on this server: start it with --enable-lora", param="lora_name")
        if isinstance(engine, ReplicaSet):
            raise APIError("loading LoRA adapters at run time with --data-parallel-size is not supported yet")
        try:
            await async_engine.change_lora(op, lora_name, lora_path)
        except InvalidRequestError as exc:
            raise APIError(str(exc), param="lora_path" if op == "load" else "lora_name") from exc
        record_lora_change(op, lora_name, lora_path)

    def record_lora_change(op: str, lora_name: str, lora_path: str | None) -> None:
        """The adapters /v1/models lists: after a change through this server, or through another API-server
        process over the same engine (the router's announcement)."""
        if model.lora_adapters is None:
            return
        if op == "load":
            model.lora_adapters[lora_name] = lora_path or ""
        else:
            model.lora_adapters.pop(lora_name, None)

    async_engine.router.on_lora_change = record_lora_change

    # vLLM's endpoints for adapters at run time (its answers are plain text).
    @app.post("/v1/load_lora_adapter", openapi_extra=_body_schema(LoadLoRAAdapterRequest))
    async def load_lora_adapter(raw: Request) -> Response:
        req = await bodies.parse(raw, LoadLoRAAdapterRequest)
        await change_adapters("load", req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", openapi_extra=_body_schema(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(raw: Request) -> Response:
        req = await bodies.parse(raw, UnloadLoRAAdapterRequest)
        await change_adapters("unload", req.lora_name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    # The bodies below are read by BodyParser, not by FastAPI (which parses them on the event loop);
    # openapi_extra keeps their schemas in /openapi.json.
    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(raw: Request) -> Response:
        req = await bodies.parse(raw, CompletionRequest)
        check_request_fields(req, settings.allow_unknown_fields)
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatCompletionRequest))
    async def chat(raw: Request) -> Response:
        req = await bodies.parse(raw, ChatCompletionRequest)
        check_request_fields(req, settings.allow_unknown_fields)
        return await serving.chat(req, raw)

    @app.post("/tokenize", openapi_extra=_body_schema(TokenizeRequest))
    async def tokenize(raw: Request) -> JSONResponse:
        req = await bodies.parse(raw, TokenizeRequest)
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            ids = await serving.off_loop(chat_prompt, model, req.messages, req.add_generation_prompt, None)
        elif model.tokenizer is None:
            raise APIError("this model has no tokenizer", param="prompt")
        else:
            check_prompt_size(model, req.prompt, "prompt")
            ids = await serving.off_loop(
                lambda: list(model.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
            )
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": model.max_model_len})

    @app.post("/detokenize", openapi_extra=_body_schema(DetokenizeRequest))
    async def detokenize(raw: Request) -> JSONResponse:
        req = await bodies.parse(raw, DetokenizeRequest)
        serving.check_model(req.model)
        check_token_ids(model, req.tokens, "tokens")
        if len(req.tokens) > model.max_model_len:
            raise APIError(f"at most {model.max_model_len} tokens (the context length)", param="tokens")
        if model.tokenizer is None:
            raise APIError("this model has no tokenizer", param="tokens")
        return JSONResponse({"prompt": await serving.off_loop(model.tokenizer.decode, req.tokens)})

    return app


def _body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI requestBody of a route whose body BodyParser reads."""
    schema = {"content": {"application/json": {"schema": model.model_json_schema()}}, "required": True}
    return {"requestBody": schema}


async def _end_streams_before_the_deadline(app: FastAPI, async_engine: AsyncEngine) -> None:
    """On SIGTERM, end every open request with an error just before uvicorn's graceful-shutdown deadline.

    Uvicorn cancels whatever is still running at its deadline, which would cut
    streams mid-chunk with no error event and no [DONE]; failing them a moment
    earlier lets each stream end properly and each non-streaming request get
    a JSON 503.
    """
    server = None
    while server is None or not server.should_exit:
        await asyncio.sleep(0.1)
        server = getattr(app.state, "uvicorn_server", None)
    timeout = server.config.timeout_graceful_shutdown
    if timeout is None:
        return
    await asyncio.sleep(max(0.0, timeout - SHUTDOWN_MARGIN_S))
    async_engine.fail_all("the server is shutting down")
    app.state.open_requests.end("the server is shutting down")
