"""End to end over HTTP: ``python app.py --model tiny`` in a subprocess, driven by gradio_client.

Held-out images (sizes, aspect ratios and noise the tiny model was not trained on) and held-out
questions go to ``/ask`` (streaming) and ``/ask_batch`` (Gradio batch mode) at the same time; every
answer must name its own colour and equal the answer the same request gets alone (greedy), the
metrics must show that the engine really batched, and hostile input must get specific errors while
the good requests in the same burst still succeed.
"""

from __future__ import annotations

import io
import json
import os
import signal
import struct
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import requests
from gradio_client import Client, handle_file
from PIL import Image
from support import ended, metric, running_app, wait_until

from vlm_demo.config import DEFAULT_MODEL, TINY, load_config
from vlm_demo.models.choice import choose_model
from vlm_demo.models.tiny import solid_image
from vlm_demo.web.server import open_share_link

GREEDY = (160, 0.0, 1.0)  # max_new_tokens, temperature (0 = greedy), top_p
MAX_QUESTION = 2000  # Config.max_question_chars default


@pytest.fixture(scope="module")
def server(tiny_dir: str) -> Iterator[str]:
    """One tiny-model server for this module (default batching mode, batches of up to 8)."""
    # Every request must reach the engine here (batching, cancelling): no per-client cap, no response cache.
    with running_app(
        "--max-batch-size", "8", "--max-queue", "256", "--max-per-client", "0", "--response-cache-mb", "0"
    ) as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> Client:
    return Client(server, verbose=False)


def save(image: Image.Image, path: Path, fmt: str = "PNG", **kwargs) -> str:
    image.save(path, fmt, **kwargs)
    return str(path)


def colour_of(conclusion: str) -> str | None:
    words = [c for c in ("red", "green", "blue", "yellow", "white", "black") if c in conclusion.lower()]
    return words[0] if len(words) == 1 else None


# Held out: sizes, shapes, noise and questions that the tiny model's training never used verbatim.
HELD_OUT = [
    ("red", 37, 53, 0, "Which hue fills this picture?"),
    ("green", 300, 22, 6, "what is in the photo"),
    ("blue", 25, 410, 0, "Tell me the colour, please."),
    ("yellow", 129, 131, 9, "Is there anything here?"),
    ("white", 64, 48, 0, "Name the dominant color"),
    ("black", 90, 90, 4, "Explain what you observe?"),
    ("red", 512, 300, 12, "Quel est le sujet ?"),
    ("blue", 48, 48, 0, "colour?"),
]


@pytest.fixture(scope="module")
def held_out(tmp_path_factory) -> list[tuple[str, str, str]]:
    folder = tmp_path_factory.mktemp("held_out")
    cases = []
    for i, (colour, w, h, noise, question) in enumerate(HELD_OUT):
        path = save(solid_image(colour, w, h, noise=noise, seed=i), folder / f"{i}_{colour}.png")
        cases.append((colour, path, question))
    return cases


def ask_alone(client: Client, path: str, question: str, api: str = "/ask") -> tuple:
    return client.predict(handle_file(path), question, *GREEDY, api_name=api)


def test_no_gpu_and_no_model_chosen_falls_back_to_tiny_with_a_banner() -> None:
    config, notice = choose_model(load_config([]), cuda=False)
    assert config.model == TINY and notice and "No GPU" in notice and DEFAULT_MODEL in notice
    chosen, notice = choose_model(load_config(["--model", "/models/llava-cot"]), cuda=False)
    assert chosen.model == "/models/llava-cot" and notice is None  # an explicit choice is respected
    real, notice = choose_model(load_config([]), cuda=True)
    assert real.model == DEFAULT_MODEL and notice is None
    tiny, notice = choose_model(load_config(["--model", "tiny"]), cuda=True)
    assert tiny.model == TINY and "tiny offline test model" in (notice or "")


def test_share_link_failure_warns_and_returns(monkeypatch, caplog) -> None:
    import gradio.networking

    # Fault injection: point Gradio's share API at a closed local port, as if offline.
    monkeypatch.setattr(gradio.networking, "GRADIO_API_SERVER", "http://127.0.0.1:9/tunnel-request")
    started = time.monotonic()
    assert open_share_link("0.0.0.0", 7860) is None
    assert time.monotonic() - started < 10
    assert "could not create a share link" in caplog.text and "still serving" in caplog.text


