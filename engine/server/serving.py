"""/v1/completions and /v1/chat/completions: queue the choices, then answer in one body or as SSE."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from engine.errors import InvalidRequestError, RequestFailedError
from engine.request import RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.server.async_engine import AsyncEngine, EngineDeadError, RequestGroup
from engine.server.disconnects import client_gone
from engine.server.errors import APIError, error_body
from engine.server.grammar_gate import await_verdict
from engine.server.params import (
    ModelInfo,
    Tokens,
    TokenTextJoiner,
    chat_logprobs,
    chat_prompt,
    check_chat_template_kwargs,
    completion_logprobs,
    completion_prompts,
    derived_seed,
    resolve_max_tokens,
    sampling_params,
)
from engine.server.protocol import (
    MAX_CHOICES,
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    UsageInfo,
    random_id,
)
from engine.server.reasoning import ReasoningStream, split_reasoning
from engine.server.structured_fields import AskedGrammar, check_schema_refs, grammar_from_request
from engine.server.tool_parsers import ToolCall
from engine.server.tools import ToolPlan, calls_from_text, plan_tools, streamable_prefix, streams_calls_early
from engine.structured.checker import GrammarChecker, tokenizer_info_json
from engine.structured.limits import GrammarLimits, validate_grammar
from engine.structured.spec import GrammarSpec

logger = logging.getLogger(__name__)
T = TypeVar("T")

HEAVY_RESPONSE_TOKENS = 4096  # a whole response of more tokens (prompts with echo, outputs) is built off the loop


@dataclass
class Choice:
    """One engine request: a (prompt, sample) pair of the HTTP request."""

    index: int
    prompt_text: str | None
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    final: RequestOutput | None = None
    text_offset: int = 0  # streaming completions with logprobs: where the next token's text starts
    joiner: TokenTextJoiner | None = None  # streaming logprobs: a character split over chunks
    sent_role: bool = False
    sent_prompt: bool = False  # echo: the prompt goes out with the first chunk
    sent_prompt_ids: bool = False  # return_token_ids: the prompt's ids go out with the first chunk
    tool_plan: ToolPlan | None = None  # chat with tools that parse calls out of the text
    streamed_text: str = ""  # streaming with a tool plan: the text so far (chunks bring deltas)
    sent_chars: int = 0  # ... of which this much went out as content
    sent_calls: int = 0  # ... and this many tool calls
    reasoning_parser: str | None = None  # split <think> text into reasoning_content (engine/server/reasoning.py)
    reasoning: ReasoningStream | None = None  # streaming: that split so far
    # echo with logprobs and n > 1: the choice of the same prompt whose engine request computes the prompt's
    # logprobs; this one's are a copy of them (None: its own request computes them)
    echo_source: Choice | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # echo with logprobs: the prompt's entries, once known
    held: list[RequestOutput] = field(default_factory=list)  # streaming: outputs waiting for echo_source's entries


class Serving:
    def __init__(
        self,
        engine: AsyncEngine,
        model: ModelInfo,
        max_pending: int = 1024,
        trust_request_chat_template: bool = False,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        grammar_limits: GrammarLimits | None = None,
    ) -> None:
        self.engine = engine
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.model = model
        # A tokenizer copy per thread, since an HF tokenizer must not be used by two threads at once: the loop's
        # (stream chunks, light responses), the worker's (prompts: model.tokenizer itself) and the builder's
        # (heavy whole responses, on a thread of their own so that they never delay a prompt: _respond).
        self.tokens = Tokens(copy.deepcopy(model.tokenizer) if model.tokenizer is not None else None)
        self.builder_tokens = Tokens(copy.deepcopy(model.tokenizer) if model.tokenizer is not None else None)
        self._builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="responses")
        self.max_pending = max_pending
        self.trust_request_chat_template = trust_request_chat_template
        self.pending = 0  # engine requests (choices) admitted and not yet done, counted on the event loop
        # Tokenizing, chat templating and detokenizing big inputs would stall the event loop (and
        # /health with it). One worker thread: the server's tokenizer copy is used by one thread at a
        # time, and HF tokenizers release the GIL while they encode.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        # Request grammars are judged in compiler processes before admission (engine/server/grammar_gate.py);
        # the vocabulary's description for them is made once, on this tokenizer's own thread.
        self.grammar_limits = grammar_limits or GrammarLimits()
        self.grammars = GrammarChecker(self._tokenizer_info_json, self.grammar_limits)
        if self.model.tokenizer is not None:
            self.grammars.start()

    async def off_loop(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
        self._builder.shutdown(wait=False, cancel_futures=True)
        self.grammars.close()

    def _tokenizer_info_json(self) -> str:
        return self._worker.submit(tokenizer_info_json, self.model.tokenizer, self.model.vocab_size).result()

    def check_model(self, name: str | None, lora_path: str | None = None) -> str | None:
        """The LoRA adapter a request runs with (None: the base model): its `model` when that names a loaded
        adapter (vLLM), or its `lora_path` (SGLang); anything else unknown is refused."""
        adapters = self.model.lora_adapters
        lora = None
        if name is not None and name != self.model.name:
            if adapters is None or name not in adapters:
                known = ", ".join(f"`{m}`" for m in [self.model.name, *sorted(adapters or {})])
                raise APIError(f"The model `{name}` does not exist; this server serves {known}.", param="model")
            lora = name
        if lora_path is not None:
            if adapters is None:
                raise APIError("lora_path: LoRA is off on this server (--enable-lora)", param="lora_path")
            if lora_path not in adapters:
                loaded = ", ".join(sorted(adapters)) or "none"
                raise APIError(f"lora_path: no LoRA adapter {lora_path!r} is loaded ({loaded})", param="lora_path")
            if lora is not None and lora != lora_path:
                raise APIError(f"model names adapter {lora!r}, lora_path {lora_path!r}", param="lora_path")
            lora = lora_path
        return lora

    # ---- /v1/completions --------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        lora = self.check_model(req.model, req.lora_path)
        if req.suffix:
            raise APIError("suffix is not supported", param="suffix")
        prompts = await self.off_loop(completion_prompts, self.model, req.prompt)
        asked = await self.off_loop(grammar_from_request, req, self.grammar_limits)
        grammar = asked.spec if asked is not None else None
        if len(prompts) * req.n > MAX_CHOICES:
            raise APIError(f"at most {MAX_CHOICES} choices (prompts x n) per request", param="n")
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        request_id = random_id("cmpl")
        choices = []
        for p, (text, ids) in enumerate(prompts):
            max_tokens = resolve_max_tokens(self.model, len(ids), req.max_tokens)
            for i in range(req.n):
                # A prompt's logprobs are the same for each of its choices: only the first asks the engine for
                # them (a pass with logits at every position), the others take its copy (echo_source) and
                # reuse its prompt pages from the prefix cache.
                params = sampling_params(
                    req,
                    max_tokens,
                    derived_seed(req.seed, i),
                    req.logprobs,
                    prompt_logprobs if i == 0 else None,
                    grammar,
                    request_id,
                    lora,
                )
                choice = Choice(p * req.n + i, text, ids, params)
                if prompt_logprobs is not None and i > 0:
                    choice.echo_source = choices[p * req.n]
                choices.append(choice)
        group = await self._start(request_id, choices, raw, asked)
        usage_prompt = sum(len(ids) for _, ids in prompts)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = self._sse(
                group,
                choices,
                lambda c, o: self._completion_chunk(req, request_id, c, o),
                include_usage,
                lambda usage: {
                    "id": request_id,
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": self.model.name,
                    "choices": [],
                    "usage": usage.model_dump(),
                },
                usage_prompt,
            )
            return StreamingResponse(body, media_type="text/event-stream")
        await self._collect(group, choices, raw)

        def build(tokens: Tokens) -> dict:
            return CompletionResponse(
                id=request_id,
                model=self.model.name,
                choices=[self._completion_choice(req, c, tokens) for c in choices],
                usage=_usage(usage_prompt, choices),
            ).model_dump()

        return await self._respond(build, req.logprobs is not None, choices)

    async def _respond(self, build: Callable[[Tokens], dict], logprobs: bool, choices: list[Choice]) -> Response:
        """A whole response as JSON. A heavy one (logprobs: thousands of entries with echo; long texts) is built
        and encoded on the builder thread, so that it never stalls streams and /health on the loop, nor delays
        other requests' prompts on the tokenizer thread; a light one is built at once on the loop, so that it
        never waits behind a heavy one."""
        tokens = sum(len(c.prompt_ids) + len(c.final.token_ids) for c in choices if c.final is not None)
        if logprobs or tokens > HEAVY_RESPONSE_TOKENS:
            loop = asyncio.get_running_loop()
            body = await loop.run_in_executor(self._builder, lambda: _json_bytes(build(self.builder_tokens)))
        else:
            body = _json_bytes(build(self.tokens))
        return Response(body, media_type="application/json")

    def _completion_choice(self, req: CompletionRequest, choice: Choice, tokens: Tokens) -> CompletionChoice:
        final = choice.final
        assert final is not None
        text = final.text
        logprobs = None
        if req.echo:
            text = self._prompt_text(choice, tokens) + text
        if req.logprobs is not None:
            ids, entries = [], []
            if req.echo:
                ids += choice.prompt_ids
                entries += self._prompt_entries(choice, final) or [None] * len(choice.prompt_ids)
            ids += final.token_ids
            entries += final.logprobs or []
            logprobs, _ = completion_logprobs(
                tokens, ids, entries, 0, TokenTextJoiner(tokens, choice.params.skip_special_tokens)
            )
        item = CompletionChoice(index=choice.index, text=text, logprobs=logprobs, finish_reason=final.finish_reason)
        if req.return_token_ids:
            item.prompt_token_ids, item.token_ids = list(choice.prompt_ids), list(final.token_ids)
        return item

    def _completion_chunk(
        self, req: CompletionRequest, request_id: str, choice: Choice, output: RequestOutput
    ) -> dict | None:
        text = output.new_text
        ids: list[int] = []
        entries: list = []
        if req.echo and not choice.sent_prompt:
            choice.sent_prompt = True
            text = self._prompt_text(choice, self.tokens) + text
            ids += choice.prompt_ids
            entries += self._prompt_entries(choice, output) or [None] * len(choice.prompt_ids)
        new_ids = req.return_token_ids and bool(output.new_token_ids)
        if not text and not output.finished and req.logprobs is None and not new_ids:
            return None  # text held back (a possible stop string): nothing to say yet
        logprobs = None
        if req.logprobs is not None:
            ids += output.new_token_ids
            entries += output.new_logprobs or []
            choice.joiner = choice.joiner or TokenTextJoiner(self.tokens, choice.params.skip_special_tokens)
            logprobs, choice.text_offset = completion_logprobs(
                self.tokens, ids, entries, choice.text_offset, choice.joiner, final=output.finished
            )
        # CompletionChoice's fields as a plain dict: one chunk per token per stream, and pydantic's
        # model_dump cost more than the JSON encoding itself (a CompletionChoice test holds the shape).
        item = {
            "index": choice.index,
            "text": text,
            "logprobs": logprobs.model_dump() if logprobs is not None else None,
            "finish_reason": output.finish_reason,
            "prompt_token_ids": None,
            "token_ids": None,
        }
        if req.return_token_ids:
            # vLLM's streaming form: each chunk's new token ids (the prompt's with the first), so a model
            # without a tokenizer, whose chunks carry no text, still streams.
            if not choice.sent_prompt_ids:
                choice.sent_prompt_ids = True
                item["prompt_token_ids"] = list(choice.prompt_ids)
            item["token_ids"] = list(output.new_token_ids)
        return {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model.name,
            "choices": [item],
        }

    @staticmethod
    def _prompt_entries(choice: Choice, output: RequestOutput) -> list[TokenLogprob | None] | None:
        """The prompt's logprob entries for an echo: the choice's own, or those its echo_source's request computed."""
        source = choice.echo_source
        if source is None:
            return output.prompt_logprobs
        return source.prompt_logprobs if source.final is None else source.final.prompt_logprobs

    @staticmethod
    def _prompt_text(choice: Choice, tokens: Tokens) -> str:
        if choice.prompt_text is not None:
            return choice.prompt_text
        return tokens.tokenizer.decode(choice.prompt_ids) if tokens.tokenizer is not None else ""

    # ---- /v1/chat/completions -----------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        lora = self.check_model(req.model, req.lora_path)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        kwargs = check_chat_template_kwargs(req.chat_template_kwargs, self.trust_request_chat_template)
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_call_parser)
        ids = await self.off_loop(
            chat_prompt,
            self.model,
            req.messages,
            req.add_generation_prompt,
            kwargs,
            plan.prompt_tools if plan is not None else None,
        )
        asked = await self.off_loop(grammar_from_request, req, self.grammar_limits)
        if plan is not None and plan.grammar is not None:
            if asked is not None:
                raise APIError(
                    'tool_choice "required" or a named function constrains the output itself; it cannot '
                    "be combined with response_format or another structured-output field",
                    param="tool_choice",
                )
            asked = AskedGrammar(plan.grammar, "tools")
            await self.off_loop(_check_tool_grammar, plan.grammar, self.grammar_limits)
        grammar = asked.spec if asked is not None else None
        if plan is not None and not plan.parses_calls:
            plan = None  # tool_choice "none": plain text
        budget, param = req.max_tokens, "max_tokens"
        if req.max_completion_tokens is not None:
            budget, param = req.max_completion_tokens, "max_completion_tokens"
        max_tokens = resolve_max_tokens(self.model, len(ids), budget, param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        request_id = random_id("chatcmpl")
        choices = [
            Choice(
                i,
                None,
                ids,
                sampling_params(req, max_tokens, derived_seed(req.seed, i), logprobs, None, grammar, request_id, lora),
                tool_plan=plan,
                reasoning_parser=self.reasoning_parser if grammar is None else None,
            )
            for i in range(req.n)
        ]
        created = int(time.time())
        group = await self._start(request_id, choices, raw, asked)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = self._sse(
                group,
                choices,
                lambda c, o: self._chat_chunk(req, request_id, created, c, o),
                include_usage,
                lambda usage: ChatCompletionChunk(
                    id=request_id, created=created, model=self.model.name, choices=[], usage=usage
                ).model_dump(),
                len(ids),
            )
            return StreamingResponse(body, media_type="text/event-stream")
        await self._collect(group, choices, raw)

        def build(tokens: Tokens) -> dict:
            return ChatCompletionResponse(
                id=request_id,
                created=created,
                model=self.model.name,
                choices=[
                    ChatChoice(
                        index=c.index,
                        message=_assistant_message(c.tool_plan, c.reasoning_parser, c.final.text),
                        logprobs=chat_logprobs(
                            tokens,
                            c.final.logprobs or [],
                            logprobs,
                            TokenTextJoiner(tokens, c.params.skip_special_tokens),
                        )
                        if logprobs is not None
                        else None,
                        finish_reason=_finish_reason(
                            c.tool_plan, _content_text(c.reasoning_parser, c.final.text), c.final.finish_reason
                        ),
                    )
                    for c in choices
                    if c.final is not None
                ],
                usage=_usage(len(ids), choices),
            ).model_dump()

        return await self._respond(build, logprobs is not None, choices)

    def _chat_chunk(
        self, req: ChatCompletionRequest, request_id: str, created: int, choice: Choice, output: RequestOutput
    ) -> dict | None:
        delta = DeltaMessage(content=output.new_text)
        finish_reason = output.finish_reason
        if choice.reasoning_parser is not None:
            choice.reasoning = choice.reasoning or ReasoningStream(choice.reasoning_parser)
            reasoning, delta.content = choice.reasoning.feed(output.new_text, output.finished)
            delta.reasoning_content = reasoning or None
        if choice.tool_plan is not None:
            delta.content, delta.tool_calls, finish_reason = _tool_delta(choice, delta.content or "", output)
        if not choice.sent_role:
            choice.sent_role = True
            delta.role = "assistant"
        elif not (delta.content or delta.reasoning_content or delta.tool_calls or output.finished or req.logprobs):
            return None
        logprobs = None
        if req.logprobs:
            choice.joiner = choice.joiner or TokenTextJoiner(self.tokens, choice.params.skip_special_tokens)
            logprobs = chat_logprobs(
                self.tokens, output.new_logprobs or [], req.top_logprobs or 0, choice.joiner, final=output.finished
            )
        chunk = ChatCompletionChunk(
            id=request_id,
            created=created,
            model=self.model.name,
            choices=[ChatStreamChoice(index=choice.index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)],
        )
        return chunk.model_dump(exclude_none=True)

    # ---- shared -----------------------------------------------------------------------------------
    async def _start(
        self, request_id: str, choices: list[Choice], raw: Request, asked: AskedGrammar | None
    ) -> RequestGroup:
        """Admit the choices: a place among the pending requests (the grammar's check holds one too, so
        checks queue no further than requests do), the grammar's verdict, then the engine."""
        if self.pending + len(choices) > self.max_pending:
            raise APIError(
                f"the server has {self.pending} requests in flight (limit {self.max_pending}); retry later",
                status=503,
                headers={"Retry-After": "1"},
            )
        self.pending += len(choices)
        group = RequestGroup(self.engine, on_done=lambda: self._release(len(choices)))
        try:
            if asked is not None:
                if self.model.tokenizer is None:
                    raise APIError(
                        "structured output needs the model's tokenizer, and this model has none", param=asked.field
                    )
                await await_verdict(self.grammars, asked.spec, asked.field, raw)
            for choice in choices:
                choice.request_id = f"{request_id}-{choice.index}"
                await group.add(choice.request_id, choice.prompt_ids, choice.params)
        except BaseException as exc:
            group.abort()  # a later choice was rejected: the earlier ones must not run on
            if isinstance(exc, EngineDeadError):
                raise APIError(str(exc), status=503) from exc
            raise
        logger.debug("request %s: %d choice(s), prompt %d tokens", request_id, len(choices), len(choices[0].prompt_ids))
        return group

    async def _collect(self, group: RequestGroup, choices: list[Choice], raw: Request) -> None:
        """Wait for every choice; abort them all if the client hangs up first."""
        by_id = {c.request_id: c for c in choices}

        async def drain() -> None:
            async for output in group.outputs():
                if output.finished:
                    by_id[output.request_id].final = output

        task = asyncio.ensure_future(drain())
        gone = asyncio.ensure_future(client_gone(raw))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                logger.debug("client of %s went away: aborting", next(iter(by_id)))
                task.cancel()
                raise APIError("client disconnected", status=499)
            task.result()
        except (RequestFailedError, EngineDeadError) as exc:
            raise APIError(str(exc), status=503 if isinstance(exc, EngineDeadError) else 500) from exc
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
            group.abort()

    async def _sse(
        self,
        group: RequestGroup,
        choices: list[Choice],
        chunk_of: Callable[[Choice, RequestOutput], dict | None],
        include_usage: bool,
        usage_chunk: Callable[[UsageInfo], dict],
        prompt_tokens: int,
    ) -> AsyncIterator[str]:
        """Server-Sent Events until `data: [DONE]`; a cancelled stream (client gone) aborts its requests."""
        by_id = {c.request_id: c for c in choices}
        try:
            async for batch in group.output_batches():
                events = []
                for output in batch:
                    choice = by_id[output.request_id]
                    if output.finished:
                        choice.final = output
                    for ready, ready_output in _echo_order(choice, output, choices):
                        chunk = chunk_of(ready, ready_output)
                        if chunk is not None:
                            events.append(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n")
                if events:
                    yield "".join(events)  # one write for the tokens that arrived together
            if include_usage:
                yield f"data: {json.dumps(usage_chunk(_usage(prompt_tokens, choices)))}\n\n"
        except (RequestFailedError, EngineDeadError) as exc:
            # Headers are gone already: the error travels as an event, as vLLM does.
            yield f"data: {json.dumps(error_body(str(exc), 503 if isinstance(exc, EngineDeadError) else 500))}\n\n"
        finally:
            group.abort()
        yield "data: [DONE]\n\n"

    def _release(self, count: int) -> None:
        self.pending -= count


def _echo_order(choice: Choice, output: RequestOutput, choices: list[Choice]) -> list[tuple[Choice, RequestOutput]]:
    """The outputs a stream can send now, given that `output` of `choice` arrived: a choice that copies its
    prompt's logprobs (echo_source) holds its outputs until the source's request has delivered them, and the
    source's first output releases what its copies held, in order."""
    source = choice.echo_source
    if source is not None and source.prompt_logprobs is None:
        choice.held.append(output)
        return []
    ready = [(choice, output)]
    if source is None and choice.prompt_logprobs is None and output.prompt_logprobs is not None:
        choice.prompt_logprobs = output.prompt_logprobs
        for other in choices:
            if other.echo_source is choice and other.held:
                ready += [(other, held) for held in other.held]
                other.held = []
    return ready


def _check_tool_grammar(grammar: GrammarSpec, limits: GrammarLimits) -> None:
    """The grammar made from the tools' parameter schemas is within the limits (a 400 on `tools`); whether
    it parses and compiles is the gate's to say (engine/server/grammar_gate.py)."""
    try:
        validate_grammar(grammar, limits)
        check_schema_refs(grammar)
    except InvalidRequestError as exc:
        raise APIError(f"tools: {exc}", param="tools") from exc


def _content_text(reasoning_parser: str | None, text: str) -> str:
    return split_reasoning(reasoning_parser, text)[1] if reasoning_parser is not None else text


def _assistant_message(plan: ToolPlan | None, reasoning_parser: str | None, text: str) -> AssistantMessage:
    reasoning = None
    if reasoning_parser is not None:
        reasoning, text = split_reasoning(reasoning_parser, text)
    if plan is None:
        return AssistantMessage(content=text, reasoning_content=reasoning or None)
    content, calls = calls_from_text(plan, text)
    return AssistantMessage(
        content=content, reasoning_content=reasoning or None, tool_calls=[call.as_dict() for call in calls] or None
    )


def _finish_reason(plan: ToolPlan | None, text: str, reason: str | None) -> str | None:
    """OpenAI's "tool_calls" when the output ended (not cut off) in calls."""
    if plan is not None and reason == "stop" and calls_from_text(plan, text)[1]:
        return "tool_calls"
    return reason


def _tool_delta(
    choice: Choice, new_text: str, output: RequestOutput
) -> tuple[str | None, list[dict] | None, str | None]:
    """(content delta, tool-call deltas, finish reason) of a streamed chunk under a tool plan, given the
    chunk's new content text: content goes out until a call may start; each call goes out whole as soon
    as it is complete (formats whose calls are self-contained blocks, tool_parsers.incremental), else
    in the last chunk, with whatever content follows the calls."""
    plan = choice.tool_plan
    assert plan is not None
    choice.streamed_text += new_text
    text = choice.streamed_text
    if not output.finished:
        end = streamable_prefix(plan, text)
        content, choice.sent_chars = text[choice.sent_chars : end], max(choice.sent_chars, end)
        calls = calls_from_text(plan, text)[1] if streams_calls_early(plan) else []
        return content, _call_deltas(choice, calls), None
    final_content, calls = calls_from_text(plan, text)
    if not calls:
        content, choice.sent_chars = text[choice.sent_chars :], len(text)
        return content, None, output.finish_reason
    sent = text[: choice.sent_chars]
    rest = final_content[len(sent) :] if final_content and final_content.startswith(sent) else ""
    reason = "tool_calls" if output.finish_reason == "stop" else output.finish_reason
    return rest, _call_deltas(choice, calls), reason


def _call_deltas(choice: Choice, calls: list[ToolCall]) -> list[dict] | None:
    """The calls not sent yet, with their index in the message."""
    new = [call.as_dict(index) for index, call in enumerate(calls) if index >= choice.sent_calls]
    choice.sent_calls = max(choice.sent_calls, len(calls))
    return new or None


def _json_bytes(content: dict) -> bytes:
    """JSONResponse's rendering (compact, UTF-8, no NaN), done wherever the caller runs."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


def _usage(prompt_tokens: int, choices: list[Choice]) -> UsageInfo:
    completion = sum(len(c.final.token_ids) for c in choices if c.final is not None)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)
