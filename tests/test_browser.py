"""A real headless Chromium on the real page: upload, ask, four headed panels fill, Stop, screenshot.

Uses Debian's ``/usr/bin/chromium`` through Playwright (never ``playwright install``). The screenshot
taken mid-answer (banner, headed panels, the stage being written marked) is the README's
``docs/screenshot.png``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gradio_client import Client, handle_file
from test_app import running_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
STAGES = ("summary", "caption", "reasoning", "conclusion")
LONG_QUESTION = "Describe this picture in detail."  # "detail" makes the tiny model's REASONING long


@pytest.fixture(scope="module")
def server(tiny_dir: str) -> Iterator[str]:
    # Continuous batching lets a second visitor's request join the browser's running batch, so Stop is
    # tested on one row of a live batch.
    with running_server("--max-batch-size", "4", "--batching", "continuous") as url:
        yield url


@pytest.fixture(scope="module")
def page(server: str):
    sync_api = pytest.importorskip("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian chromium is not installed (.ci/run installs it)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        page = browser.new_page(viewport={"width": 1360, "height": 1000})
        page.goto(server, wait_until="domcontentloaded")  # never "networkidle": Gradio keeps a stream open
        page.locator("#p_conclusion").wait_for(timeout=60_000)
        set_greedy(page)
        yield page
        browser.close()


def set_greedy(page) -> None:
    """Temperature 0 under "Advanced", so the tiny model's answers are deterministic."""
    page.locator("#advanced").get_by_text("Advanced").click()
    temperature = page.locator("#temperature input[type=number]")
    temperature.fill("0")
    temperature.press("Enter")
    temperature.blur()
    page.locator("#advanced").get_by_text("Advanced").click()  # fold it again; the slider keeps its value


def panel_text(page, stage: str) -> str:
    return page.locator(f"#p_{stage} textarea").input_value()


def ask(page, image: Path, question: str) -> None:
    page.locator("#img input[type=file]").set_input_files(str(image))
    page.locator("#img img").first.wait_for(timeout=20_000)  # the upload finished and shows a preview
    page.locator("#q textarea").fill(question)
    page.locator("#ask").click()


def test_page_shows_headed_panels_and_the_tiny_model_banner(page) -> None:
    for stage in STAGES:
        heading = page.locator(f"#p_{stage} [data-testid=block-info]").inner_text()
        assert heading.strip().startswith(stage.upper())
    banner = page.locator("#banner")
    assert banner.is_visible() and "tiny" in banner.inner_text().lower()
    assert page.locator("#examples").is_visible()


def test_upload_ask_and_the_four_panels_fill(page) -> None:
    ask(page, ROOT / "assets" / "tiny" / "red.png", "What colour is this image?")
    page.wait_for_function(
        "() => (document.querySelector('#p_conclusion textarea')?.value || '').includes('red')", timeout=60_000
    )
    page.wait_for_function("() => document.querySelector('#status')?.innerText.includes('Done')", timeout=30_000)
    texts = {stage: panel_text(page, stage) for stage in STAGES}
    assert all(texts.values()), texts
    assert "red" in texts["caption"] and "red" in texts["conclusion"]
    assert not any("<" in t for t in texts.values()), texts  # tags never reach a panel
    assert "batch of" in page.locator("#status").inner_text()


def test_long_answer_marks_the_active_stage_and_stop_cancels_only_this_visitor(server: str, page) -> None:
    blue = ROOT / "assets" / "tiny" / "blue.png"
    other_visitor = Client(server, verbose=False)
    ask(page, blue, LONG_QUESTION)
    bystander = other_visitor.submit(handle_file(str(blue)), LONG_QUESTION, 1024, 0.0, 1.0, api_name="/ask")
    # Checked inside the page in one go: the tiny model writes fast, so separate round trips could
    # land after REASONING is already finished.
    page.wait_for_function(
        """() => {
            const active = document.querySelector('#stages [data-active=reasoning]');
            const info = document.querySelector('#p_reasoning [data-testid=block-info]');
            const look = e => getComputedStyle(e).boxShadow + getComputedStyle(e).backgroundColor;
            return !!active && !!info
                && getComputedStyle(info, '::after').content.includes('writing')
                && look(document.querySelector('#p_reasoning')) !== look(document.querySelector('#p_summary'));
        }""",
        timeout=60_000,
        polling=20,
    )
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(ROOT / "docs" / "screenshot.png"))

    page.locator("#stop").click()
    page.wait_for_function(
        "() => document.querySelector('#status')?.innerText.includes('Stopped after')", timeout=20_000
    )
    time.sleep(1.0)
    reasoning = panel_text(page, "reasoning")
    time.sleep(1.0)
    assert panel_text(page, "reasoning") == reasoning, "the stopped answer kept growing"
    assert panel_text(page, "conclusion") == "", "the answer ran to the end although stopped"

    out = bystander.result(timeout=120)
    assert "blue" in out[3], "Stop in one browser cancelled another visitor's run"
    assert "batch of 2" in out[5], "the two visitors' requests did not share a batch, so Stop was not tested mid-batch"