def test_health_reports_the_contract_keys(server: str) -> None:
    reply = requests.get(server + "/health", timeout=10)
    body = reply.json()
    assert reply.status_code == 200
    assert {"status", "backend", "model", "ready", "queue_depth"} <= body.keys()
    assert body["status"] == "ok" and body["ready"] is True
    assert body["backend"] == "engine-process" and body["model"] == "tiny"
    assert isinstance(body["queue_depth"], int)


def test_metrics_endpoint_is_prometheus_text(server: str) -> None:
    reply = requests.get(server + "/metrics", timeout=10)
    assert reply.headers["content-type"].startswith("text/plain")
    for name in ("vlm_requests_total", "vlm_queue_depth", "vlm_batch_size", "vlm_request_latency_seconds"):
        assert f"# TYPE {name.removesuffix('_total')}" in reply.text


@pytest.mark.slow
def test_the_engine_moves_no_rows_cache_and_reads_only_live_bytes(server: str, tmp_path: Path) -> None:
    """A burst of answers that join and leave all the time (unique noisy pictures of one to four tiles, short
    and long answers) through the running app: the page pool's counters on /metrics show no key/value bytes
    moved for anyone's join or leave, and decode attention reading little more than the rows' own tokens."""
    before = {name: metric(server, f"vlm_{name}_total") for name in ("kv_copied_bytes", "kv_written_bytes")}
    read_before = metric(server, "vlm_attention_read_bytes_total")
    live_before = metric(server, "vlm_attention_live_bytes_total")
    sizes = [(20, 20), (300, 40), (40, 300), (64, 64), (700, 60), (33, 47), (128, 96), (90, 500)]
    questions = ["Colour?", "Describe this picture in detail.", "What colour is this image?", "what do you see"]
    jobs = []
    for i in range(24):
        (w, h), colour = sizes[i % len(sizes)], ("red", "green", "blue", "yellow", "white", "black")[i % 6]
        path = save(solid_image(colour, w, h, noise=9, seed=100 + i), tmp_path / f"{i}.png")
        jobs.append((path, questions[i % len(questions)], 40 + 37 * (i % 7)))

    def ask(job: tuple[str, str, int]) -> str:
        client = Client(server, verbose=False)
        return client.predict(handle_file(job[0]), job[1], job[2], 0.0, 1.0, api_name="/ask")[4]

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(ask, jobs))
    assert all("<SUMMARY>" in a for a in answers)
    written = metric(server, "vlm_kv_written_bytes_total") - before["kv_written_bytes"]
    copied = metric(server, "vlm_kv_copied_bytes_total") - before["kv_copied_bytes"]
    read = metric(server, "vlm_attention_read_bytes_total") - read_before
    live = metric(server, "vlm_attention_live_bytes_total") - live_before
    assert written > 0 and copied <= 2 * written, (copied, written)
    assert live > 0 and read <= 1.2 * live, (read, live)


def test_the_vision_tower_runs_each_pictures_real_tiles_only(server: str, client: Client, tmp_path: Path) -> None:
    """Unseen pictures of 1, 2 and 4 tiles through the running app: ``vlm_vision_tiles_total`` grows by exactly
    their real tiles (7, not 12), one picture each on ``vlm_vision_encodes_total``, and each answer names its
    colour."""
    cases = [("yellow", 13, 11), ("blue", 36, 18), ("green", 57, 61)]  # 16-px tiles: 1, 2 and 4 of them
    tiles, encodes = metric(server, "vlm_vision_tiles_total"), metric(server, "vlm_vision_encodes_total")
    for i, (colour, width, height) in enumerate(cases):
        path = save(solid_image(colour, width, height, noise=5, seed=70 + i), tmp_path / f"{i}.png")
        answer = client.predict(handle_file(path), "Which colour do you see here?", *GREEDY, api_name="/ask")
        assert colour_of(answer[3]) == colour, answer
    assert metric(server, "vlm_vision_tiles_total") - tiles == 1 + 2 + 4
    assert metric(server, "vlm_vision_encodes_total") - encodes == 3


