"""A real headless Chromium on the real page (tiny model), as a new user meets it: light and dark mode,
desktop and phone widths, upload errors, Enter, Clear, Stop, the API page and its snippet. (The docs' API
examples: test_docs_commands.py.)

Uses Debian's ``/usr/bin/chromium`` through Playwright (never ``playwright install``). One server and
one browser for the module. Screenshots go to a temporary folder; ``VLM_SCREENSHOT_DIR=docs`` writes
the README's (``screenshot.png`` light desktop, ``screenshot-dark.png``, ``screenshot-phone.png``)
instead. The last test checks that the run left the tracked ``docs/`` and ``assets/`` files alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from gradio_client import Client, handle_file
from support import (
    ROOT,
    free_ports,
    metric,
    running_app,
    server_env,
    start_app,
    start_triton,
    stop_app,
    stop_triton,
    wait_until,
)

pytestmark = pytest.mark.slow


CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DESKTOP = {"width": 1360, "height": 1000}
PHONE = {"width": 390, "height": 844}
STAGES = ("summary", "caption", "reasoning", "conclusion")
RED = ROOT / "assets" / "tiny" / "red.png"
BLUE = ROOT / "assets" / "tiny" / "blue.png"
LONG_QUESTION = "Describe this picture in detail."  # "detail" makes the tiny model's REASONING long
GUARDED = ("docs", "assets")  # tracked folders a test could write into by mistake


def digests() -> dict[str, str]:
    return {
        str(path.relative_to(ROOT)): hashlib.sha256(path.read_bytes()).hexdigest()
        for folder in GUARDED
        for path in sorted((ROOT / folder).rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def tracked_before() -> dict[str, str]:
    return digests()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    """Where screenshots go: a temporary folder unless ``VLM_SCREENSHOT_DIR`` names one."""
    folder = os.environ.get("VLM_SCREENSHOT_DIR")
    return Path(folder) if folder else tmp_path_factory.mktemp("screenshots")


@pytest.fixture(scope="module")
def server(tiny_dir: str, tracked_before) -> Iterator[str]:
    # Continuous batching lets a second visitor's request join the browser's running batch, so Stop is
    # tested on one row of a live batch.
    with running_app("--max-batch-size", "4", "--batching", "continuous", "--response-cache-mb", "0") as url:
        yield url


@pytest.fixture(scope="module")
def browser(server: str):
    sync_api = pytest.importorskip("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian chromium is not installed (.ci/run installs it)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        yield browser
        browser.close()


def open_page(browser, server: str, theme: str = "light", viewport: dict[str, int] = DESKTOP):
    """A fresh visitor (own session) with temperature 0, so the tiny model's answers are deterministic."""
    page = browser.new_page(viewport=viewport, device_scale_factor=2 if viewport == PHONE else 1)
    page.goto(f"{server}/?__theme={theme}", wait_until="domcontentloaded")  # never "networkidle": SSE stays open
    page.locator("#p_conclusion").wait_for(timeout=60_000)
    set_greedy(page)
    return page


def set_greedy(page) -> None:
    """Temperature 0 in the Advanced box, folded again afterwards (the slider keeps its value). The page sends
    the slider's value, so this waits until the slider holds 0, typing it again if a keystroke was lost (a
    busy box can drop one while the page is still settling): else an answer would be sampled, not greedy."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    temperature = page.locator("#temperature input[type=number]")
    for _ in range(3):
        if not temperature.is_visible():
            page.locator("#advanced").get_by_text("Advanced").click()
        temperature.fill("0")
        temperature.press("Enter")
        temperature.blur()
        try:
            page.wait_for_function(
                "() => document.querySelector('#temperature input[type=range]')?.value === '0'", timeout=10_000
            )
            break
        except PlaywrightTimeout:
            continue
    else:
        raise AssertionError("the temperature slider never took 0")
    page.locator("#advanced").get_by_text("Advanced").click()


@pytest.fixture(scope="module")
def page(browser, server: str):
    page = open_page(browser, server)
    yield page
    page.close()


def panel_text(page, stage: str) -> str:
    return page.locator(f"#p_{stage} textarea").input_value()


def upload(page, image: Path) -> None:
    page.locator("#img input[type=file]").set_input_files(str(image))
    page.locator("#img img").first.wait_for(timeout=60_000)  # the upload finished and shows a preview (slow when busy)


def ask(page, image: Path, question: str) -> None:
    upload(page, image)
    page.locator("#q textarea").fill(question)
    page.locator("#ask").click()


def status_text(page) -> str:
    """The status line's own text (not the timer of Gradio's progress overlay on it)."""
    return page.locator("#status [data-testid=markdown]").inner_text().strip()


def wait_status(page, text: str, timeout: float = 60_000) -> None:
    page.wait_for_function(
        "text => (document.querySelector('#status')?.innerText || '').includes(text)", arg=text, timeout=timeout
    )


STATUS_JS = "document.querySelector('#status [data-testid=markdown]')?.innerText.trim() || ''"
# Gradio's progress mark on the status line: shown (no ``hide`` class) from the moment an answer is asked for
# until its event has ended.
BUSY_JS = "!!document.querySelector('#status [data-testid=status-tracker]:not(.hide)')"


def watch_status(page) -> str:
    """Start watching for a new answer before it is asked for; returns the status line now. Two answers can end
    on the same line (the same tokens, rate and time) and a fast one is over before a poll sees it run, so
    :func:`done_again` waits for the progress mark an observer saw come (it hears every change), then go."""
    page.wait_for_function(f"() => !({BUSY_JS})", timeout=60_000)  # the last answer's event has ended
    return page.evaluate(
        f"""() => {{
            window.answerRan = false;
            new MutationObserver(() => {{ if ({BUSY_JS}) window.answerRan = true; }}).observe(
                document.querySelector('#status'), {{subtree: true, childList: true, attributes: true}});
            return {STATUS_JS};
        }}"""
    )


def done_again(page, before: str, timeout: float = 90_000) -> None:
    """Until the answer asked for since :func:`watch_status` returned ``before`` has ended with "Done"; on a
    timeout, the line the status shows instead (an error, a wait) is the failure's message."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(
            f"() => window.answerRan && !({BUSY_JS}) && ({STATUS_JS}).startsWith('Done')", timeout=timeout
        )
    except PlaywrightTimeout:
        raise AssertionError(
            f"no new answer in {timeout / 1000:.0f} s; the status line: {status_text(page)!r}, before: {before!r}"
        ) from None


