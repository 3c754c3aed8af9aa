"""`engine serve` end to end: the official openai client against a real server process (SmolLM2, CPU)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from server_helpers import MODEL, ServerProcess, shared_server

from engine.engine import Engine
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module", params=["engine-thread", "engine-process"])
def server(request: pytest.FixtureRequest) -> ServerProcess:
    """Every test against both transports: the engine on a thread of the server, and in its own process."""
    return shared_server(engine_process=request.param == "engine-process")


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_model_with_its_context_length(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    card = models[0].model_dump()
    assert card["owned_by"] and card["created"] > 0 and card["max_model_len"] == 2048


def test_greedy_completion_matches_engine_generate(client: openai.OpenAI, smol_engine: Engine) -> None:
    prompt = "The capital of France is"
    response = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = response.choices[0].model_dump()
    expected = smol_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert choice["token_ids"] == expected.token_ids
    assert choice["prompt_token_ids"] == expected.prompt_token_ids
    assert response.choices[0].text == expected.text and "Paris" in expected.text
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.completion_tokens == 12 and response.usage.total_tokens == response.usage.prompt_tokens + 12


def test_chat_uses_the_template_and_streams_the_same_text(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert "Paris" in full.choices[0].message.content and full.choices[0].message.role == "assistant"
    assert full.object == "chat.completion" and full.usage.prompt_tokens > 10  # the template's system turn
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completion_stream_ends_with_done(server: ServerProcess) -> None:
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 8,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 8 and chunks[-1]["choices"] == []
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_token_id_prompts_stream_their_token_ids(server: ServerProcess, smol_engine: Engine) -> None:
    """return_token_ids on a stream: every chunk carries its new ids (the prompt's with the first), so a
    model without a tokenizer still streams; each chunk has exactly CompletionChoice's fields."""
    from engine.server.protocol import CompletionChoice

    prompt = [1, 504, 3458, 282, 4649, 314]
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 10,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    choices = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert all(set(c) == set(CompletionChoice.model_fields) and CompletionChoice.model_validate(c) for c in choices)
    assert choices[0]["prompt_token_ids"] == prompt and all(c["prompt_token_ids"] is None for c in choices[1:])
    expected = smol_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert [t for c in choices for t in c["token_ids"]] == expected.token_ids
    assert "".join(c["text"] for c in choices) == expected.text


def test_stop_strings_cut_the_text(client: openai.OpenAI) -> None:
    prompt = "1, 2, 3, 4,"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    assert " 6," in plain
    for stop in (" 6", [" 9", " 6"]):
        choice = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=stop).choices[
            0
        ]
        assert choice.text == plain[: plain.index(" 6")] and choice.finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=" 6", stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == plain[: plain.index(" 6")]


def test_n_choices_with_seed_are_distinct_and_reproducible(client: openai.OpenAI) -> None:
    def sample() -> list[str]:
        response = client.completions.create(
            model=MODEL,
            prompt=["Tell me about dogs", "Tell me about cats"],
            max_tokens=8,
            n=3,
            temperature=1.0,
            seed=7,
            extra_body={"ignore_eos": True},
        )
        assert [c.index for c in response.choices] == list(range(6))
        assert response.usage.completion_tokens == 6 * 8
        return [c.text for c in response.choices]

    first = sample()
    assert first == sample()  # seeded: the same request gives the same choices
    assert len(set(first[:3])) > 1  # each choice has its own derived seed
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], n=2, max_tokens=6, temperature=1.0, seed=1
    )
    assert [c.index for c in chat.choices] == [0, 1]


def test_sampling_knobs_are_accepted(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL,
        prompt="The weather today is",
        max_tokens=6,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        seed=3,
        user="someone",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert response.usage.completion_tokens <= 6 and response.choices[0].finish_reason in ("stop", "length")
    # A field the server does not know is refused by name, not silently ignored (engine/server/fields.py).
    with pytest.raises(openai.BadRequestError, match="unknown_field"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"unknown_field": 1})


