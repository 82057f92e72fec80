"""The OpenAI-compatible API end to end: ``python app.py --model tiny`` in a subprocess, driven by the real
``openai`` client (sync, streaming with usage, async), plain HTTP (``requests``) and an MCP client.

Every answer must name its image's colour in ``content`` with the first three stages in
``reasoning_content``/``reasoning``; held-out bad requests must get a 400 in OpenAI's error shape whose
message names the problem, while good requests in the same burst still succeed.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
import struct
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
from support import colour_of, data_url, ended, metric, running_app, wait_until

from vlm_demo.models.tiny import solid_image

KEY = "sk-test-19"
GREEDY = {"temperature": 0, "max_tokens": 400}


@pytest.fixture(scope="module")
def server(tiny_dir: str) -> Iterator[str]:
    # Each request reaches the engine (streaming, cancelling are tested): no response cache.
    with running_app("--api-key", KEY, "--mcp-server", "--max-batch-size", "8", "--response-cache-mb", "0") as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def ask(question: str, image_url: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "text", "text": question}, {"type": "image_url", "image_url": {"url": image_url}}],
        }
    ]


GREEN = data_url(solid_image("green", 96, 64, noise=5, seed=3))  # held out: a size and noise not trained on


def test_the_client_lists_and_retrieves_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="serves 'tiny'"):
        client.models.retrieve("gpt-4o")
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4o' does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=ask("What colour?", GREEN))


def test_a_green_image_gets_its_conclusion_in_content_and_the_stages_in_reasoning(
    client: openai.OpenAI, server: str
) -> None:
    reply = client.chat.completions.create(model="tiny", messages=ask("Which colour is this?", GREEN), **GREEDY)
    message = reply.choices[0].message
    assert colour_of(message.content) == "green" and "<" not in message.content, message.content
    reasoning = message.model_extra["reasoning_content"]
    assert message.model_extra["reasoning"] == reasoning
    assert [t for t in re.findall(r"</?(\w+)>", reasoning)] == [
        "SUMMARY", "SUMMARY", "CAPTION", "CAPTION", "REASONING", "REASONING"
    ]  # fmt: skip
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    # The design documents' body on the same path: the whole tagged answer, the same text (greedy).
    legacy = requests.post(
        server + "/v1/chat/completions",
        json={"image_base64": GREEN.split(",", 1)[1], "question": "Which colour is this?"},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    tagged = legacy.json()["response"]
    assert legacy.status_code == 200 and tagged.startswith("<SUMMARY>") and "<CONCLUSION>" in tagged
    assert colour_of(tagged.split("<CONCLUSION>")[1]) == "green"


def test_streaming_sends_the_stages_then_the_answer_then_the_finish_and_usage(client: openai.OpenAI) -> None:
    messages = ask("Describe this picture in detail.", GREEN)  # a long answer: many chunks
    whole = client.chat.completions.create(model="tiny", messages=messages, **GREEDY).choices[0].message
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=messages, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    kinds, reasoning, content = [], "", ""
    for chunk in chunks[:-1]:
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        if extra.get("reasoning_content"):
            assert extra["reasoning"] == extra["reasoning_content"]
            reasoning += extra["reasoning_content"]
            assert not re.search(r"<[^>]*$", reasoning), f"half a tag was sent: {reasoning[-20:]!r}"
            kinds.append("reasoning")
        if delta.content:
            content += delta.content
            kinds.append("content")
    assert "reasoning" in kinds and "content" in kinds
    assert kinds == sorted(kinds, key=lambda k: k == "content"), "an answer chunk came before a stage chunk"
    assert len([k for k in kinds if k == "reasoning"]) >= 2, "the stages were not streamed"
    assert reasoning == whole.model_extra["reasoning_content"] and content == whole.content
    assert [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason] == ["stop"]
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens > 0


def test_the_async_client_answers_several_at_once_and_streams(server: str) -> None:
    colours = ["red", "blue", "yellow", "white"]

    async def run() -> tuple[list[str | None], str]:
        aclient = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
        calls = [
            aclient.chat.completions.create(
                model="tiny", messages=ask("What colour?", data_url(solid_image(c, 50 + 9 * i, 70))), **GREEDY
            )
            for i, c in enumerate(colours)
        ]
        replies = await asyncio.gather(*calls)
        stream = await aclient.chat.completions.create(model="tiny", messages=ask("Colour?", GREEN), stream=True)
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
        await aclient.close()
        return [colour_of(r.choices[0].message.content) for r in replies], text

    answers, streamed = asyncio.run(run())
    assert answers == colours
    assert colour_of(streamed) == "green"


def test_plain_http_streams_server_sent_events_ending_in_done(server: str) -> None:
    body = {"model": "tiny", "messages": ask("What colour?", GREEN), "stream": True, **GREEDY}
    with requests.post(
        server + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, stream=True, timeout=60
    ) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = [line for line in reply.iter_lines(decode_unicode=True) if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert "usage" not in chunks[-1] and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert colour_of(content) == "green"


def test_a_wrong_or_missing_key_is_401(server: str) -> None:
    wrong = openai.OpenAI(base_url=server + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="Authorization: Bearer"):
        wrong.chat.completions.create(model="tiny", messages=ask("What colour?", GREEN))
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    bare = requests.get(server + "/v1/models", timeout=10)
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(server + "/health", timeout=10).status_code == 200  # the rest of the server is not keyed


def test_earlier_turns_are_turns_of_the_chat_template_and_a_system_message_is_folded_into_the_question(
    client: openai.OpenAI,
) -> None:
    messages = [
        *ask("What colour is it?", GREEN),
        {"role": "assistant", "content": "The image is green."},
        {"role": "user", "content": "Are you sure about the colour?"},
    ]
    reply = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    alone = client.chat.completions.create(
        model="tiny", messages=ask("Are you sure about the colour?", GREEN), **GREEDY
    )
    # The earlier turn is in the prompt as the template writes it: its question, its answer, then this one.
    assert reply.usage.prompt_tokens > alone.usage.prompt_tokens
    caption = re.search(r"<CAPTION>(.*?)</CAPTION>", reply.choices[0].message.model_extra["reasoning_content"], re.S)
    assert caption and colour_of(caption.group(1)) == "green", reply.choices[0].message
    briefly = [{"role": "system", "content": "Answer briefly."}, *messages]
    assert client.chat.completions.create(model="tiny", messages=briefly, **GREEDY).usage.prompt_tokens > (
        reply.usage.prompt_tokens
    )
    briefly[-1]["content"] = "why " * 499  # fits alone; the system message folded in makes it too long
    with pytest.raises(openai.BadRequestError, match="too long .* system messages are folded into the question"):
        client.chat.completions.create(model="tiny", messages=briefly, **GREEDY)
    messages[1]["content"] = "green " * 5000
    with pytest.raises(openai.BadRequestError, match="conversation history is too long"):
        client.chat.completions.create(model="tiny", messages=messages, **GREEDY)


def _png_claiming(width: int, height: int) -> str:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(png).decode()


def with_(**changes) -> dict:
    return {"model": "tiny", "messages": ask("What colour?", GREEN), **GREEDY, **changes}


FROM_ASSISTANT = [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": GREEN}}]}]
BAD = [  # (name, body, param, expected message text)
    ("not json", b"{'model': 'tiny'", None, "not valid JSON"),
    ("not an object", b"[1, 2]", None, "must be a JSON object"),
    ("no messages", with_(messages=None), "messages", "messages must be a non-empty list"),
    ("no image", with_(messages=[{"role": "user", "content": "What colour?"}]), "messages", "found none"),
    ("two images", with_(messages=ask("q", GREEN) + ask("q", GREEN)), "messages", "exactly one image .* found 2"),
    ("remote image", with_(messages=ask("q", "https://example.com/cat.png")), "messages[0].content[1]",
     "does not fetch image URLs.*--api-remote-images"),
    ("file url", with_(messages=ask("q", "file:///etc/passwd")), "messages[0].content[1]", "must be a data: URL"),
    ("bad base64", with_(messages=ask("q", "data:image/png;base64,@@@@")), "messages[0].content[1]", "not valid base64"),
    ("not an image", with_(messages=ask("q", "data:image/png;base64," + base64.b64encode(b"hello").decode())),
     "messages[0].content[1]", "not an image"),
    ("pixel bomb", with_(messages=ask("q", _png_claiming(9000, 9000))), "messages[0].content[1]", "megapixels"),
    ("empty question", with_(messages=ask("  ", GREEN)), "messages", "type a question"),
    ("question too long", with_(messages=ask("why " * 600, GREEN)), "messages", "too long"),
    ("temperature", with_(temperature=5), "temperature", "temperature must be a number from 0 to 2"),
    ("top_p", with_(top_p=2), "top_p", "top_p must be a number from 0 to 1"),
    ("zero tokens", with_(max_tokens=0), "max_tokens", "max_tokens must be a whole number from 1 to 2048"),
    ("too many tokens", with_(max_tokens=None, max_completion_tokens=10**6), "max_completion_tokens",
     "max_completion_tokens must be a whole number from 1"),
    ("seed", with_(seed="abc"), "seed", "seed must be a whole number"),
    ("n", with_(n=2), "n", "n is not supported .*n must be 1"),
    ("tools", with_(tools=[{"type": "function", "function": {"name": "f"}}]), "tools", "tools is not supported"),
    ("response_format", with_(response_format={"type": "json_object"}), "response_format", "not supported"),
    ("logprobs", with_(logprobs=True), "logprobs", "logprobs is not supported"),
    ("presence penalty", with_(presence_penalty=0.5), "presence_penalty", "presence_penalty is not supported"),
    ("stop", with_(stop=["</CONCLUSION>"]), "stop", "stop is not supported"),
    ("unknown option", with_(best_of=3), "best_of", "best_of is not supported"),
    ("stream not bool", with_(stream="yes"), "stream", "stream must be true or false"),
    ("stream_options alone", with_(stream_options={"include_usage": True}), "stream_options", "only allowed when"),
    ("reasoning", with_(reasoning="deep"), "reasoning", "reasoning must be one of 'normal', 'stage-beam'"),
    ("beams alone", with_(beams=4), "beams", "beams applies only with"),
    ("too many beams", with_(reasoning="stage-beam", beams=12), "beams", "beams must be a whole number from 2 to 8"),
    ("tool message", with_(messages=[{"role": "tool", "content": "x"}]), "messages[0]", "role 'tool' is not supported"),
    ("ends with the assistant", with_(messages=ask("q", GREEN) + [{"role": "assistant", "content": "x"}]),
     "messages", "last message must be the user's question"),
    ("audio part", with_(messages=[{"role": "user", "content": [{"type": "input_audio"}]}]), "messages[0].content[0]",
     "'input_audio' are not supported"),
    ("image from the assistant", with_(messages=FROM_ASSISTANT + ask("q", GREEN)), "messages[0].content[0]",
     "only user messages may hold an image"),
    ("legacy extra key", {"image_base64": "aGk=", "question": "q", "temperature": 0}, "temperature",
     "not part of the image_base64/question body"),
    ("legacy bad image", {"image_base64": base64.b64encode(b"text").decode(), "question": "q"}, "image_base64",
     "not an image"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "body", "param", "expected"), BAD, ids=[case[0] for case in BAD])
def test_bad_requests_get_a_400_naming_the_problem(server: str, name, body, param, expected) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    data = body if isinstance(body, bytes) else json.dumps(body)
    reply = requests.post(server + "/v1/chat/completions", data=data, headers=headers, timeout=30)
    error = reply.json()["error"]
    assert reply.status_code == 400, (reply.status_code, error)
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_request"
    assert error["param"] == param and re.search(expected, error["message"]), error


def test_bad_requests_leave_good_ones_alone_and_are_counted(client: openai.OpenAI, server: str) -> None:
    refused = metric(server, 'vlm_requests_total{outcome="invalid_request"}')
    headers = {"Authorization": f"Bearer {KEY}"}
    with ThreadPoolExecutor(8) as pool:
        good = [
            pool.submit(  # the options OpenAI clients send at their "off" values are accepted
                client.chat.completions.create, n=1, presence_penalty=0, logprobs=False, user="u1",
                model="tiny", messages=ask("What colour?", GREEN), **GREEDY,
            )
            for _ in range(4)
        ]  # fmt: skip
        bad = [
            pool.submit(requests.post, server + "/v1/chat/completions", json=body, headers=headers, timeout=30)
            for _, body, _, _ in BAD
            if isinstance(body, dict)
        ]
        assert all(b.result().status_code == 400 for b in bad)
        assert all(colour_of(g.result().choices[0].message.content) == "green" for g in good)
    assert metric(server, 'vlm_requests_total{outcome="invalid_request"}') >= refused + len(bad)


def test_a_client_that_goes_away_frees_its_model_row(server: str) -> None:
    cancelled = ended(server, "cancelled")
    body = {"model": "tiny", "messages": ask("Describe this picture in detail.", GREEN), "stream": True, **GREEDY}
    with requests.post(
        server + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, stream=True, timeout=60
    ) as reply:
        next(reply.iter_lines())  # it is running; now hang up
    wait_until(lambda: ended(server, "cancelled") != cancelled, 30, fail=False)
    assert ended(server, "cancelled") == cancelled + 1, "the abandoned answer kept its model row"


def test_a_caller_past_its_cap_gets_a_429_saying_why_and_another_caller_goes_on(tiny_dir: str) -> None:
    """The ``user`` field names the caller: while one of its answers streams, its next is refused at once
    with 429 ``too_many_requests`` (the reason in OpenAI's error shape, ``Retry-After``), and another caller's
    answer is served."""
    with running_app("--max-per-client", "1", "--response-cache-mb", "0") as url:
        body = {"model": "tiny", "messages": ask("Describe this picture in detail.", GREEN), "stream": True, **GREEDY}
        slow = {**body, "user": "ann", "reasoning": "stage-beam", "beams": 8, "temperature": 1.0}  # seconds long
        with requests.post(url + "/v1/chat/completions", json=slow, stream=True, timeout=60) as first:
            assert first.status_code == 200, first.text
            lines = first.iter_lines()  # held: a dropped line iterator closes the stream, and the answer with it
            next(lines)  # ann's answer is running
            again = requests.post(
                url + "/v1/chat/completions", json={**body, "stream": False, "user": "ann"}, timeout=60
            )
            other = requests.post(
                url + "/v1/chat/completions", json={**body, "stream": False, "user": "bob"}, timeout=60
            )
        assert again.status_code == 429 and again.headers["Retry-After"] == "1", again.text
        error = again.json()["error"]
        assert error["code"] == "too_many_requests" and "You already have 1 answer in progress" in error["message"]
        assert other.status_code == 200 and colour_of(other.json()["choices"][0]["message"]["content"]) == "green"


async def _mcp(url: str, calls: list[dict], key: str = KEY) -> tuple[list, list]:
    """What an agent sees through the official ``mcp`` client over streamable HTTP: the tools, and the
    results of calling ``ask`` with each of ``calls``."""
    import httpx
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(120, read=300)) as http:
        async with streamable_http_client(url, http_client=http) as (read, write, _):
            async with ClientSession(read, write) as session:
                await session.initialize()
                tools = (await session.list_tools()).tools
                return tools, [await session.call_tool("ask", arguments) for arguments in calls]


def test_mcp_offers_one_described_tool_whose_answer_names_the_four_stages_conclusion_first(server: str) -> None:
    calls = [
        {"image": GREEN, "question": "What colour is it?", "max_new_tokens": 300, "temperature": 0},
        {"image": "data:image/png;base64,bm90IGFuIGltYWdl", "question": "What colour is it?"},  # "not an image"
        {"image": GREEN, "question": "What colour?", "temperature": 5},
        {"image": "file:///etc/passwd", "question": "What colour?"},
        {"image": GREEN, "question": "What colour?", "n": 2},
    ]
    tools, (answer, not_image, too_hot, local_file, unknown) = asyncio.run(_mcp(server + "/mcp", calls))
    assert [tool.name for tool in tools] == ["ask"], "the page's own endpoints (ask_page, ask_batch…) are not tools"
    (ask,) = tools
    assert "four stages" in ask.description and "stage-beam" in ask.description, ask.description
    properties = ask.inputSchema["properties"]
    assert {"image", "question", "max_new_tokens", "temperature", "top_p", "reasoning", "beams", "seed"} == set(
        properties
    )
    assert all(p["description"].strip() for p in properties.values()), properties
    assert "data URL" in properties["image"]["description"] and "http(s) URL" in properties["image"]["description"]
    assert properties["temperature"]["maximum"] == 2 and properties["temperature"]["default"] == 0.6
    assert "From 0 to 2. Default: 0.6." in properties["temperature"]["description"]
    assert properties["reasoning"]["enum"] == ["normal", "stage-beam"]
    assert ask.inputSchema["required"] == ["image", "question"]

    assert not answer.isError, answer.content
    text = answer.content[0].text
    assert text.startswith("CONCLUSION: "), text
    assert colour_of(text.split("\n\n")[0]) == "green", text
    for stage in ("SUMMARY: ", "CAPTION: ", "REASONING: "):
        assert f"\n\n{stage}" in text, text
    assert "<SUMMARY>" not in text and "</CONCLUSION>" not in text, "tags are not an agent's business"
    assert colour_of(answer.structuredContent["conclusion"]) == "green" and answer.structuredContent["summary"]

    for result, message in [
        (not_image, "Invalid input: "),
        (too_hot, "Invalid input: temperature must be a number from 0 to 2."),
        (local_file, "image must be an http(s) URL of an image file or a data: URL"),
        (unknown, "Unknown parameter 'n'; the ask tool takes: image, question, max_new_tokens"),
    ]:
        assert result.isError and message in result.content[0].text, result.content


def test_mcp_needs_the_api_key_and_answers_at_gradios_old_path_too(server: str) -> None:
    calls = [{"image": GREEN, "question": "What colour is it?", "max_new_tokens": 300, "temperature": 0}]
    tools, (answer,) = asyncio.run(_mcp(server + "/gradio_api/mcp/", calls))
    assert [tool.name for tool in tools] == ["ask"] and not answer.isError
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        reply = requests.post(server + "/mcp", json={}, headers=headers, timeout=10)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key", reply.text


def test_an_engine_death_mid_stream_ends_the_stream_with_an_error_event(server: str) -> None:
    """As the out-of-memory killer would: the stream ends with an error the client raises, not a hang; then it
    waits for the restarted engine, so the tests after it are served as before."""
    pid = requests.get(server + "/health", timeout=10).json()["details"]["engine_pid"]
    body = {"model": "tiny", "messages": ask("Describe this picture in detail.", GREEN), "stream": True}
    stream = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
        **body, max_tokens=2000, temperature=0
    )
    next(iter(stream))
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(openai.APIError, match="stopped unexpectedly"):
        for _ in stream:
            pass
    healthy = lambda: requests.get(server + "/health", timeout=10).status_code == 200  # noqa: E731
    wait_until(healthy, 60, every=0.2, what="the engine to come back")


def test_with_auth_and_no_key_the_api_is_closed_and_says_how_to_open_it(tiny_dir: str) -> None:
    with running_app("--auth", "alice:pw") as url:
        reply = requests.get(url + "/v1/models", timeout=10)
        assert reply.status_code == 401 and "--api-key" in reply.json()["error"]["message"]
        posted = requests.post(url + "/v1/chat/completions", json=with_(), timeout=10, auth=("alice", "pw"))
        assert posted.status_code == 401 and posted.json()["error"]["code"] == "api_key_required"


@pytest.mark.slow
def test_through_the_app_an_unseeded_sampled_answer_is_never_cached_and_a_seeded_one_is_replayed(tiny_dir: str) -> None:
    """Issue #50: the door drew a seed and validated again, so every sampled answer counted as seeded: a miss
    each time and an entry nobody could ask for again. Unseeded sampled twice: no lookup, nothing stored;
    seeded sampled twice: stored once, then replayed with the same text."""
    hit, miss = (f'vlm_cache_requests_total{{cache="response",result="{r}"}}' for r in ("hit", "miss"))
    with running_app("--response-cache-mb", "16") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

        def answer(**sampling) -> str:
            reply = client.chat.completions.create(model="tiny", messages=ask("Which colour is it?", GREEN), **sampling)
            return reply.choices[0].message.content

        for _ in range(2):
            answer(temperature=0.9, max_tokens=120)
        assert (metric(url, hit), metric(url, miss), metric(url, "vlm_response_cache_entries")) == (0, 0, 0)
        first = answer(temperature=0.9, max_tokens=120, seed=11)
        assert answer(temperature=0.9, max_tokens=120, seed=11) == first
        assert (metric(url, hit), metric(url, miss), metric(url, "vlm_response_cache_entries")) == (1, 1, 1)
        details = requests.get(url + "/health", timeout=10).json()["details"]
        assert (details["response_cache_hits"], details["response_cache_entries"]) == (1, 1)