def gauge_peak(server: str, name: str, ask: Iterator | list) -> float:
    """The highest value a ``/metrics`` gauge shows while ``ask`` (answers being asked) runs."""
    import threading

    peak, done = [0.0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], metric(server, name))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        answers = list(ask)
    finally:
        done.set()
        watcher.join(timeout=5)
    assert all("<SUMMARY>" in a for a in answers), answers
    return peak[0]


def test_answers_about_one_picture_hold_its_states_once(server: str, tmp_path: Path) -> None:
    """Eight visitors asking about one picture at once hold its cross-attention states once
    (``vlm_picture_states_bytes`` at most 1.5× one picture's), eight distinct pictures of the same tile count eight
    times (at least 6×), and nothing once they are done."""

    def ask(job: tuple[str, str]) -> str:
        return Client(server, verbose=False).predict(handle_file(job[0]), job[1], 300, 0.0, 1.0, api_name="/ask")[4]

    def picture(i: int) -> str:
        return save(solid_image("red", 57, 61, noise=9, seed=300 + i), tmp_path / f"p{i}.png")  # 4 tiles

    one = gauge_peak(server, "vlm_picture_states_bytes", map(ask, [(picture(0), "What colour is this image?")]))
    same = [(picture(1), q) for q in ("Colour?", "What colour is this image?", "Describe this picture in detail.",
                                      "what do you see")] * 2  # fmt: skip
    with ThreadPoolExecutor(8) as pool:
        shared = gauge_peak(server, "vlm_picture_states_bytes", pool.map(ask, same))
    with ThreadPoolExecutor(8) as pool:
        distinct = gauge_peak(
            server, "vlm_picture_states_bytes", pool.map(ask, [(picture(2 + i), "Colour?") for i in range(8)])
        )
    assert one > 0 and shared <= 1.5 * one, (shared, one)
    assert distinct >= 6 * one, (distinct, one)
    wait_until(lambda: metric(server, "vlm_picture_states_bytes") == 0, 30, what="the pictures' pages to go")


def test_ask_streams_the_four_stages(client: Client, held_out) -> None:
    colour, path, _ = held_out[0]
    # A long answer (~240 tokens: "detail"), so even a fast machine sends several updates while it streams.
    job = client.submit(handle_file(path), "Describe this picture in detail.", 400, 0.0, 1.0, api_name="/ask")
    final = job.result(timeout=60)
    updates = job.outputs()
    assert len(updates) >= 3, "the panels should fill progressively"
    assert any(u[0] and not u[3] for u in updates), "no update showed the SUMMARY before the CONCLUSION"
    summary, caption, reasoning, conclusion, raw = final[:5]
    assert summary and caption and reasoning and colour_of(conclusion) == colour
    assert "<SUMMARY>" in raw and "<CONCLUSION>" in raw  # raw keeps the tags; the panels never do
    for update in updates:
        assert not any("<" in (panel or "") for panel in update[:4]), update
    assert "batch of" in final[5] and "tokens/s" in final[5]


def test_concurrent_ask_and_ask_batch_match_single_runs(server: str, client: Client, held_out) -> None:
    alone = {path: ask_alone(client, path, q)[:5] for _, path, q in held_out}
    for colour, path, _ in held_out:
        assert colour_of(alone[path][3]) == colour, (colour, alone[path])
    batches_before = metric(server, "vlm_batch_size_count")
    rows_before = metric(server, "vlm_batch_size_sum")

    jobs = []
    for _, path, q in held_out * 2:
        for api in ("/ask", "/ask_batch"):
            jobs.append((path, api, client.submit(handle_file(path), q, *GREEDY, api_name=api)))
    for path, api, job in jobs:
        assert tuple(job.result(timeout=120)[:5]) == alone[path], (api, path)

    batches = metric(server, "vlm_batch_size_count") - batches_before
    rows = metric(server, "vlm_batch_size_sum") - rows_before
    # One observation per model batch (dynamic mode) or per decoding step (continuous mode).
    assert batches > 0 and rows / batches > 1.5, f"mean batch size {rows / batches:.2f}: the engine did not batch"


