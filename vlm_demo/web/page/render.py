"""What the page shows for one moment of an answer: pure functions from text and state to :class:`Outputs`.

No Gradio and no I/O here, so every wording and every piece of HTML can be tested on its own: the
four panels (split by :func:`vlm_demo.cot.stages.parse_stages`, so raw tags never reach a renderer), the
status line, the stage strip, the Think-harder candidates, and what a visitor reads of an error.
"""

from __future__ import annotations

import html

from vlm_demo.cot.stages import STAGES, Stages, parse_stages
from vlm_demo.errors import DemoError
from vlm_demo.prompt import Turn
from vlm_demo.request import STAGE_BEAM, ValidParams
from vlm_demo.results import BeamView, GenerationResult, StageChoice
from vlm_demo.web.page.contract import Outputs


def for_visitor(error: DemoError, remote: bool) -> DemoError:
    """The error as a visitor should read it: a remote backend's failure becomes its class's plain sentence
    (``DemoError.remote_words``; same class, so the code and title stay); anything else as it is."""
    plain = error.remote_words if remote else ""
    return type(error)(plain) if plain and str(error) != plain else error


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
    # Each arrow travels with the step it points to: a strip that wraps (a phone) starts its next line with
    # "→ STEP" instead of ending a line on an arrow that points nowhere.
    body = steps[0] + "".join(f'<span class="hop"><span class="arrow">→</span>{step}</span>' for step in steps[1:])
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


def result_status(
    result: GenerationResult, stages: Stages | None = None, beams: int = 0, comparisons: int | None = None
) -> str:
    """The status line for a finished answer: how it ended, how it ran (batch size; with Think harder's
    ``beams``, :func:`thought_harder` instead) and how fast. What the backend could not tell (a remote that
    reports no batch size, token count or decoding time) is left out."""
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
    if beams:
        parts.append(thought_harder(beams, result.batch_size, comparisons))
    elif result.batch_size > 0:
        parts.append(f"batch of {result.batch_size}")
    if result.completion_tokens > 0:
        parts.append(f"{result.completion_tokens} tokens")
    if result.tokens_per_s > 0:
        parts.append(f"{result.tokens_per_s:.1f} tokens/s")
    parts.append(f"{result.total_s:.2f} s")
    if result.queue_s >= 0.05:
        parts.append(f"waited {result.queue_s:.2f} s")
    return " · ".join(parts)


def thought_harder(beams: int, batch_size: int, comparisons: int | None = None) -> str:
    """What Think harder did, in a visitor's words: how many candidates each stage had, how they were written
    (side by side; where the model's batch held more, how many texts it wrote at once: other visitors' answers,
    the next stage's candidates or the comparisons) and how the best was found (the model compares candidates two
    at a time; where all were alike there was nothing to compare). What the backend did not report (a remote
    engine's batch or comparisons) is left out."""
    said = f"Thought harder: {plural(beams, 'candidate')} per stage"
    if batch_size >= beams:
        said += ", written side by side" + (f", up to {batch_size} texts at once" if batch_size > beams else "")
    elif batch_size > 0:
        said += f", written {batch_size} at a time"
    if comparisons == 0:
        said += ", all alike at every stage"
    elif comparisons:
        said += f", the best picked in {plural(comparisons, 'comparison')}"
    return said


def searched_beams(params: ValidParams) -> int:
    """The candidates per stage a request asked for (0: not a stage-beam search), for :func:`render`."""
    return params.beams if params.reasoning == STAGE_BEAM else 0


def error_status(error: DemoError) -> str:
    return f"Error ({error.code}): {error}"


def candidates_text(choice: StageChoice) -> str:
    """A stage's panel while its candidates are written and judged: each one, numbered."""
    return "\n\n".join(f"[Candidate {i + 1}] {text or '…'}" for i, text in enumerate(choice.candidates))


def candidate_groups(choice: StageChoice) -> list[list[int]]:
    """A stage's candidates grouped by identical text (and closing tag), in order of first appearance: a
    confident model often writes the same candidate many times, and one line says so."""
    groups: dict[tuple[str, bool], list[int]] = {}
    for i, text in enumerate(choice.candidates):
        closed = not choice.closed or choice.closed[i]
        groups.setdefault((text, closed), []).append(i)
    return list(groups.values())


def numbers(indexes: list[int]) -> str:
    """Candidate numbers (1-based) with runs shortened: [0, 1, 2, 4] -> "1–3, 5"."""
    runs: list[list[int]] = []
    for i in indexes:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(
        f"{run[0] + 1}–{run[-1] + 1}" if len(run) > 2 else ", ".join(str(i + 1) for i in run) for run in runs
    )


