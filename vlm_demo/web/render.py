"""What the page shows for one moment of an answer: pure functions from text and state to :class:`Outputs`.

No Gradio and no I/O here, so every wording and every piece of HTML can be tested on its own: the
four panels (split by :func:`vlm_demo.cot.parse_stages`, so raw tags never reach a renderer), the
status line, the stage strip and the Think-harder candidates.
"""

from __future__ import annotations

import html

from vlm_demo.cot import STAGES, Stages, parse_stages
from vlm_demo.errors import DemoError
from vlm_demo.prompt import Turn
from vlm_demo.results import BeamView, GenerationResult, StageChoice
from vlm_demo.web.contract import Outputs

MARKS = {"active": " ●", "done": " ✓", "cut": " ✂ cut", "stopped": " ■ stopped", "todo": ""}


def stage_states(
    stages: Stages, active: str | None, ended: str | None = None, cut: str | None = None, running: str | None = None
) -> dict[str, str]:
    """Each stage's mark: ``active`` (being written), ``done``, ``cut`` (closed or skipped early to leave room
    for the CONCLUSION, or still open when the token budget ran out), ``stopped`` (still open when the
    answer was stopped or failed), or ``todo``. ``ended`` is how a finished answer ended (a finish reason,
    or "error"); while it streams, every stage seen and not active is done. ``running`` is the stage a
    stage-beam search was writing (its candidates are not in the answer's text yet)."""
    states = {}
    left_open = (running or stages.active) if ended else None
    for stage in STAGES:
        if stage == active:
            state = "active"
        elif stage == cut:
            state = "cut"
        elif stage == left_open and ended != "stop":
            state = "cut" if ended == "length" else "stopped"
        elif stage in stages.seen:
            state = "done"
        else:
            state = "todo"
        states[stage] = state
    return states


def tracker_html(
    stages: Stages, active: str | None, ended: str | None = None, cut: str | None = None, running: str | None = None
) -> str:
    """The stage strip above the panels; page CSS keys on ``data-active``, ``data-done``, ``data-cut`` and
    ``data-stopped`` to mark the panels the same way.

    Marking panels through this one HTML output keeps the panels' API values plain strings (a
    ``gr.update`` with CSS classes would reach API clients as a dict).
    """
    states = stage_states(stages, active, ended, cut, running)
    steps = [f'<span class="step {state}">{stage.upper()}{MARKS[state]}</span>' for stage, state in states.items()]
    body = ' <span class="arrow">→</span> '.join(steps)
    extra = ""
    if stages.extra:
        extra = (
            '<div class="extra"><b>Text outside the four stages:</b><pre>' + html.escape(stages.extra) + "</pre></div>"
        )
    marked = {kind: " ".join(s for s, state in states.items() if state == kind) for kind in ("done", "cut", "stopped")}
    return (
        f'<div class="cot-tracker" data-active="{active or ""}" data-done="{marked["done"]}" '
        f'data-cut="{marked["cut"]}" data-stopped="{marked["stopped"]}">{body}</div>{extra}'
    )


def result_status(result: GenerationResult, stages: Stages | None = None, beams: int = 0) -> str:
    """The status line for a finished answer: how it ended, how it ran (batch size; with a stage-beam
    search's ``beams``, how many of the batch's rows were this answer's candidates) and how fast. What the
    backend could not tell (a remote that reports no batch size, token count or decoding time) is left out."""
    if result.finish_reason == "length" and result.cut_stage == "conclusion":
        head = "Stopped at the max new tokens limit · the CONCLUSION was closed with the last tokens"
    elif result.finish_reason == "length" and result.cut_stage:
        head = (
            f"Stopped at the max new tokens limit · the {result.cut_stage.upper()} was cut short "
            "to leave room for the CONCLUSION"
        )
    elif result.finish_reason == "length":
        head = "Stopped at the max new tokens limit"
    elif stages is not None and stages.seen and "conclusion" not in stages.seen:
        head = "Ended without a CONCLUSION"
    else:
        head = "Done"
    if result.cached:  # replayed: there was no batch and no decoding to report
        return " · ".join([head, "from the response cache", f"{result.completion_tokens} tokens"])
    parts = [head]
    if result.batch_size > 0:
        batch = f"batch of {result.batch_size}"
        if beams:
            batch = f"your {beams} candidates in a batch of {plural(result.batch_size, 'row')}"
        parts.append(batch)
    if result.completion_tokens > 0:
        parts.append(f"{result.completion_tokens} tokens")
    if result.tokens_per_s > 0:
        parts.append(f"{result.tokens_per_s:.1f} tokens/s")
    parts.append(f"{result.total_s:.2f} s")
    if result.queue_s >= 0.05:
        parts.append(f"waited {result.queue_s:.2f} s")
    return " · ".join(parts)


def error_status(error: DemoError) -> str:
    return f"Error ({error.code}): {error}"


def candidates_text(choice: StageChoice) -> str:
    """A stage's panel while its candidates are written and judged: each one, numbered."""
    return "\n\n".join(f"[Candidate {i + 1}] {text or '…'}" for i, text in enumerate(choice.candidates))