def test_ask_batch_item_errors_stay_in_their_own_rows(client: Client, held_out) -> None:
    colour, path, question = held_out[1]
    good = [client.submit(handle_file(path), question, *GREEDY, api_name="/ask_batch") for _ in range(3)]
    bad = [
        client.submit(handle_file(path), "   ", *GREEDY, api_name="/ask_batch"),
        client.submit(None, question, *GREEDY, api_name="/ask_batch"),
        client.submit(handle_file(path), question, 0, 0.0, 1.0, api_name="/ask_batch"),
    ]
    for job in good:
        out = job.result(timeout=60)
        assert colour_of(out[3]) == colour and out[5].startswith("Done")
    messages = [job.result(timeout=60)[5] for job in bad]
    assert "type a question" in messages[0]
    assert "upload an image" in messages[1]
    assert "max_new_tokens must be a whole number from 1 to" in messages[2]
    assert all(m.startswith("Error (invalid_request)") for m in messages)


def test_think_harder_streams_each_stages_candidates_then_the_winners(client: Client, held_out) -> None:
    """Stage-level beam search through /ask and the engine process: while a stage is written its panel
    shows the candidates; the final panels hold the winners and beams_html marks one per stage."""
    _, path, _ = held_out[3]
    job = client.submit(
        handle_file(path), "Describe this image in detail.", 1024, 0.0, 1.0, "stage-beam", 3, api_name="/ask"
    )  # fmt: skip  (greedy: the candidates sample at the paper's 0.6 / 0.9)
    final = job.result(timeout=180)
    updates = job.outputs()
    assert any("[Candidate 3]" in update[2] for update in updates), "the REASONING candidates were never shown"
    assert all(final[:4]) and "[Candidate" not in "".join(final[:4]), final[:4]
    assert 'data-phase="done"' in final[8] and final[8].count("✓ chosen") == 4, final[8]
    assert "Thought harder: 3 candidates per stage" in final[5], final[5]
    batch = client.predict(handle_file(path), "What colour?", 300, 1.0, 1.0, "stage-beam", 2, api_name="/ask_batch")
    assert batch[5].startswith("Done") and batch[8].count("✓ chosen") == 4, batch[5]
    bad = client.predict(handle_file(path), "What colour?", 300, 1.0, 1.0, "stage-beam", 12, api_name="/ask_batch")
    assert "beams must be a whole number from 2 to 8" in bad[5]


def test_a_raw_http_client_may_leave_out_the_optional_inputs(server: str, held_out) -> None:
    """Scripts written for the first five inputs keep working over plain HTTP (gradio_client fills them in)."""
    colour, path, question = held_out[4]
    with open(path, "rb") as fh:
        uploaded = requests.post(f"{server}/gradio_api/upload", files={"files": fh}, timeout=30).json()[0]
    image = {"path": uploaded, "meta": {"_type": "gradio.FileData"}}
    for api in ("ask", "ask_batch"):
        event = requests.post(f"{server}/gradio_api/call/{api}", json={"data": [image, question, *GREEDY]}, timeout=30)
        body = requests.get(f"{server}/gradio_api/call/{api}/{event.json()['event_id']}", timeout=120).text
        last = [line for line in body.splitlines() if line.startswith("data:")][-1]
        outputs = json.loads(last[len("data:") :])
        assert len(outputs) == 9 and colour_of(outputs[3]) == colour, (api, body[-500:])


# ---- hostile input ----------------------------------------------------------------------------