# ---- contrast, from the colours the browser rendered ---------------------------------------------------

# For each visible element matching a selector (its ::after, or those with text of their own): the text
# colour and the background colours of it and each ancestor, as RGBA through a canvas (any CSS colour
# syntax). Python composites and measures.
MEASURE_JS = """
    const ctx = document.createElement('canvas').getContext('2d');
    const rgba = colour => {
        ctx.clearRect(0, 0, 1, 1);
        ctx.fillStyle = colour;
        ctx.fillRect(0, 0, 1, 1);
        const d = ctx.getImageData(0, 0, 1, 1).data;
        return [d[0], d[1], d[2], d[3] / 255];
    };
    const measure = (el, pseudo) => {
        const backgrounds = [];
        for (let n = el; n; n = n.parentElement) backgrounds.push(rgba(getComputedStyle(n).backgroundColor));
        return {text: el.innerText.slice(0, 40), fg: rgba(getComputedStyle(el, pseudo).color), backgrounds};
    };
    const hasText = el => [...el.childNodes].some(c => c.nodeType === 3 && c.textContent.trim());
    const measureAll = (selector, pseudo) => [...document.querySelectorAll(selector)]
        .filter(el => el.offsetParent && (pseudo || hasText(el)))
        .map(el => measure(el, pseudo));
"""
COLOURS_JS = "([selector, pseudo]) => {" + MEASURE_JS + "return measureAll(selector, pseudo); }"
# While a stage after SUMMARY is written (watched from inside the page, see WATCH_JS): the writing stage's
# "● writing…" mark, a finished stage's ✓, and the strip's done and active steps.
STAGE_MARKS_JS = (
    "() => {"
    + MEASURE_JS
    + """
    const strip = document.querySelector('#stages [data-active]');
    const active = strip && strip.dataset.active;
    const done = strip && strip.dataset.done.split(' ').filter(Boolean)[0];
    if (!active || !done) return false;
    const info = document.querySelector(`#p_${active} [data-testid=block-info]`);
    const look = e => getComputedStyle(e).boxShadow + getComputedStyle(e).backgroundColor;
    const marked = getComputedStyle(info, '::after').content.includes('writing')
        && look(document.querySelector(`#p_${active}`)) !== look(document.querySelector(`#p_${done}`));
    if (!marked) return false;
    return {
        writing: measureAll(`#p_${active} [data-testid=block-info]`, '::after'),
        done: measureAll(`#p_${done} [data-testid=block-info]`, '::after'),
        strip_done: measureAll('#stages .step.done', null),
        strip_active: measureAll('#stages .step.active', null),
    };
}"""
)


