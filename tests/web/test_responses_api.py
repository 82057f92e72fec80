"""``/v1/responses`` end to end: ``python app.py --model tiny`` in a subprocess, driven by the official ``openai``
client (``responses.create``, ``stream=True``, ``responses.stream``, follow-ups by ``previous_response_id``,
retrieve and delete), plain HTTP for bad input, and schemathesis for what OpenAI's request body allows.

Every answer must name its held-out picture's colour in ``output_text``, with the first three stages in the
reasoning item; bad input must get a clear 4xx in OpenAI's error shape while a good request alongside completes.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import groupby

import openai
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from support import colour_of, data_url, ended, running_app, wait_until

from vlm_demo.cot.stages import parse_stages
from vlm_demo.models.tiny import solid_image

KEY = "sk-test-49"
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"temperature": 0, "max_output_tokens": 400}
GREEN = data_url(solid_image("green", 96, 64, noise=5, seed=3))  # held out: sizes and noise not trained on
RED = data_url(solid_image("red", 72, 88, noise=6, seed=11), "JPEG")


@pytest.fixture(scope="module")
def server(tiny_dir: str) -> Iterator[str]:
    # Each request reaches the engine (streaming, cancelling are tested): no response cache.
    with running_app("--api-key", KEY, "--max-batch-size", "8", "--response-cache-mb", "0") as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def ask(question: str, image_url: str | None = None) -> list[dict]:
    parts = [{"type": "input_text", "text": question}]
    if image_url is not None:
        parts.append({"type": "input_image", "image_url": image_url})
    return [{"role": "user", "content": parts}]


def test_the_client_names_the_colour_in_output_text_with_the_stages_in_the_reasoning_item(
    client: openai.OpenAI,
) -> None:
    reply = client.responses.create(model="tiny", input=ask("Which colour is this?", GREEN), **GREEDY)
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.status == "completed"
    assert colour_of(reply.output_text) == "green" and "<" not in reply.output_text, reply.output_text
    reasoning, message = reply.output
    assert reasoning.type == "reasoning" and message.type == "message" and message.role == "assistant"
    stages = [part.text for part in reasoning.content]
    assert [part.type for part in reasoning.content] == ["reasoning_text"] * 3
    assert [part.text for part in reasoning.summary] == stages and all(stages), reasoning
    assert colour_of(stages[1]) == "green" and not any("<" in s for s in stages), stages  # the CAPTION
    # The same answer as /v1/chat/completions gives (greedy): its reasoning_content's stages, its content.
    chat = client.chat.completions.create(
        model="tiny",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Which colour is this?"},
                    {"type": "image_url", "image_url": {"url": GREEN}},
                ],
            }
        ],
        temperature=0,
        max_tokens=400,
    ).choices[0]
    assert list(parse_stages(chat.message.model_extra["reasoning_content"]).as_tuple()[:3]) == stages
    assert chat.message.content == reply.output_text
    usage = reply.usage
    assert usage.input_tokens > 0 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens
    assert reply.temperature == 0 and reply.max_output_tokens == 400 and reply.store is True


def test_a_string_input_instructions_and_metadata(client: openai.OpenAI) -> None:
    """A string input is the question alone (no picture: a 400 saying how to send one); ``instructions`` go
    into the prompt (more input tokens); ``metadata`` and ``user`` come back as sent."""
    with pytest.raises(openai.BadRequestError, match="found none.*input_image"):
        client.responses.create(model="tiny", input="What colour is it?")
    plain = client.responses.create(model="tiny", input=ask("What colour is it?", GREEN), **GREEDY)
    told = client.responses.create(
        model="tiny",
        input=ask("What colour is it?", GREEN),
        instructions="Answer in one short sentence.",
        metadata={"ticket": "49"},
        user="ann",
        **GREEDY,
    )
    assert told.usage.input_tokens > plain.usage.input_tokens
    assert told.instructions == "Answer in one short sentence." and told.metadata == {"ticket": "49"}
    assert told.user == "ann" and colour_of(told.output_text) == "green"


def test_streaming_sends_reasoning_deltas_then_the_answer_and_ends_completed(client: openai.OpenAI) -> None:
    whole = client.responses.create(model="tiny", input=ask("Describe this picture in detail.", GREEN), **GREEDY)
    events = list(
        client.responses.create(
            model="tiny", input=ask("Describe this picture in detail.", GREEN), stream=True, **GREEDY
        )
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [kind for kind, _ in groupby(e.type for e in events)]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"], kinds
    assert kinds[-1] == "response.completed"
    first_answer = kinds.index("response.output_text.delta")
    assert "response.reasoning_text.delta" in kinds[:first_answer]
    assert "response.reasoning_summary_text.delta" in kinds[:first_answer]
    assert "response.reasoning_text.delta" not in kinds[first_answer:], "a stage's text came after the answer's"
    assert kinds.index("response.content_part.added", kinds.index("response.output_item.done")) < first_answer
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert len(deltas) >= 3, "the stages were not streamed"
    stages = ["".join(e.delta for e in deltas if e.content_index == i) for i in range(3)]
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert stages == [part.text for part in whole.output[0].content] == [p.text for p in done.output[0].content]
    assert answer == whole.output_text == done.output_text and colour_of(answer) == "green"
    assert not any("<" in e.delta for e in deltas), "a tag was sent"
    assert done.usage.output_tokens == whole.usage.output_tokens


def test_the_clients_stream_helper_gathers_the_final_response(client: openai.OpenAI) -> None:
    with client.responses.stream(model="tiny", input=ask("What colour is it?", GREEN), **GREEDY) as stream:
        texts = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text and colour_of(final.output_text) == "green"
    assert final.output[0].type == "reasoning" and len(final.output[0].summary) == 3


def test_a_follow_up_by_previous_response_id_answers_about_the_first_picture(client: openai.OpenAI) -> None:
    first = client.responses.create(model="tiny", input=ask("What colour is it?", RED), **GREEDY)
    assert colour_of(first.output_text) == "red", first.output_text
    again = client.responses.create(
        model="tiny", input="Are you sure about the colour?", previous_response_id=first.id, **GREEDY
    )
    assert again.previous_response_id == first.id and colour_of(again.output_text) == "red", again.output_text
    alone = client.responses.create(model="tiny", input=ask("Are you sure about the colour?", RED), **GREEDY)
    assert again.usage.input_tokens > alone.usage.input_tokens  # the earlier turn is in the prompt
    third = client.responses.create(model="tiny", input="And now?", previous_response_id=again.id, **GREEDY)
    assert third.usage.input_tokens > again.usage.input_tokens and colour_of(third.output_text) == "red"
    assert client.responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(openai.BadRequestError, match="holds its picture already"):
        client.responses.create(model="tiny", input=ask("And this one?", GREEN), previous_response_id=first.id)


def test_instructions_are_not_carried_over_and_store_false_keeps_nothing(client: openai.OpenAI) -> None:
    told = client.responses.create(
        model="tiny", input=ask("What colour is it?", GREEN), instructions="Be brief. " * 20, **GREEDY
    )
    plain = client.responses.create(model="tiny", input=ask("What colour is it?", GREEN), **GREEDY)
    after = [
        client.responses.create(model="tiny", input="Are you sure?", previous_response_id=r.id, **GREEDY)
        for r in (told, plain)
    ]
    assert after[0].usage.input_tokens == after[1].usage.input_tokens  # the same turns, no instructions
    unkept = client.responses.create(model="tiny", input=ask("What colour is it?", GREEN), store=False, **GREEDY)
    assert unkept.store is False and colour_of(unkept.output_text) == "green"
    with pytest.raises(openai.NotFoundError, match="store: false"):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.NotFoundError, match="No stored response"):
        client.responses.create(model="tiny", input="Sure?", previous_response_id=unkept.id)


def test_a_conversation_past_the_history_caps_is_refused_unless_truncation_is_auto(client: openai.OpenAI) -> None:
    turns = [{"role": "assistant", "content": "Green."}]  # nine earlier turns, the picture in the first
    for i in range(1, 9):
        turns += [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": "Green."}]
    long = [*ask("Question 0?", GREEN), *turns, *ask("And now?")]
    with pytest.raises(openai.BadRequestError, match="history is too long .*9 turns.* keep the newest"):
        client.responses.create(model="tiny", input=long, **GREEDY)
    kept = client.responses.create(model="tiny", input=long, truncation="auto", **GREEDY)
    assert kept.truncation == "auto" and colour_of(kept.output_text) == "green"
    again = client.responses.create(model="tiny", input="Sure?", previous_response_id=kept.id, truncation="auto")
    assert again.status == "completed" and again.usage.input_tokens <= kept.usage.input_tokens + 20


def test_delete_removes_a_response_and_unknown_ids_are_clear_404s(client: openai.OpenAI, server: str) -> None:
    made = client.responses.create(model="tiny", input=ask("What colour is it?", GREEN), **GREEDY)
    client.responses.delete(made.id)
    for call in (lambda: client.responses.retrieve(made.id), lambda: client.responses.delete(made.id)):
        with pytest.raises(openai.NotFoundError, match="No stored response 'resp_"):
            call()
    reply = requests.get(server + "/v1/responses/resp_nothing", headers=AUTH, timeout=10)
    error = reply.json()["error"]
    assert reply.status_code == 404 and error["code"] == "response_not_found" and error["param"] == "response_id"
    assert "kept 60 minutes" in error["message"]
    assert requests.get(server + "/v1/responses/" + made.id, timeout=10).status_code == 401  # the key first


NOT_AN_IMAGE = "data:image/png;base64," + base64.b64encode(b"hello").decode()


def body(**changes) -> dict:
    return {"model": "tiny", "input": ask("What colour?", GREEN), **GREEDY, **changes}


BAD = [  # (name, body, status, param, expected message text)
    ("not json", b"{'model'", 400, None, "not valid JSON"),
    ("no input", body(input=None), 400, "input", "input must be a non-empty list"),
    ("no picture", body(input=ask("What colour?")), 400, "input", "found none"),
    ("not an image", body(input=ask("q", NOT_AN_IMAGE)), 400, "input[0].content[1]", "not an image"),
    ("two pictures", body(input=ask("q", GREEN) + ask("q", GREEN)), 400, "input", "exactly one image .* found 2"),
    ("remote picture", body(input=ask("q", "https://example.com/cat.png")), 400, "input[0].content[1]",
     "does not fetch image URLs.*--api-remote-images"),
    ("file part", body(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]), 400,
     "input[0].content[0]", "'input_file' are not supported"),
    ("tool output item", body(input=[{"type": "function_call_output", "call_id": "c", "output": "x"}]), 400,
     "input[0]", "type 'function_call_output' is not supported"),
    ("bad id", body(input="Sure?", previous_response_id="resp_0000"), 404, "previous_response_id",
     "No stored response 'resp_0000'"),
    ("id not a string", body(previous_response_id=7), 400, "previous_response_id", "must be a string"),
    ("role a list", body(input=[{"role": ["user"], "content": "q"}]), 400, "input[0]", r"role \['user'\] is not"),
    ("part type a list", body(input=[{"role": "user", "content": [{"type": ["input_text"]}]}]), 400,
     "input[0].content[0]", "are not supported"),
    ("temperature", body(temperature=5), 400, "temperature", "temperature must be a number from 0 to 2"),
    ("tokens", body(max_output_tokens=0), 400, "max_output_tokens", "max_output_tokens must be a whole number"),
    ("tools", body(tools=[{"type": "web_search"}]), 400, "tools", "tools is not supported.*does not call tools"),
    ("background", body(background=True), 400, "background", "background is not supported"),
    ("json output", body(text={"format": {"type": "json_object"}}), 400, "text", "text is not supported.*four-stage"),
    ("effort", body(reasoning={"effort": "extreme"}), 400, "reasoning", "reasoning.effort must be one of"),
    ("metadata", body(metadata={"n": 1}), 400, "metadata", "metadata must be an object of at most 16 strings"),
    ("store not bool", body(store="yes"), 400, "store", "store must be true or false"),
    ("truncation", body(truncation="middle"), 400, "truncation", 'truncation must be "disabled" or "auto"'),
    ("model", body(model="gpt-4o"), 404, "model", "model 'gpt-4o' does not exist"),
    ("long instructions", body(instructions="why " * 600), 400, "input",
     "too long.*instructions and system messages are folded into the question"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "body", "status", "param", "expected"), BAD, ids=[case[0] for case in BAD])
def test_bad_requests_get_a_clear_4xx_naming_the_problem(server: str, name, body, status, param, expected) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body)
    reply = requests.post(
        server + "/v1/responses", data=data, headers={**AUTH, "Content-Type": "application/json"}, timeout=30
    )
    error = reply.json()["error"]
    assert reply.status_code == status, (reply.status_code, error)
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and re.search(expected, error["message"]), error


def test_bad_requests_leave_a_good_one_alongside_alone(client: openai.OpenAI, server: str) -> None:
    with ThreadPoolExecutor(6) as pool:
        good = pool.submit(
            lambda: list(client.responses.create(model="tiny", input=ask("What colour?", RED), stream=True, **GREEDY))
        )
        bad = [
            pool.submit(requests.post, server + "/v1/responses", json=b, headers=AUTH, timeout=30)
            for _, b, _, _, _ in BAD
            if isinstance(b, dict)
        ]
        assert all(400 <= b.result().status_code < 500 for b in bad)
        events = good.result()
    assert events[-1].type == "response.completed" and colour_of(events[-1].response.output_text) == "red"


def test_an_image_url_follows_the_remote_image_rules_of_chat_completions(tiny_dir: str) -> None:
    """With ``--api-remote-images`` an ``http(s)`` picture is fetched under the same rules: public addresses only
    (a loopback one is refused before any connection); a follow-up by id would reuse what was fetched."""
    with running_app("--api-remote-images", "--response-cache-mb", "0") as url:
        reply = requests.post(url + "/v1/responses", json=body(input=ask("What colour?", url + "/health")), timeout=30)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "input[0].content[1]", error
    assert "non-public address" in error["message"], error


def test_a_client_that_goes_away_frees_its_model_row(server: str) -> None:
    cancelled = ended(server, "cancelled")
    streamed = body(input=ask("Describe this picture in detail.", GREEN), stream=True)
    with requests.post(server + "/v1/responses", json=streamed, headers=AUTH, stream=True, timeout=60) as reply:
        next(reply.iter_lines())  # it is running; now hang up
    wait_until(lambda: ended(server, "cancelled") != cancelled, 30, fail=False)
    assert ended(server, "cancelled") == cancelled + 1, "the abandoned answer kept its model row"


def test_an_engine_death_mid_stream_ends_it_with_response_failed_and_keeps_nothing(
    client: openai.OpenAI, server: str
) -> None:
    """As the out-of-memory killer would: the stream's last event is ``response.failed`` with the error, nothing
    is stored; then it waits for the restarted engine, so the tests after it are served as before."""
    pid = requests.get(server + "/health", timeout=10).json()["details"]["engine_pid"]
    stream = client.responses.create(
        model="tiny", input=ask("Describe this picture in detail.", GREEN), stream=True, max_output_tokens=2000
    )
    first = next(iter(stream))
    os.kill(pid, signal.SIGKILL)
    last = list(stream)[-1]
    assert last.type == "response.failed" and last.response.status == "failed", last
    assert last.response.error.code == "engine_stopped" and "stopped unexpectedly" in last.response.error.message
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.response.id)
    healthy = lambda: requests.get(server + "/health", timeout=10).status_code == 200  # noqa: E731
    wait_until(healthy, 60, every=0.2, what="the engine to come back")


# ---- schemathesis --------------------------------------------------------------------------------------------

PART_TEXT = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"enum": ["input_text"]}, "text": {"type": "string"}},
}
PART_IMAGE = {
    "type": "object",
    "required": ["type"],
    "properties": {
        "type": {"enum": ["input_image"]},
        "image_url": {"anyOf": [{"type": ["string", "null"]}, {"const": GREEN}]},  # a real picture too
        "file_id": {"type": ["string", "null"]},
        "detail": {"enum": ["low", "high", "auto"]},
    },
}
MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "type": {"anyOf": [{"enum": ["message"]}, {}]},  # and anything else a careless client sends
        "role": {"anyOf": [{"enum": ["user", "assistant", "system", "developer"]}, {}]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": [PART_TEXT, PART_IMAGE, {}]}}]},
    },
}
CREATE_RESPONSE = {  # OpenAI's CreateResponse request body, in short: its field names and types
    "type": "object",
    "properties": {
        "model": {"enum": ["tiny", None]},  # another name is a 404 before anything else is read
        "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": MESSAGE}]},
        "instructions": {"type": ["string", "null"]},
        "max_output_tokens": {"type": ["integer", "null"]},
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        "top_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
        "stream": {"type": ["boolean", "null"]},
        "store": {"type": ["boolean", "null"]},
        "previous_response_id": {"type": ["string", "null"]},
        "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string", "maxLength": 512}},
        "user": {"type": "string"},
        "truncation": {"enum": ["auto", "disabled", None]},
        "parallel_tool_calls": {"type": ["boolean", "null"]},
        "background": {"type": ["boolean", "null"]},
        "include": {"type": ["array", "null"], "items": {"type": "string"}},
        "reasoning": {
            "type": ["object", "null"],
            "properties": {
                "effort": {"enum": ["minimal", "low", "medium", "high", None]},
                "summary": {"enum": ["auto", "concise", "detailed", None]},
            },
        },
        "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]}, {"type": "object"}]},
        "tools": {"type": "array", "items": {"type": "object"}},
        "text": {"type": "object"},
    },
}
REFUSED = ("parallel_tool_calls", "background", "include", "tool_choice", "tools", "text")  # but at "off"
ANSWERED = {  # the options this server implements, about a real picture: most bodies reach the model
    **CREATE_RESPONSE,
    "required": ["input"],
    "properties": {
        **{k: v for k, v in CREATE_RESPONSE["properties"].items() if k not in REFUSED},
        "input": {"const": ask("What colour?", GREEN)},
        "max_output_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": 400},
    },
}


def described(body: dict, get_and_delete: bool) -> dict:
    """An OpenAPI description of ``/v1/responses`` with this request body."""
    paths = {
        "/v1/responses": {
            "post": {
                "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
                "responses": {"200": {"description": "a response, or its stream of events"}},
            }
        }
    }
    if get_and_delete:
        paths["/v1/responses/{response_id}"] = {
            method: {
                "parameters": [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "the stored response, or that it was deleted"}},
            }
            for method in ("get", "delete")
        }
    return {
        "openapi": "3.1.0",
        "info": {"title": "/v1/responses, as OpenAI describes it", "version": "1"},
        "paths": paths,
    }


fuzzed = schemathesis.openapi.from_dict(described(CREATE_RESPONSE, get_and_delete=True))
answered = schemathesis.openapi.from_dict(described(ANSWERED, get_and_delete=False))
answered.config.max_stream_events = 10_000  # schemathesis reads 20 events of a stream by default: read it all


@fuzzed.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_openais_request_body_fuzzed_gets_no_server_error(case, server: str) -> None:
    """Bodies that OpenAI's published description of ``POST /responses`` allows (its field names and types,
    written here in our own words and cut to what a request may carry; the published file is not copied), and
    ``GET``/``DELETE /responses/{id}`` with any id: never a 5xx. Most are refused (a 4xx); none may break the
    server. Some carry a real picture and reach the model. Bounded: 40 examples per operation, each request
    60 s at most."""
    reply = case.call(base_url=server, headers=AUTH, timeout=60)
    assert reply.status_code < 500, (reply.status_code, reply.text[:500], reply.request.method, reply.request.url)
    if reply.status_code >= 400 and reply.request.method in ("GET", "POST", "DELETE"):  # not schemathesis' TRACE
        assert "error" in reply.json() and reply.json()["error"]["message"], (reply.status_code, reply.text[:500])


@answered.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_option_this_server_implements_fuzzed_about_a_real_picture_gets_no_server_error(
    case, server: str
) -> None:
    """The same description cut to the options implemented here, with a real picture: most bodies are answered
    (at once or streamed, stored or not, any instructions, metadata, sampling, reasoning effort), none with a
    5xx; a stream ends with its response's last event. Bounded: 25 examples, each request 120 s at most."""
    reply = case.call(base_url=server, headers=AUTH, timeout=120)
    assert reply.status_code < 500, (reply.status_code, reply.text[:500])
    if reply.status_code == 200 and "event-stream" in str(reply.headers.get("content-type")):
        last = [line for line in reply.text.splitlines() if line.startswith("event: ")][-1]
        assert last in ("event: response.completed", "event: response.incomplete"), reply.text[-500:]