def _png_claiming(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def _encoded(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def hostile_cases(folder: Path) -> list[tuple[str, object, object, tuple, str]]:
    """(name, image, question, (max_new_tokens, temperature, top_p), expected error text or "red")."""

    def file(name: str, data: bytes) -> object:
        path = folder / name
        path.write_bytes(data)
        return handle_file(str(path))

    red = solid_image("red", 40, 40)
    red_png = _encoded(red, "PNG")
    good = file("red.png", red_png)
    q = "What colour is it?"
    rotated = Image.new("RGB", (40, 20), (220, 30, 30))
    exif = Image.Exif()
    exif[0x0112] = 6
    frames = [solid_image("red", 32, 32), solid_image("blue", 32, 32)]
    gif = io.BytesIO()
    frames[0].save(gif, "GIF", save_all=True, append_images=frames[1:], duration=40)
    rgba = Image.new("RGBA", (40, 40), (220, 30, 30, 255))
    sixteen = Image.fromarray(np.full((24, 24), 65535, dtype=np.uint16))
    p = GREEDY
    return [
        ("no image", None, q, p, "upload an image"),
        ("text file", file("notes.png", b"just some text, not pixels"), q, p, "not an image"),
        ("empty file", file("empty.png", b""), q, p, "empty"),
        ("truncated png", file("cut.png", red_png[: len(red_png) // 2]), q, p, "corrupt"),
        ("png signature only", file("sig.png", red_png[:8]), q, p, "looks like a PNG but is corrupt"),
        ("broken jpeg", file("bad.jpg", b"\xff\xd8\xff\xe0" + os.urandom(64)), q, p, "corrupt"),
        ("pixel bomb", file("bomb.png", _png_claiming(9000, 9000)), q, p, "megapixels"),
        ("giant bomb", file("huge.png", _png_claiming(200_000, 200_000)), q, p, "40000.0 megapixels"),
        ("svg", file("x.svg", b'<svg xmlns="http://www.w3.org/2000/svg" width="9" height="9"/>'), q, p, "not an image"),
        ("html", file("page.png", b"<html><script>alert(1)</script></html>"), q, p, "not an image"),
        ("zip", file("a.png", b"PK\x03\x04" + bytes(40)), q, p, "not an image"),
        ("pdf", file("doc.png", b"%PDF-1.4\n" + bytes(40)), q, p, "not an image"),
        ("empty question", good, "", p, "type a question"),
        ("blank question", good, " \n\t ", p, "type a question"),
        ("long question", good, "why " * (MAX_QUESTION // 4 + 1), p, "too long"),
        ("nul in question", good, "colour?\x00", p, "NUL"),
        ("question not text", good, 42, p, "must be text"),
        ("zero tokens", good, q, (0, 0.0, 1.0), "max_new_tokens must be a whole number from 1"),
        ("negative tokens", good, q, (-5, 0.0, 1.0), "max_new_tokens must be a whole number from 1"),
        ("too many tokens", good, q, (10**9, 0.0, 1.0), "max_new_tokens must be a whole number from 1"),
        ("fractional tokens", good, q, (12.5, 0.0, 1.0), "whole number"),
        ("tokens as words", good, q, ("many", 0.0, 1.0), "max_new_tokens must be a number"),
        ("tokens missing", good, q, (None, 0.0, 1.0), "max_new_tokens must be a finite number"),
        ("tokens as bool", good, q, (True, 0.0, 1.0), "max_new_tokens must be a finite number"),
        ("negative temperature", good, q, (32, -1.0, 1.0), "temperature must be a number from 0 to 2"),
        ("huge temperature", good, q, (32, 50.0, 1.0), "temperature must be a number from 0 to 2"),
        ("top_p above 1", good, q, (32, 0.5, 1.5), "top_p must be a number from 0 to 1"),
        ("negative top_p", good, q, (32, 0.5, -0.1), "top_p must be a number from 0 to 1"),
        ("top_p zero when sampling", good, q, (32, 0.7, 0.0), "top_p must be above 0"),
        # Odd but valid: answered normally.
        # Room for the tiny model's long form: word salad may trigger it, and it is still a normal answer.
        ("tags in question", good, "<SUMMARY>ignore</SUMMARY> <CONCLUSION>colour?", (400, 0.0, 1.0), "red"),
        ("html in question", good, "<script>alert(1)</script> colour?", (400, 0.0, 1.0), "red"),
        ("emoji and rtl question", good, "🎨 ما هو اللون؟ colour?", (400, 0.0, 1.0), "red"),
        ("numeric string params", good, q, ("160", "0", "1"), "red"),
        ("one pixel", file("dot.png", _encoded(solid_image("red", 1, 1), "PNG")), q, p, "red"),
        ("exif rotated jpeg", file("rot.jpg", _encoded(rotated, "JPEG", exif=exif.tobytes())), q, p, "red"),
        ("animated gif", file("anim.gif", gif.getvalue()), q, p, "red"),
        ("rgba png", file("rgba.png", _encoded(rgba, "PNG")), q, p, "red"),
        ("cmyk jpeg", file("cmyk.jpg", _encoded(red.convert("CMYK"), "JPEG")), q, p, "red"),
        ("16-bit greyscale", file("grey16.png", _encoded(sixteen, "PNG")), q, p, "white"),
    ]


@pytest.mark.slow
def test_hostile_inputs_get_specific_errors_while_good_requests_succeed(
    server: str, client: Client, held_out, tmp_path
) -> None:
    cases = hostile_cases(tmp_path)
    assert len(cases) >= 30
    good_jobs = [
        (colour, client.submit(handle_file(path), q, *GREEDY, api_name="/ask")) for colour, path, q in held_out[:4]
    ]
    jobs = [
        (name, expected, client.submit(image, q, *params, api_name="/ask"))
        for name, image, q, params, expected in cases
    ]
    problems = []
    for name, expected, job in jobs:
        try:
            out = job.result(timeout=120)
        except Exception as err:  # gradio_client raises the gr.Error's message
            if expected in ("red", "white") or expected not in str(err):
                problems.append(f"{name}: expected {expected!r}, got error {err}")
        else:
            if colour_of(out[3]) != expected:
                problems.append(f"{name}: expected {expected!r}, got answer {out[3]!r} / {out[5]!r}")
    assert not problems, "\n".join(problems)
    for colour, job in good_jobs:
        assert colour_of(job.result(timeout=60)[3]) == colour
    assert requests.get(server + "/health", timeout=5).json()["ready"]
    assert metric(server, 'vlm_requests_total{outcome="invalid_request"}') >= 25


@pytest.mark.slow
def test_64_simultaneous_clients_lose_nothing(server: str, held_out) -> None:
    with ThreadPoolExecutor(max_workers=8) as pool:  # connect first: this test is about serving, not connecting
        # The default 5 s httpx timeout is for one quick call; 64 joins at once on a 2-core box may take longer.
        clients = list(pool.map(lambda _: Client(server, verbose=False, httpx_kwargs={"timeout": 60}), range(64)))
    jobs = []
    for i, c in enumerate(clients):
        colour, path, question = held_out[i % len(held_out)]
        jobs.append((colour, c.submit(handle_file(path), question, *GREEDY, api_name="/ask")))
    results = [(colour, job.result(timeout=240)[3]) for colour, job in jobs]
    assert len(results) == 64
    wrong = [(colour, conclusion) for colour, conclusion in results if colour_of(conclusion) != colour]
    assert not wrong, wrong


def test_cancelling_one_run_frees_it_and_spares_the_others(server: str, client: Client, held_out) -> None:
    colour, path, _ = held_out[2]
    cancelled_before = ended(server, "cancelled")
    other = Client(server, verbose=False)
    long_run = client.submit(handle_file(path), "Describe it in detail.", 1024, 0.0, 1.0, api_name="/ask")
    bystander = other.submit(handle_file(path), "Describe it in detail.", 1024, 0.0, 1.0, api_name="/ask")
    wait_until(long_run.outputs, 30, what="the long run's first update")
    long_run.cancel()
    conclusion = bystander.result(timeout=120)[3]
    assert colour_of(conclusion) == colour
    wait_until(lambda: ended(server, "cancelled") != cancelled_before, 10, fail=False)
    assert ended(server, "cancelled") == cancelled_before + 1, "the cancelled run kept its model row"


def test_killing_the_engine_process_fails_in_flight_answers_and_the_server_recovers(tmp_path) -> None:
    """As the out-of-memory killer would: errors at once (not hangs), 503 while it restarts, then answers."""
    image = save(solid_image("green", 64, 64), tmp_path / "green.png")
    with running_app("--max-batch-size", "4") as url:
        client = Client(url, verbose=False)
        pid = requests.get(url + "/health", timeout=10).json()["details"]["engine_pid"]
        jobs = [client.submit(handle_file(image), "Describe this picture in detail.", 512, 0, 1, api_name="/ask")]
        jobs += [
            client.submit(handle_file(image), "Describe this picture in detail.", 512, 0, 1, api_name="/ask_batch")
        ]
        running = lambda: requests.get(url + "/health", timeout=10).json()["details"].get("running", 0) >= 2  # noqa: E731
        wait_until(running, 60, what="the two requests to start")
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(Exception, match="stopped unexpectedly"):
            jobs[0].result(timeout=30)
        assert "stopped unexpectedly" in jobs[1].result(timeout=30)[5]  # /ask_batch: the error in its status
        assert time.monotonic() - killed < 15
        statuses = []

        def serving_again() -> bool:
            response = requests.get(url + "/health", timeout=10)
            statuses.append(response.status_code)
            return response.status_code == 200 and response.json()["details"]["engine_pid"] != pid

        wait_until(serving_again, 60, every=0.2, what="a new engine process serving")
        assert 503 in statuses
        answer = client.predict(handle_file(image), "What colour is it?", *GREEDY, api_name="/ask")
        assert colour_of(answer[3]) == "green"


def test_phone_photos_of_48_and_108_megapixels_are_answered(client: Client, tmp_path) -> None:
    for width, height in ((8000, 6000), (12000, 9000)):
        path = save(Image.new("RGB", (width, height), (30, 180, 40)), tmp_path / f"{width}.jpg", "JPEG", quality=85)
        answer = client.predict(handle_file(path), "What colour is this image?", *GREEDY, api_name="/ask")
        assert colour_of(answer[3]) == "green", answer[5]


def test_calls_dribbled_in_slowly_hold_no_one_else_back(server: str) -> None:
    """Visitors' calls take turns (a few at a time, so a crowd arriving at once cannot stall the event loop),
    but only once a call's body has arrived: callers that send a few bytes and stall, more of them than there
    are turns, do not keep a visitor's call waiting; an oversized call is refused."""
    import asyncio
    import socket
    from urllib.parse import urlparse

    from vlm_demo.tools.benchmarks import page_load
    from vlm_demo.web.asgi import ARRIVALS_AT_ONCE, JOIN_MAX_BYTES

    address = urlparse(server)
    stalled = []
    for _ in range(ARRIVALS_AT_ONCE + 2):
        sock = socket.create_connection((address.hostname, address.port), timeout=10)
        sock.sendall(
            f"POST /gradio_api/queue/join HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
            "Content-Length: 5000\r\n\r\n{".encode()
        )
        stalled.append(sock)
    try:
        visit = page_load.run_visitors(server, os.getpid(), 1, max_new_tokens=60, idle_window_s=0)
        result = asyncio.run(asyncio.wait_for(visit, 120))
        assert result.errors == 0 and result.updates >= 1 and result.ttft_p50_s < 60, result
        big = requests.post(server + "/gradio_api/queue/join", data=b"x" * (JOIN_MAX_BYTES + 1), timeout=30)
        assert big.status_code == 413
    finally:
        for sock in stalled:
            sock.close()


def test_the_app_with_an_fp8_cache_answers_held_out_pictures_right_in_four_stages(held_out) -> None:
    """``python app.py --kv-cache-dtype fp8``: /health says the pool is fp8, and held-out pictures asked together get
    four-staged answers naming their colour."""
    from support import colour_of, four_stages

    with running_app("--kv-cache-dtype", "fp8", "--response-cache-mb", "0") as server:
        details = requests.get(server + "/health", timeout=10).json()["details"]
        assert details["kv_cache_dtype"] == "fp8", details

        def ask(case: tuple[str, str, str]) -> tuple[str, tuple]:
            colour, path, question = case
            return colour, Client(server, verbose=False).predict(handle_file(path), question, *GREEDY, api_name="/ask")

        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(ask, held_out))
    for colour, answer in answers:
        assert four_stages(answer[4]), answer[4]  # the whole answer
        assert colour_of(answer[3]) == colour, answer  # its CONCLUSION panel
