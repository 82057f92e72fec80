"""Split LLaVA-CoT output into its four stages, safely, while it is still streaming.

The model writes ``<SUMMARY>…</SUMMARY><CAPTION>…</CAPTION><REASONING>…</REASONING>
<CONCLUSION>…</CONCLUSION>``, but real outputs miss closing tags, stop mid-stage, repeat a stage or
put text before the first tag, and while streaming the text can end inside a tag (``"<CONC"``).
:func:`parse_stages` is a pure function of the text received so far: it never raises, never shows a
half-written tag, and never lets a tag reach a renderer (``gr.Markdown`` would eat it as HTML), nor a control
character other than newline and tab (the engine's stage structure already keeps them out of answers; this is
the panels' last filter, for a remote model's text too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

STAGES: tuple[str, ...] = ("summary", "caption", "reasoning", "conclusion")

_TAG = re.compile(r"<(/?)\s*(SUMMARY|CAPTION|REASONING|CONCLUSION)\s*>", re.IGNORECASE)
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # control characters but newline and tab
_TAG_TEXTS = tuple(f"<{slash}{name.upper()}>" for name in STAGES for slash in ("", "/"))
_MAX_TAG = max(len(t) for t in _TAG_TEXTS)


@dataclass(frozen=True)
class Stages:
    """The four stage texts, text found outside any tag, and the stage being written now.

    ``active`` is the stage whose opening tag was seen last and not yet closed (``None`` between
    stages, before the first tag and after a closing tag). ``seen`` lists the stages that were
    opened at least once, in order of first appearance.
    """

    summary: str = ""
    caption: str = ""
    reasoning: str = ""
    conclusion: str = ""
    extra: str = ""
    active: str | None = None
    seen: tuple[str, ...] = ()

    def text(self, stage: str) -> str:
        """One stage's text by name (``"summary"`` … ``"conclusion"``)."""
        return getattr(self, stage)

    def as_tuple(self) -> tuple[str, str, str, str]:
        return (self.summary, self.caption, self.reasoning, self.conclusion)


def _partial_tag_start(text: str) -> int:
    """Index where a trailing, possibly unfinished stage tag begins, or ``len(text)`` if none.

    Only a suffix that could still grow into one of the eight tags is held back, so an ordinary
    ``<`` (``"x < 5"``) shows as soon as the next character rules a tag out.
    """
    start = text.rfind("<", max(0, len(text) - _MAX_TAG))
    if start == -1:
        return len(text)
    tail = re.sub(r"\s+", "", text[start:]).upper()
    if ">" not in tail and any(tag.startswith(tail) for tag in _TAG_TEXTS):
        return start
    return len(text)


def parse_stages(text: str, final: bool = False) -> Stages:
    """Parse accumulated model output into :class:`Stages`.

    Rules, chosen so a broken answer still shows everything the model wrote: an opening tag starts
    (or restarts) its stage and implicitly closes any open one; a repeated stage is appended to the
    earlier text; a closing tag ends the open stage (a stray one is dropped); text outside every
    stage goes to ``extra``. Unless ``final`` is true, a trailing partial tag is held back because
    the next token may complete it.
    """
    if not final:
        text = text[: _partial_tag_start(text)]
    parts: dict[str, list[str]] = {name: [] for name in (*STAGES, "extra")}
    seen: list[str] = []
    active: str | None = None
    pos = 0
    for match in _TAG.finditer(text):
        parts[active or "extra"].append(text[pos : match.start()])
        pos = match.end()
        name = match.group(2).lower()
        if match.group(1):  # closing tag: ends whatever stage is open
            active = None
        else:
            if name not in seen:
                seen.append(name)
            elif parts[name]:
                parts[name].append("\n\n")  # a repeated stage continues below the first one
            active = name
    parts[active or "extra"].append(text[pos:])
    joined = {name: CONTROL.sub("", _without_tags("".join(chunks))).strip() for name, chunks in parts.items()}
    return Stages(**joined, active=active, seen=tuple(seen))


def split_thinking(text: str, final: bool = False) -> tuple[str, str]:
    """``(thinking, answer)``: everything before the CONCLUSION's opening tag, tags as written, and the
    CONCLUSION's text (as :func:`parse_stages` reads it), both stripped.

    What OpenAI-style APIs return as ``reasoning_content`` and ``content``. Both only grow as ``text``
    grows (a trailing partial tag is held back unless ``final``), so a streaming reader can send the
    difference each time. An answer that never reaches its CONCLUSION is all thinking.
    """
    if not final:
        text = text[: _partial_tag_start(text)]
    opening = next((m for m in _TAG.finditer(text) if not m.group(1) and m.group(2).upper() == "CONCLUSION"), None)
    if opening is None:
        return text.strip(), ""
    return text[: opening.start()].strip(), parse_stages(text, final=True).conclusion


def _without_tags(text: str) -> str:
    """Remove tags that re-form when pieces around a dropped tag join (``"<SUM" + "MARY>"``)."""
    while True:
        cleaned = _TAG.sub("", text)
        if cleaned == text:
            return text
        text = cleaned