def beams_html(view: BeamView | None, stopped: bool = False) -> str:
    """Every stage of a stage-beam search: its candidates (identical ones on one line, numbered), the winner
    marked, the judge's words (a stage still running when the answer was ``stopped`` says so, not
    "writing…")."""
    if view is None:
        return ""
    blocks = []
    for choice in view.stages:
        running = choice.winner is None
        items = []
        for group in candidate_groups(choice):
            won = choice.winner in group
            mark = '<span class="won">✓ chosen</span> ' if won else ""
            first = group[0]
            shown = html.escape(choice.candidates[first] or "…")
            if choice.closed and not choice.closed[first]:
                shown += " <i>(no closing tag: not judged)</i>"
            same = f' <span class="same">· {len(group)} identical</span>' if len(group) > 1 else ""
            items.append(
                f'<li class="cand{" winner" if won else ""}" data-count="{len(group)}">{mark}'
                f'<span class="nums">{numbers(group)}.</span> {shown}{same}</li>'
            )
        if running and stopped:
            state = "stopped"
        elif choice.winner is None:  # running
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
            f"<ul>{''.join(items)}</ul>{judge}</div>"
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
    beams: int = 0,
) -> Outputs:
    """All outputs for one moment of an answer.

    With ``result`` the status line is the finished answer's (honest about how it ended). With a
    running stage-beam ``view``, the running stage's panel shows its candidates. ``ended`` says how an
    answer that has no result ended ("cancelled" by Stop, "error"), so a stage it left open is marked
    stopped, not done. ``beams``: the candidates per stage the request asked for, for a backend whose
    result carries no search view (a remote engine reports only its batch): the status line says the same.
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
        beams = view.beams if view is not None else beams
        status = result_status(result, stages, beams, view.judge_calls if view is not None else None)
    status = status or ""
    if final and raw.strip() and not stages.seen:
        status += " · the answer did not use the four stages (shown above the panels)"
    cut = result.cut_stage if result is not None else None
    strip = tracker_html(stages, active, ended if final else None, cut, running.stage if running is not None else None)
    summary, caption, reasoning, conclusion = panels
    return Outputs(
        summary,
        caption,
        reasoning,
        conclusion,
        raw,
        status,
        stages.extra,
        strip,
        beams_html(view, stopped=final and ended != "stop"),
    )


def waiting_status(ahead: int | None) -> str:
    if ahead:
        return f"Waiting for the model… {ahead} ahead of you"
    return "Waiting for the model…"


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def counter(elapsed: float | None, tokens: int | None = None, moving: bool = False) -> str:
    """The live counter after the status: tokens written (where known) and the seconds since Ask. While the
    answer is ``moving`` (text or candidates arrive, so the page updates anyway) in tenths, so that even a
    sub-second answer shows its time pass; while it waits, whole seconds, one update a second."""
    parts = [plural(tokens, "token")] if tokens else []
    if elapsed is not None:
        parts.append(f"{elapsed:.1f} s" if moving else f"{int(elapsed)} s")
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
        status = f"Thinking harder · {running.stage.upper()}: {doing}…{counter(elapsed, moving=True)}"
        return render(raw, status, view=view)
    stages = parse_stages(raw)
    if raw:
        stage = writing(stages)
        status = f"Generating · writing {stage.upper()}…" if stage else "Generating…"
        status += counter(elapsed, tokens, moving=True)
    else:
        status = waiting_status(ahead) + counter(elapsed)
    return Outputs(*stages.as_tuple(), raw, status, stages.extra, tracker_html(stages, stages.active), "")


def writing(stages: Stages) -> str | None:
    """The stage the status line says is being written: the open one, or between two stages the next one (the
    model is writing its opening tag), or after the last one that one still; ``None`` before the first. Only the
    status line reads it so (the strip and the panels mark a stage from its opening tag on): it names a stage
    from the first one on and never falls back to a bare "Generating…" at each change of stage."""
    if stages.active or not stages.seen:
        return stages.active
    following = STAGES.index(stages.seen[-1]) + 1
    return STAGES[following] if following < len(STAGES) else stages.seen[-1]


def history_html(turns: tuple[Turn, ...], dropped: int = 0, asking: str = "") -> str:
    """The conversation above the live panels: the earlier turns, collapsed (each question with its CONCLUSION,
    the four stages inside), then the question being answered (``asking``), which stays in view after the
    page empties the question box for the next one."""
    asked = f'<div class="asking"><b>Question</b> {html.escape(asking.strip())}</div>' if asking.strip() else ""
    if not turns:
        return asked
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
        f"the model reads them before your question{note}</div>{''.join(items)}</div>{asked}"
    )


def cleared() -> Outputs:
    """Empty panels, status and stage strip (new input, Clear button)."""
    return render("", "")