def _luminance(rgb: tuple[float, ...]) -> float:
    def linear(c: float) -> float:
        c /= 255
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(c) for c in rgb[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def _over(top: list[float], bottom: tuple[float, ...]) -> tuple[float, ...]:
    alpha = top[3]
    return tuple(top[i] * alpha + bottom[i] * (1 - alpha) for i in range(3))


def contrast(measured: dict[str, Any]) -> float:
    """WCAG contrast of the text colour over the composited backgrounds (the page's canvas is white)."""
    background: tuple[float, ...] = (255.0, 255.0, 255.0)
    for layer in reversed(measured["backgrounds"]):  # outermost first
        background = _over(layer, background)
    foreground = _over(measured["fg"], background)
    light, dark = sorted((_luminance(foreground), _luminance(background)), reverse=True)
    return (light + 0.05) / (dark + 0.05)


def contrasts(page, selector: str, pseudo: str | None = None) -> dict[str, float]:
    found = page.evaluate(COLOURS_JS, [selector, pseudo])
    assert found, f"nothing visible matches {selector}{pseudo or ''}"
    return {m["text"] or selector: round(contrast(m), 2) for m in found}


def assert_readable(page, selector: str, pseudo: str | None = None, minimum: float = 4.5) -> None:
    measured = contrasts(page, selector, pseudo)
    assert min(measured.values()) >= minimum, measured


# Where an input error line sits and how it looks: its box and the input's, its text's colour and the theme's
# error colour (resolved the same way, through a probe element).
INPUT_ERROR_JS = """([line, input]) => {
    const box = id => document.getElementById(id).getBoundingClientRect();
    const text = document.querySelector(`#${line} [data-testid=markdown] p`);
    const probe = document.createElement('span');
    probe.style.color = 'var(--error-text-color)';
    document.getElementById(line).appendChild(probe);
    const error = getComputedStyle(probe).color;
    probe.remove();
    return {line: box(line), input: box(input), colour: text && getComputedStyle(text).color, error};
}"""


def assert_beside(page, line: str, input_id: str) -> None:
    """The error line ``line`` is right under the input ``input_id`` (the same column, at most a line's gap), in
    view, in the theme's error colour, readable."""
    found = page.evaluate(INPUT_ERROR_JS, [line, input_id])
    box, under = found["line"], found["input"]
    assert 0 <= box["top"] - under["bottom"] <= 40, f"{line} is not right under {input_id}: {found}"
    assert box["left"] < under["right"] and under["left"] < box["right"], f"{line} is not in {input_id}'s column"
    assert 0 <= box["top"] and box["bottom"] <= page.viewport_size["height"], f"{line} is out of view: {found}"
    assert found["colour"] == found["error"], f"{line} is not in the error colour: {found}"
    assert_readable(page, f"#{line} *")


# Runs ``check`` (a JS function's source) on every change of the page until it returns something truthy,
# kept in window.__seen. A MutationObserver sees each state the page passes through, however fast the tiny
# model writes and however late a poll from here would come.
WATCH_JS = """check => {
    window.__seen = null;
    const test = new Function('return (' + check + ')')();
    const look = () => {
        const found = !window.__seen && test();
        if (found) { window.__seen = found; observer.disconnect(); }
    };
    const observer = new MutationObserver(look);
    observer.observe(document.body, {subtree: true, childList: true, attributes: true, characterData: true});
    look();
}"""


def watch(page, check: str) -> None:
    """Start watching for ``check`` before the action that leads to it."""
    page.evaluate(WATCH_JS, check)


def seen(page, what: str, timeout: float = 60_000) -> Any:
    """What the watched check returned when it first held."""
    try:
        return page.wait_for_function("() => window.__seen", timeout=timeout, polling=50).json_value()
    except Exception as err:
        state = {
            "status": status_text(page),
            "strip": page.locator("#stages [data-active]").evaluate("e => e.outerHTML"),
        }
        raise AssertionError(f"never saw {what}: {state}") from err


def click_when_writing(selector: str, stage: str = "") -> str:
    """A check that clicks ``selector`` the moment ``stage`` (or any stage) is being written; it returns what
    the question box held at that moment, read in the same step: after the click the page may write the box
    (a stopped question comes back), sooner than a read from here could come."""
    active = f"[data-active={stage}]" if stage else "[data-active]:not([data-active=''])"
    return f"""() => {{
        if (!document.querySelector({json.dumps("#stages " + active)})) return false;
        const question = document.querySelector('#q textarea').value;
        document.querySelector({json.dumps(selector)}).click();
        return {{question}};
    }}"""


def marks_contrasts(marks: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    return {name: {m["text"]: round(contrast(m), 2) for m in found} for name, found in marks.items()}


def assert_readable_marks(marks: dict[str, dict[str, float]], minimum: float = 4.5) -> None:
    assert all(marks.values()), f"a mark was not on the page: {marks}"
    assert min(c for found in marks.values() for c in found.values()) >= minimum, marks


# ---- the tests --------------------------------------------------------------------------------------------


def test_page_shows_headed_panels_the_tiny_model_banner_and_its_hints(page) -> None:
    for stage in STAGES:
        heading = page.locator(f"#p_{stage} [data-testid=block-info]").inner_text()
        assert heading.strip().startswith(stage.upper())
    banner = page.locator("#banner")
    assert banner.is_visible() and "tiny" in banner.inner_text().lower()
    assert "only names a colour" in page.locator("#examples").inner_text()  # the photo examples say why
    assert "Shift+Enter" in page.locator("#q").inner_text()
    assert page.locator("#clear").is_visible()


def test_enter_asks_shift_enter_adds_a_line_and_the_four_panels_fill(page) -> None:
    upload(page, RED)
    box = page.locator("#q textarea")
    box.fill("What colour")
    box.press("Shift+Enter")
    box.type("is this image?")
    assert box.input_value() == "What colour\nis this image?"
    time.sleep(0.5)
    assert status_text(page) == "" and panel_text(page, "summary") == "", "Shift+Enter must not ask"
    box.press("Enter")
    page.wait_for_function(
        "() => (document.querySelector('#p_conclusion textarea')?.value || '').includes('red')", timeout=60_000
    )
    wait_status(page, "Done", 30_000)
    texts = {stage: panel_text(page, stage) for stage in STAGES}
    assert all(texts.values()), texts
    assert "red" in texts["caption"] and "red" in texts["conclusion"]
    assert not any("<" in t for t in texts.values()), texts  # tags never reach a panel
    assert "batch of" in status_text(page)
    # The answered question leaves the box (Enter would ask it again as a follow-up) and stays above the panels.
    page.wait_for_function("() => document.querySelector('#q textarea').value === ''", timeout=10_000)
    assert page.locator("#history .asking").inner_text() == "Question What colour\nis this image?"
    page.locator("#retry").wait_for(state="visible", timeout=10_000)
    box.press("Enter")  # the empty box: an input error beside it, and no Retry (asking again cannot help)
    wait_status(page, "⚠ Invalid input: see the message by the question", 20_000)
    assert page.locator("#question_error").inner_text().strip() == "⚠ Please type a question about the image."
    assert_beside(page, "question_error", "q")
    assert not page.locator("#image_error").is_visible(), "the image is not what to fix"
    page.locator("#retry").wait_for(state="hidden", timeout=10_000)
    assert page.locator("#history details.turn").count() == 1, "the answered turn is still the conversation"


def test_the_status_counts_tokens_and_seconds_from_ask_on(page) -> None:
    watch(
        page,
        rf"""() => {{
            const s = {STATUS_JS};
            const m = /^Generating · writing [A-Z]+… · \d+ tokens · (\d+\.\d) s$/.exec(s);
            return m && parseFloat(m[1]) > 0 ? s : false;  // the time moves even in a sub-second answer
        }}""",
    )
    ask(page, BLUE, LONG_QUESTION)
    counted = seen(page, "the live token and seconds counter")
    wait_status(page, "Done", 60_000)
    assert int(re.search(r"(\d+) tokens", counted).group(1)) > 0, counted


def test_the_status_names_each_stage_in_turn_without_flickering(page) -> None:
    """The status line said "Generating…" again between two stages ("writing SUMMARY…", "Generating…", "writing
    CAPTION…"): every state it passes through is kept inside the page, and after the first stage it only moves on."""
    page.evaluate(
        """() => {
            window.__statuses = [];
            const status = document.querySelector('#status');
            new MutationObserver(() => {
                const text = (status.querySelector('[data-testid=markdown]')?.innerText || '').trim();
                const said = text.replace(/ · \\d+ tokens?\\b.*$/, '');  // without the counter
                if (said.startsWith('Generating') && window.__statuses.at(-1) !== said) window.__statuses.push(said);
            }).observe(status, {subtree: true, childList: true, characterData: true});
        }"""
    )
    before = watch_status(page)
    ask(page, BLUE, LONG_QUESTION)
    done_again(page, before)
    said = page.evaluate("window.__statuses")
    named = [line for line in said if line != "Generating…"]
    assert len(named) >= 2, f"the status line never named a stage, or only one: {said}"
    assert said[len(said) - len(named) :] == named, f"'Generating…' came back after a stage: {said}"
    order = [STAGES.index(line.removeprefix("Generating · writing ").removesuffix("…").lower()) for line in named]
    assert order == sorted(set(order)), f"the stages were not named in turn, each once: {said}"


def test_the_page_logs_no_warning_or_error_as_it_loads(browser, server: str) -> None:
    """Gradio's translations read the status line's label "status" as a group of messages: an i18n warning in the
    console on every load."""
    page = browser.new_page(viewport=DESKTOP)
    logged: list[str] = []
    page.on("console", lambda m: logged.append(f"{m.type}: {m.text}") if m.type in ("warning", "error") else None)
    page.on("pageerror", lambda err: logged.append(f"page error: {err}"))
    try:
        page.goto(f"{server}/", wait_until="domcontentloaded")
        page.locator("#p_conclusion").wait_for(timeout=60_000)
        page.wait_for_timeout(2_000)  # the page's own scripts and Gradio's late ones have run
        assert logged == [], logged
    finally:
        page.close()


def test_ask_keeps_the_question_and_its_box_in_view_on_a_desktop(browser, server: str) -> None:
    """A visitor who read down to the CONCLUSION asks a follow-up: Ask brought the stage strip to the top of a
    1000-px window, and the question's line right above it ended just out of view (how far out depended on how
    much the earlier turns grew while the page scrolled: -0.3 px to -32 px). The question's line, the strip and
    the question box (where the next question is typed) are all in view after Ask."""
    page = open_page(browser, server)
    try:
        ask(page, RED, "What colour is this image?")
        wait_status(page, "Done", 60_000)
        for question in ("What colour is this image?", LONG_QUESTION):
            page.locator("#q textarea").fill(question)  # first: Playwright scrolls the box into view to type
            page.evaluate("document.getElementById('p_conclusion').scrollIntoView({block: 'start'})")
            assert page.locator("#stages").bounding_box()["y"] < 0, "the visitor had scrolled past the strip"
            assert page.locator("#ask").bounding_box()["y"] > 0, "Ask is in view (the click scrolls nothing)"
            before = watch_status(page)
            page.locator("#ask").click()
            done_again(page, before)
            page.wait_for_function(  # the smooth scroll has settled
                """() => new Promise(done => { const y = window.scrollY;
                    setTimeout(() => done(window.scrollY === y), 300); })""",
                timeout=10_000,
            )
            assert page.locator("#history .asking").inner_text() == f"Question {question}"
            for selector in ("#history .asking", "#stages", "#q"):
                box = page.locator(selector).bounding_box()
                assert 0 <= box["y"] and box["y"] + box["height"] <= DESKTOP["height"], (question, selector, box)
    finally:
        page.close()


@pytest.fixture(scope="module")
def slow_server(tiny_dir: str) -> Iterator[str]:
    """The app with every decode step taking at least 50 ms (the ``slow`` failpoint, ``engine/batching/faults.py``): the
    tiny model's long answer (~240 tokens) then lasts 12 s or more on any machine, so answers that must overlap
    do, however fast the box (on the plain server each takes a fraction of a second)."""
    env = server_env(VLM_FAULTS="forward:slow@1+")
    with running_app("--max-batch-size", "4", "--batching", "continuous", "--response-cache-mb", "0", env=env) as url:
        yield url


def test_stop_cancels_only_this_visitor_mid_batch(browser, slow_server: str) -> None:
    page = open_page(browser, slow_server)
    try:
        stop_one_visitor_of_two(page, slow_server)
    finally:
        page.close()


def stop_one_visitor_of_two(page, server: str) -> None:
    other_visitor = Client(server, verbose=False)
    upload(page, BLUE)
    page.locator("#q textarea").fill(LONG_QUESTION)
    # The other visitor asks at the same moment as this page, so both answers run in one batch (each lasts 12 s
    # or more on the slowed server) and Stop cancels one row of a live batch.
    bystander = other_visitor.submit(handle_file(str(BLUE)), LONG_QUESTION, 1024, 0.0, 1.0, api_name="/ask")
    watch(page, click_when_writing("#stop", "reasoning"))
    page.locator("#ask").click()
    # The box as the answer was being written, when Stop was clicked: Stop soon puts the question back.
    assert seen(page, "REASONING start")["question"] == "", "the asked question left the box"
    wait_status(page, "Stopped after", 20_000)
    # The question left the box as it was asked; stopped, it comes back to be asked again or mended.
    page.wait_for_function("q => document.querySelector('#q textarea').value === q", arg=LONG_QUESTION, timeout=10_000)
    time.sleep(1.0)
    reasoning = panel_text(page, "reasoning")
    time.sleep(1.0)
    assert panel_text(page, "reasoning") == reasoning, "the stopped answer kept growing"
    assert panel_text(page, "conclusion") == "", "the answer ran to the end although stopped"
    assert "REASONING ■ stopped" in page.locator("#stages .step.stopped").inner_text()
    label = page.evaluate(
        """() => getComputedStyle(document.querySelector('#p_reasoning [data-testid="block-info"]'), '::after').content"""
    )
    assert "stopped" in label and "✓" not in label, label  # the panel says so too, not a ✓

    out = bystander.result(timeout=120)
    assert "blue" in out[3], "Stop in one browser cancelled another visitor's run"
    assert "batch of 2" in out[5], "the two visitors' requests did not share a batch, so Stop was not tested mid-batch"


def test_think_harder_shows_the_candidates_of_each_stage_then_the_winner(browser, server: str, shots) -> None:
    page = open_page(browser, server)
    try:
        beams = page.locator("#beams input[type=number]")
        assert beams.is_disabled(), "the candidates count only applies with Think harder"
        page.locator("#reasoning").get_by_text("Think harder", exact=True).click()
        beams.fill("3")  # waits until Think harder has enabled it
        beams.press("Enter")
        # The panel and the status line are read inside the page the moment the candidates show: a search that
        # takes under a second may be done before a read from here.
        watch(
            page,
            """() => {
                const value = document.querySelector('#p_reasoning textarea')?.value || '';
                const status = document.querySelector('#status [data-testid=markdown]')?.innerText || '';
                return value.includes('[Candidate 1]') && value.includes('[Candidate 3]') ? {value, status} : false;
            }""",
        )
        ask(page, BLUE, LONG_QUESTION)
        candidates = seen(page, "the REASONING candidates in their panel")
        assert "[Candidate 2]" in candidates["value"] and "Thinking harder" in candidates["status"], candidates
        wait_status(page, "Done", 120_000)
        texts = {stage: panel_text(page, stage) for stage in STAGES}
        assert all(texts.values()) and not any("[Candidate" in t for t in texts.values()), texts
        chosen = page.locator("#beams_view [data-stage=conclusion] li.winner").inner_text()
        assert texts["conclusion"] in chosen, (texts["conclusion"], chosen)
        view = page.locator("#beams_view").inner_text()
        assert view.count("✓ chosen") == 4 and "3 candidates per stage" in view, view
        assert "same as" not in view, view  # identical candidates share one line, which says how many
        for stage in STAGES:
            items = page.locator(f"#beams_view [data-stage={stage}] li.cand")
            texts_shown = [items.nth(i).inner_text() for i in range(items.count())]
            counts = [int(items.nth(i).get_attribute("data-count")) for i in range(items.count())]
            assert sum(counts) == 3 and len(set(texts_shown)) == len(texts_shown), (stage, texts_shown)
        chosen = page.locator("#beams_view [data-stage=caption] li.winner").inner_text()
        assert texts["caption"] in chosen, (texts["caption"], chosen)  # the panels hold the winners
        # The status line in a visitor's words: what Think harder did, none of the engine's jargon.
        status = status_text(page)
        assert status.startswith("Done · Thought harder: 3 candidates per stage, "), status
        assert not re.search(r"batch|rows?\b|judge|beam", status), status
        page.screenshot(path=str(shots / "screenshot-think-harder.png"), full_page=True)
    finally:
        page.close()


def test_stop_during_think_harder_stops_the_candidates_box_too(browser, server: str) -> None:
    page = open_page(browser, server)
    try:
        page.locator("#reasoning").get_by_text("Think harder", exact=True).click()
        beams = page.locator("#beams input[type=number]")
        beams.fill("6")  # more candidates: a longer answer, so Stop lands while they write under any load
        beams.press("Enter")
        for _ in range(3):  # on a fast machine the answer can still end before Stop reaches the server
            watch(page, click_when_writing("#stop", "reasoning"))
            ask(page, BLUE, LONG_QUESTION)
            seen(page, "REASONING's candidates being written")
            page.wait_for_function(
                "() => /Stopped after|Done/.test(document.querySelector('#status')?.innerText || '')", timeout=60_000
            )
            if "Stopped after" in status_text(page):
                break
        assert "Stopped after" in status_text(page)
        view = page.locator("#beams_view").inner_text()
        assert "writing…" not in view and "judging…" not in view and "stopped" in view, view
        assert "stopped" in page.locator("#stages .step.stopped").inner_text().lower()
    finally:
        page.close()


def test_a_follow_up_is_answered_with_the_first_turn_shown_retry_asks_again_and_a_new_image_starts_over(
    browser, server: str
) -> None:
    page = open_page(browser, server)
    try:
        assert not page.locator("#retry").is_visible() and not page.locator("#new_chat").is_visible()
        ask(page, RED, "What colour is this image?")
        wait_status(page, "Done", 60_000)
        first = panel_text(page, "conclusion")
        assert "red" in first
        page.locator("#retry").wait_for(state="visible", timeout=10_000)
        assert page.locator("#new_chat").is_visible() and "follow-up" in page.locator("#q").inner_text()
        assert page.locator("#history .turn").count() == 0, "the answer on screen is not history yet"

        before = watch_status(page)
        page.locator("#q textarea").fill(LONG_QUESTION)
        page.locator("#q textarea").press("Enter")
        turn = page.locator("#history details.turn")
        turn.wait_for(timeout=20_000)  # the first turn moved above the panels as the follow-up started
        assert turn.count() == 1 and turn.get_attribute("open") is None, "earlier turns are shown collapsed"
        line = turn.locator("summary").inner_text()
        assert "What colour is this image?" in line and first in line, line
        assert "1 earlier question" in page.locator("#history").inner_text()
        done_again(page, before)
        answer = {stage: panel_text(page, stage) for stage in STAGES}
        assert all(answer.values()) and "red" in answer["conclusion"], answer
        turn.click()  # unfolds: the first answer's stages are inside
        assert "CONCLUSION" in turn.inner_text() and "red" in turn.inner_text()

        before = watch_status(page)
        page.locator("#retry").click()
        done_again(page, before)
        assert page.locator("#history .asking").inner_text() == f"Question {LONG_QUESTION}", "Retry asks it again"
        page.wait_for_function("() => document.querySelector('#q textarea').value === ''", timeout=10_000)
        assert page.locator("#history details.turn").count() == 1, "the retried answer replaced its turn"
        assert panel_text(page, "reasoning") == answer["reasoning"], "greedy: the same history, the same answer"

        page.locator("#new_chat").click()  # the same picture, a new conversation
        page.wait_for_function("() => !document.querySelector('#history .turn')", timeout=20_000)
        assert page.locator("#img img").count() == 1 and panel_text(page, "conclusion") == ""
        assert not page.locator("#retry").is_visible()

        upload(page, BLUE)  # a new picture: a new conversation
        page.locator("#q textarea").fill("What colour is this image?")
        page.locator("#ask").click()
        wait_status(page, "Done", 60_000)
        assert "blue" in panel_text(page, "conclusion") and page.locator("#history .turn").count() == 0
        page.locator("#q textarea").fill("Describe this picture in detail.")
        before = watch_status(page)
        page.locator("#ask").click()
        done_again(page, before)
        assert page.locator("#history details.turn").count() == 1, "the blue answer is the new first turn"
        assert (
            "blue" in page.locator("#history summary").inner_text()
            and "red" not in page.locator("#history").inner_text()
        )
    finally:
        page.close()


def test_a_bad_upload_is_named_next_to_the_image_at_once_and_ask_shows_one_message(page, tmp_path) -> None:
    assert panel_text(page, "summary"), "the previous test should have left an answer on the page"
    notes = tmp_path / "notes.png"
    notes.write_text("meeting notes, not pixels")
    page.locator("#img input[type=file]").set_input_files(str(notes))
    message = page.locator("#upload_error")
    message.wait_for(state="visible", timeout=20_000)
    assert "not an image we can read" in message.inner_text()
    assert_readable(page, "#upload_error *")
    for stage in STAGES:
        assert panel_text(page, stage) == "", "a new image must clear the old answer"
    # The file is taken out again: no broken preview, and the message stays (taking it out is a change too).
    page.wait_for_function("() => !document.querySelector('#img img')", timeout=20_000)
    time.sleep(0.5)
    assert message.is_visible()

    page.locator("#q textarea").fill("What colour is this image?")
    page.locator("#ask").click()
    # Said beside what to fix, the empty image box, in the error colour; the status line points there.
    wait_status(page, "⚠ Invalid input: see the message by the image", 20_000)
    time.sleep(0.5)  # give stray toasts or error marks time to appear
    assert page.locator("#image_error").inner_text().strip() == "⚠ Please upload an image first."
    assert_beside(page, "image_error", "upload_error")  # under the file's own message, under the image box
    assert_beside(page, "upload_error", "img")
    assert not page.locator("#question_error").is_visible(), "the question is not what to fix"
    assert page.locator(".toast-body").count() == 0, "the error must not also pop up as a toast"
    marks = page.evaluate("() => [...document.querySelectorAll('.error')].filter(e => e.offsetParent).length")
    assert marks == 0, "no red error mark on the outputs: the line beside the image says it once"
    assert status_text(page).count("⚠") == 1
    shown = page.evaluate("() => document.body.innerText")
    assert shown.count("not an image we can read") == 1, "the file's problem is said once, next to the image"
    assert shown.count("Please upload an image first") == 1, "Ask's message is said once, next to the image"
    assert not page.locator("#retry").is_visible(), "Retry cannot help until the image changes"

    upload(page, RED)  # a good image takes the messages away
    message.wait_for(state="hidden", timeout=20_000)
    page.locator("#image_error").wait_for(state="hidden", timeout=20_000)


def test_clear_stops_the_answer_and_empties_the_page(server: str, page) -> None:
    cancelled_before = _cancelled(server)
    watch(page, click_when_writing("#clear"))  # early: the whole answer is still to come
    ask(page, BLUE, LONG_QUESTION)
    seen(page, "the answer start")
    page.wait_for_function(
        "() => !document.querySelector('#img img') && document.querySelector('#q textarea').value === ''",
        timeout=20_000,
    )
    time.sleep(1.5)  # nothing of the old answer may come back
    assert all(panel_text(page, stage) == "" for stage in STAGES)
    assert status_text(page) == ""
    wait_until(lambda: _cancelled(server) != cancelled_before, 10, fail=False)
    assert _cancelled(server) == cancelled_before + 1, "Clear left the answer running on the model"


@pytest.mark.parametrize(("theme", "picture"), [("light", "screenshot.png"), ("dark", "screenshot-dark.png")])
def test_banner_and_stage_marks_are_readable(browser, server: str, shots, theme: str, picture: str) -> None:
    page = open_page(browser, server, theme=theme)
    try:
        assert page.evaluate("document.body.classList.contains('dark')") == (theme == "dark")
        assert_readable(page, "#banner *")
        watch(page, STAGE_MARKS_JS)
        ask(page, BLUE, LONG_QUESTION)
        marks = marks_contrasts(seen(page, "a stage being written"))
        page.evaluate("window.scrollTo(0, 0)")
        page.screenshot(path=str(shots / picture))  # mid-answer, unless the model was quicker
        assert_readable_marks(marks)
        wait_status(page, "tokens/s", 60_000)  # finished: the next test starts on an idle model
    finally:
        page.close()


def test_on_a_phone_the_answer_comes_into_view_after_ask(browser, server: str, shots) -> None:
    page = open_page(browser, server, viewport=PHONE)
    try:
        top = {el: page.locator(f"#{el}").bounding_box()["y"] for el in ("ask", "stages", "p_conclusion", "examples")}
        assert top["ask"] < top["stages"] < top["p_conclusion"] < top["examples"], top  # examples come last
        buttons = {el: page.locator(f"#{el}").bounding_box() for el in ("ask", "stop", "clear")}
        assert len({round(b["y"]) for b in buttons.values()}) == 1, f"Ask, Stop and Clear share a line: {buttons}"
        for end in ("min-value", "max-value"):  # Gradio hides a slider's end labels on a phone; ours keep them
            assert page.locator(f"#beams [data-testid={end}]").is_visible(), end
        # The strip wraps on a phone: every arrow sits on the line of the step it points to, none ends a line.
        lines = page.evaluate(
            """() => [...document.querySelectorAll('#stages .arrow')].map(a => [
                a.getBoundingClientRect().top, a.nextElementSibling.getBoundingClientRect().top,
                a.nextElementSibling.getBoundingClientRect().bottom])"""
        )
        assert len(lines) == 3 and all(top <= arrow <= bottom for arrow, top, bottom in lines), lines
        banner = page.locator("#banner").bounding_box()  # the tiny model's notice: compact on a phone
        assert banner["height"] < 0.2 * PHONE["height"] and page.locator("#img").bounding_box()["y"] < PHONE["height"]
        ask(page, RED, "What colour is this image?")
        page.wait_for_function(  # the strip came to the top of the screen, the status line under it says something
            """() => {
                const strip = document.getElementById('stages').getBoundingClientRect();
                const status = document.getElementById('status').getBoundingClientRect();
                return strip.top >= -1 && strip.top < 0.25 * window.innerHeight
                    && status.bottom <= window.innerHeight
                    && document.querySelector('#status').innerText.trim() !== '';
            }""",
            timeout=20_000,
        )
        wait_status(page, "Done", 60_000)
        box = page.locator("#p_summary").bounding_box()
        assert box["y"] < PHONE["height"], "the first panel should be in view"
        time.sleep(0.5)  # let the smooth scroll settle before the picture
        page.screenshot(path=str(shots / "screenshot-phone.png"))
    finally:
        page.close()


def test_the_loading_page_turns_into_the_demo_when_its_triton_is_ready(browser, tiny_dir: str, tmp_path) -> None:
    """Started before its Triton (as a deployment may), the app answers at once with the loading notice, waits
    for Triton, and the open page turns into the demo by itself; the demo then answers through Triton."""
    from vlm_demo.triton.contract import ENSEMBLE_MODEL

    port, *triton_ports = free_ports(4)
    url = f"http://127.0.0.1:{port}"
    app = start_app(port, "--triton-url", f"http://127.0.0.1:{triton_ports[0]}", "--triton-timeout", "240")
    triton = None
    page = browser.new_page(viewport=DESKTOP)
    try:
        phase = ""

        def says_it_waits() -> bool:  # first "connecting to Triton", then why it waits
            nonlocal phase
            assert app.poll() is None, "the app exited"
            try:
                health = requests.get(url + "/health", timeout=2)
                assert health.status_code == 503, health.text
                phase = health.json()["loading"]["phase"]
            except requests.RequestException:
                pass
            return "waiting for Triton" in phase

        wait_until(says_it_waits, 60, every=0.2, what="the app to say it waits for Triton")
        response = page.goto(url + "/", wait_until="domcontentloaded")
        assert response.status == 503
        notice = page.locator("#loading")
        assert notice.is_visible() and "getting ready" in notice.inner_text()
        page.wait_for_function(  # the page's own poll brings the progress line up to date
            "() => /waiting for Triton/.test(document.getElementById('message')?.innerText || '')", timeout=20_000
        )
        triton, _, _ = start_triton(
            ["--model", "tiny", "--tiny-dir", tiny_dir, "--device", "cpu"],
            [ENSEMBLE_MODEL],
            tmp_path / "triton.log",
            ports=triton_ports,
        )
        page.locator("#p_conclusion").wait_for(timeout=120_000)  # reloaded itself into the demo
        set_greedy(page)
        ask(page, RED, "What colour is this image?")
        wait_status(page, "Done", 60_000)
        assert "red" in panel_text(page, "conclusion")
        # Think harder through Triton: the status line says the batch held this visitor's candidates only, as the
        # local path does.
        page.locator("#reasoning").get_by_text("Think harder", exact=True).click()
        page.locator("#new_chat").click()  # a first question again: this model's follow-ups are another test's
        before = watch_status(page)
        page.locator("#q textarea").fill("What colour is this image?")
        page.locator("#ask").click()
        done_again(page, before)
        assert status_text(page).startswith("Done · Thought harder: 2 candidates per stage, written side by side · "), (
            status_text(page)
        )
        # Triton goes away: the visitor reads a plain sentence; the address and transport status go to the log.
        stop_triton(triton, triton_ports[0])
        triton = None
        page.locator("#q textarea").fill("What colour is this image?")  # the answered question left the box
        page.locator("#ask").click()
        wait_status(page, "⚠", 60_000)
        assert status_text(page) == (
            "⚠ Model unavailable: The model server is not reachable right now; please try again in a minute."
        )
    finally:
        page.close()
        log = stop_app(app)
        if triton is not None:
            stop_triton(triton, triton_ports[0])
    assert "Traceback" not in log.split("Shutting down")[0], log[-3000:]
    told = [line for line in log.splitlines() if "the visitor reads: The model server is not reachable" in line]
    assert told and f"127.0.0.1:{triton_ports[0]}" in told[0], log[-3000:]


def test_the_api_page_opens_from_its_link_and_its_python_snippet_runs_offline(
    browser, server: str, monkeypatch
) -> None:
    """``?view=api`` opened directly showed the demo alone (Gradio 6.31 loads the panel's code on a footer click
    only); the snippets' example image was Gradio's own, on the internet. Now the link opens the panel, and
    the /ask snippet, copied as the page shows it, runs from the clone with no network."""
    page = browser.new_page(viewport=DESKTOP)
    try:
        page.goto(f"{server}/?view=api", wait_until="domcontentloaded")
        page.locator(".api-docs").wait_for(timeout=30_000)
        snippets = page.locator(".api-docs code, .api-docs pre")
        page.wait_for_function(
            "() => [...document.querySelectorAll('.api-docs code, .api-docs pre')]"
            ".some(e => e.offsetParent && e.innerText.includes('api_name=\"/ask\"'))",
            timeout=30_000,
        )
        shown = [snippets.nth(i).inner_text() for i in range(snippets.count()) if snippets.nth(i).is_visible()]
    finally:
        page.close()
    snippet = next(text for text in shown if 'api_name="/ask"' in text)
    assert "handle_file('assets/tiny/red.png')" in snippet and "githubusercontent" not in snippet, snippet
    monkeypatch.chdir(ROOT)
    namespace: dict[str, Any] = {}
    exec(compile(snippet, "the API page", "exec"), namespace)  # noqa: S102
    outputs = namespace["result"]
    assert outputs[3] and outputs[5].startswith("Done"), outputs


def test_the_browser_tests_left_tracked_files_alone(tracked_before) -> None:
    if os.environ.get("VLM_SCREENSHOT_DIR"):
        pytest.skip("VLM_SCREENSHOT_DIR asked for the README's screenshots to be rewritten")
    assert digests() == tracked_before


def _cancelled(server: str) -> float:
    try:
        return metric(server, 'vlm_requests_total{outcome="cancelled"}')
    except KeyError:
        return 0.0


def test_a_failed_start_shows_the_servers_own_message_on_the_loading_page(browser) -> None:
    """A start that fails after the port is up (here: ``--decode-attention triton`` on a CPU without Triton's
    interpreter) turns the loading page into the server's message and what to do, within seconds; the server
    then ends with the same line (exit 1)."""
    port = free_ports(1)[0]
    env = {k: v for k, v in server_env().items() if k != "TRITON_INTERPRET"}
    proc = start_app(port, "--decode-attention", "triton", env=env)
    page = browser.new_page()
    try:
        deadline = time.monotonic() + 120
        while True:  # the loading page answers from the server's first second
            try:
                page.goto(f"http://127.0.0.1:{port}/", wait_until="domcontentloaded")
                break
            except Exception:
                assert time.monotonic() < deadline and proc.poll() is None, "the loading page never answered"
                page.wait_for_timeout(200)
        # How soon the start fails depends on the machine (the model loads first); the page must then say so
        # while the server lingers (FAILED_LINGER_S), not "has stopped" after it is gone.
        page.wait_for_function("!document.querySelector('h1').textContent.includes('getting ready')", timeout=120_000)
        assert "could not start" in page.locator("h1").inner_text(), page.locator("body").inner_text()
        message = page.locator("#message").inner_text()
        assert "--decode-attention triton: on cpu it runs only under Triton's interpreter" in message, message
        assert "start it again" in page.locator("#hint").inner_text()
        assert proc.wait(30) == 1
    finally:
        page.close()
        if proc.poll() is None:
            stop_app(proc)
