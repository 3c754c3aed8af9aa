"""The FastAPI app: routes, API-key check, and the engine thread's lifetime (lifespan)."""

from __future__ import annotations

import copy
import hmac
import logging
import os
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from engine.engine import Engine
from engine.server.async_engine import AsyncEngine
from engine.server.errors import APIError, error_response, install_error_handlers
from engine.server.metrics import ServerMetrics
from engine.server.params import ModelInfo, chat_prompt, check_token_ids
from engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from engine.server.serving import Serving

logger = logging.getLogger(__name__)

API_KEY_ENV = "ENGINE_API_KEY"


def default_model_name(engine: Engine) -> str:
    model = engine.config.model
    if model is None:
        return "SmolLM2-135M-Instruct"
    return os.path.basename(os.path.normpath(model)) or str(model)


def build_app(engine: Engine, model_name: str | None = None, api_key: str | None = None) -> FastAPI:
    """An app serving `engine`; the engine thread starts and stops with the app's lifespan."""
    api_key = api_key or os.environ.get(API_KEY_ENV) or None
    name = model_name or default_model_name(engine)
    # The server tokenizes on the event loop while the engine thread decodes: separate objects,
    # so the two threads never share a tokenizer's mutable state.
    tokenizer = copy.deepcopy(engine.tokenizer) if engine.tokenizer is not None else None
    model = ModelInfo(name, engine.max_model_len, int(engine.model_config.vocab_size), tokenizer)
    async_engine = AsyncEngine(engine)
    metrics = ServerMetrics(lambda: async_engine.snapshot, name)
    async_engine.observer = metrics.observer()
    serving = Serving(async_engine, model)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        logger.info("serving %s (context %d tokens)%s", name, model.max_model_len, ", API key required" if api_key else "")
        try:
            yield
        finally:
            # Uvicorn has already waited for open responses (its graceful-shutdown timeout);
            # anything still queued now is aborted and its stream told so.
            async_engine.shutdown()

    app = FastAPI(title="graph-engine OpenAI-compatible API", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    install_error_handlers(app)

    async def require_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        # Constant-time compare: the key must not leak through response timing.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError("invalid or missing API key (send Authorization: Bearer <key>)", status=401)

    @app.middleware("http")
    async def log_requests(request: Request, call_next):  # noqa: ANN001, ANN202
        start = time.perf_counter()
        response = await call_next(request)
        logger.debug("%s %s -> %d (%.1f ms)", request.method, request.url.path, response.status_code,
                     1000 * (time.perf_counter() - start))
        return response

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.alive:
            return error_response("the engine thread is not running", 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(require_key)])
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, created=created, root=name, max_model_len=model.max_model_len)])

    @app.post("/v1/completions", dependencies=[Depends(require_key)])
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions", dependencies=[Depends(require_key)])
    async def chat(req: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat(req, raw)

    # Like vLLM, the key guards the /v1 routes; /tokenize and /detokenize only read the tokenizer.
    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            ids = chat_prompt(model, req.messages, req.add_generation_prompt, None)
        elif model.tokenizer is None:
            raise APIError("this model has no tokenizer", param="prompt")
        else:
            ids = list(model.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)) if req.prompt else []
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": model.max_model_len})

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        serving.check_model(req.model)
        check_token_ids(model, req.tokens, "tokens")
        if model.tokenizer is None:
            raise APIError("this model has no tokenizer", param="tokens")
        return JSONResponse({"prompt": model.tokenizer.decode(req.tokens)})

    return app