def test_chat_logprobs(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a color."}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3 and entry.bytes == list(entry.token.encode())
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == pytest.approx(
            entry.logprob
        )
    assert "".join(e.token for e in content) == response.choices[0].message.content


def test_completion_logprobs_and_echo(client: openai.OpenAI) -> None:
    prompt = "Hello world"
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True, extra_body={"ignore_eos": True}
    )
    choice = response.choices[0]
    lp = choice.logprobs
    prompt_len = response.usage.prompt_tokens
    assert choice.text.startswith(prompt) and len(lp.tokens) == prompt_len + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == choice.text
    assert all(lp.text_offset[i + 1] == lp.text_offset[i] + len(lp.tokens[i]) for i in range(len(lp.tokens) - 1))
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:])
    streamed = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        logprobs=1,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    tokens = [t for c in streamed for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens[prompt_len:]


def test_tokenize_detokenize_health(server: ServerProcess) -> None:
    base = server.base_url
    ids = httpx.post(f"{base}/tokenize", json={"prompt": "hello world"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] == 2048
    assert httpx.post(f"{base}/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"] == "hello world"
    chat = httpx.post(f"{base}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > ids["count"]
    assert httpx.get(f"{base}/health").status_code == 200


def test_64_concurrent_streams_complete_exactly_and_free_the_pool(server: ServerProcess) -> None:
    """More requests than max_num_seqs (8): they queue, stream, finish with exact counts; the pool empties."""
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    lengths = [3 + (i * 7) % 23 for i in range(64)]
    prompts = [" ".join(["word"] * (1 + (i * 5) % 40)) for i in range(64)]

    async def one(i: int) -> tuple[int, int]:
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompts[i],
            max_tokens=lengths[i],
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks, usage = 0, None
        async for chunk in stream:
            if chunk.choices:
                chunks += 1
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return chunks, usage

    async def run_all() -> list[tuple[int, int]]:
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await client.close()

    before = server.metrics()
    results = asyncio.run(run_all())
    assert [usage for _, usage in results] == lengths
    assert all(chunks >= 1 for chunks, _ in results)
    after = server.wait_idle()
    assert after["engine:generation_tokens_total"] - before["engine:generation_tokens_total"] == sum(lengths)
    assert after["engine:time_to_first_token_seconds_count"] - before["engine:time_to_first_token_seconds_count"] == 64


def test_16_clients_disconnecting_mid_stream_leave_nothing_behind(server: ServerProcess) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with client.stream("POST", f"{server.base_url}/v1/completions", json=body) as response:
            seen = 0
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen == 3:
                        return seen  # leaving the block closes the connection mid-stream

    async def run_all() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            assert await asyncio.gather(*(one(client, i) for i in range(16))) == [3] * 16

    before = server.metrics()
    asyncio.run(run_all())
    after = server.wait_idle(timeout=10)
    assert after["engine:request_success_total:abort"] - before.get("engine:request_success_total:abort", 0) == 16
    # Aborted at once: nowhere near the 16 x 400 tokens they asked for.
    assert after["engine:generation_tokens_total"] - before["engine:generation_tokens_total"] < 16 * 400 / 4
    # And the server still serves.
    response = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] <= 2


def test_metrics_exposes_the_prometheus_series(server: ServerProcess) -> None:
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in (
        "engine:num_requests_running",
        "engine:num_requests_waiting",
        "engine:kv_pages_used",
        "engine:generation_tokens_total",
        "engine:time_to_first_token_seconds_bucket",
        "engine:inter_token_latency_seconds_bucket",
        "engine:e2e_request_latency_seconds_bucket",
        # The vLLM names routers read (llm-d's endpoint picker, Dynamo), the same figures.
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
    ):
        assert name in text, name


def test_metrics_count_prefix_cache_hits(server: ServerProcess) -> None:
    """A repeated long prompt is served mostly from the prefix cache, and /metrics says so."""
    prompt = "Summarise the following text in one line. " + "The quick brown fox jumps over the lazy dog. " * 12
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    before = server.metrics()
    second = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    after = server.wait_idle(timeout=10)
    assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]
    prompt_tokens = second.json()["usage"]["prompt_tokens"]
    queried = after["engine:prefix_cache_queries_total"] - before["engine:prefix_cache_queries_total"]
    hits = after["engine:prefix_cache_hits_total"] - before["engine:prefix_cache_hits_total"]
    assert queried == prompt_tokens and hits >= prompt_tokens - 16  # all but the last partial page
    assert after["vllm:prefix_cache_hits_total"] == after["engine:prefix_cache_hits_total"]
    assert 0 < after["engine:prefix_cache_hit_rate"] <= 1
    for name in (
        "engine:prefill_computed_tokens_total",
        "engine:kv_pages_evicted_total",
        "engine:num_preemptions_total",
        "engine:kv_pages_cached",
    ):
        assert name in after, name


STRUCTURED_PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_structured_output_through_the_openai_client_streamed_or_not(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Give me a person as JSON."}]
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": STRUCTURED_PERSON, "strict": True},
    }
    full = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=64, temperature=0, response_format=response_format, n=2
    )
    for choice in full.choices:
        person = json.loads(choice.message.content)
        assert list(person) == ["name", "age"] and isinstance(person["age"], int) and choice.finish_reason == "stop"
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=64, temperature=0, response_format=response_format, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == full.choices[0].message.content
    picked = client.completions.create(
        model=MODEL,
        prompt="The capital of France is",
        max_tokens=8,
        temperature=0.8,
        extra_body={"structured_outputs": {"choice": ["Paris", "Lyon"]}},
    )
    assert picked.choices[0].text in ("Paris", "Lyon")
    with pytest.raises(openai.BadRequestError, match="regex"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"regex": "[unclosed"})


def test_tools_through_the_openai_client_required_streamed_and_auto(client: openai.OpenAI) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 12}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=64,
        temperature=0,
    )
    [call] = forced.choices[0].message.tool_calls
    assert forced.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=64,
        temperature=0,
        stream=True,
    )
    pieces: dict[int, dict] = {}
    for chunk in stream:  # reassembled as clients do: by index, arguments concatenated
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = pieces.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    assert pieces == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    auto = client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=16, temperature=0)
    assert auto.choices[0].message.content or auto.choices[0].message.tool_calls  # the model chose; both parse
    assert auto.choices[0].message.model_extra.get("reasoning_content") is None  # SmolLM2 does not think