def beams_html(view: BeamView | None, stopped: bool = False) -> str:
    """Every stage of a stage-beam search: its candidates, the winner marked, the judge's words (a stage
    still running when the answer was ``stopped`` says so, not "writing…")."""
    if view is None:
        return ""
    blocks = []
    for choice in view.stages:
        running = choice.winner is None
        items = []
        for i, text in enumerate(choice.candidates):
            won = i == choice.winner
            mark = '<span class="won">✓ chosen</span> ' if won else ""
            first = choice.candidates.index(text)
            shown = html.escape(text or "…") if first == i or not text else f"<i>(same as {first + 1})</i>"
            if choice.closed and not choice.closed[i]:
                shown += " <i>(no closing tag: not judged)</i>"
            items.append(f'<li class="cand{" winner" if won else ""}">{mark}{shown}</li>')
        if running and stopped:
            state = "stopped"
        elif running:
            state = "judging…" if view.phase == "judging" else "writing…"
        else:
            state = f"candidate {choice.winner + 1} chosen" if len(choice.candidates) > 1 else "one candidate"
        judge = ""
        if choice.judgements:
            said = "\n".join(html.escape(j) for j in choice.judgements)
            judge = f"<details><summary>Judge</summary><pre>{said}</pre></details>"
        blocks.append(
            f'<div class="beam-stage" data-stage="{choice.stage}" data-state="{"running" if running else "done"}">'
            f"<b>{choice.stage.upper()}</b> · {len(choice.candidates)} candidates · {state}"
            f"<ol>{''.join(items)}</ol>{judge}</div>"
        )
    head = f"Stage beam search · {view.beams} candidates per stage · {plural(view.judge_calls, 'judge call')}"
    return (
        f'<div class="beam-search" data-phase="{view.phase}"><div class="beam-head">{head}</div>{"".join(blocks)}</div>'
    )


def render(
    raw: str,
    status: str | None = None,
    final: bool = False,
    result: GenerationResult | None = None,
    view: BeamView | None = None,
    ended: str | None = None,
) -> Outputs:
    """All outputs for one moment of an answer.

    With ``result`` the status line is the finished answer's (honest about how it ended). With a
    running stage-beam ``view``, the running stage's panel shows its candidates. ``ended`` says how an
    answer that has no result ended ("cancelled" by Stop, "error"), so a stage it left open is marked
    stopped, not done.
    """
    if result is not None:
        ended = result.finish_reason
    elif final and ended is None:
        ended = "stop"
    stages = parse_stages(raw, final=final)
    active = None if final else stages.active
    panels = list(stages.as_tuple())
    running = view.stages[-1] if view is not None and view.stages and view.stages[-1].winner is None else None
    if running is not None and not final:
        panels[STAGES.index(running.stage)] = candidates_text(running)
        active = running.stage
    if result is not None:
        status = result_status(result, stages, view.beams if view is not None else 0)
        if view is not None:
            status += (
                f" · stage beam search: {view.beams} candidates per stage, {plural(view.judge_calls, 'judge call')}"
            )
    status = status or ""
    if final and raw.strip() and not stages.seen:
        status += " · the answer did not use the four stages (shown above the panels)"
    cut = result.cut_stage if result is not None else None
    strip = tracker_html(stages, active, ended if final else None, cut, running.stage if running is not None else None)
    return Outputs(*panels, raw, status, stages.extra, strip, beams_html(view, stopped=final and ended != "stop"))


def waiting_status(ahead: int | None) -> str:
    if ahead:
        return f"Waiting for the model… {ahead} ahead of you"
    return "Waiting for the model…"


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def counter(elapsed: float | None, tokens: int | None = None) -> str:
    """The live counter after the status: tokens written (where known) and whole seconds since Ask."""
    parts = [plural(tokens, "token")] if tokens else []
    if elapsed is not None:
        parts.append(f"{int(elapsed)} s")
    return "".join(f" · {part}" for part in parts)


def progress(
    raw: str,
    view: BeamView | None = None,
    ahead: int | None = None,
    elapsed: float | None = None,
    tokens: int | None = None,
) -> Outputs:
    """The outputs while an answer streams (parsed once): the panels, where the model is, and the counter."""
    if view is not None and view.stages:
        running = view.stages[-1]
        count = max(len(running.candidates), 1 if view.phase == "judging" else view.beams)
        doing = f"judging {count} candidates" if view.phase == "judging" else f"{count} candidates writing"
        return render(raw, f"Thinking harder · {running.stage.upper()}: {doing}…{counter(elapsed)}", view=view)
    stages = parse_stages(raw)
    if raw:
        status = f"Generating · writing {stages.active.upper()}…" if stages.active else "Generating…"
        status += counter(elapsed, tokens)
    else:
        status = waiting_status(ahead) + counter(elapsed)
    return Outputs(*stages.as_tuple(), raw, status, stages.extra, tracker_html(stages, stages.active), "")


def history_html(turns: tuple[Turn, ...], dropped: int = 0) -> str:
    """The earlier turns of a conversation, collapsed above the live panels: each question with its
    CONCLUSION, the four stages inside."""
    if not turns:
        return ""
    items = []
    for number, turn in enumerate(turns, 1):
        stages = parse_stages(turn.answer, final=True)
        answer = stages.conclusion or stages.extra or turn.answer
        parts = "".join(
            f'<div class="turn-stage"><b>{stage.upper()}</b><p>{html.escape(text)}</p></div>'
            for stage, text in zip(STAGES, stages.as_tuple(), strict=True)
            if text
        )
        items.append(
            f'<details class="turn" data-turn="{number}"><summary><span class="turn-q">{html.escape(turn.question)}'
            f'</span> <span class="turn-a">→ {html.escape(answer)}</span></summary>{parts}</details>'
        )
    count = f"{len(turns)} earlier question{'s' if len(turns) != 1 else ''}"
    note = f" · the oldest {dropped} no longer reach the model (too long)" if dropped else ""
    return (
        f'<div class="conversation"><div class="conversation-head">Follow-up about the same image · {count}: '
        f"the model reads them before your question{note}</div>{''.join(items)}</div>"
    )


def cleared() -> Outputs:
    """Empty panels, status and stage strip (new input, Clear button)."""
    return render("", "")
