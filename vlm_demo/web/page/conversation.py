"""A visitor's conversation about one image: the turns answered so far and the question asked last.

Pure and immutable (it lives in the page's ``gr.State``, one per browser tab): the page asks it what
history a new question carries, records how an answer ended, and takes the last turn back for Retry.
A new image or Clear starts a new one. Only answers that finished (not stopped, not failed) become
turns: a stopped answer is not something the visitor wants the model to build on.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlm_demo.prompt import Turn, recent_turns


@dataclass(frozen=True)
class Conversation:
    turns: tuple[Turn, ...] = ()
    asked: str = ""  # the last question asked, answered or not: what Retry asks again
    answered: bool = False  # whether ``asked`` got an answer, which is then the last turn

    @classmethod
    def of(cls, state: object) -> Conversation:
        """The page's state value (``None`` before the first question)."""
        return state if isinstance(state, Conversation) else cls()

    def history(self) -> tuple[Turn, ...]:
        """The earlier turns a new question carries: the newest that fit the caps."""
        return recent_turns(self.turns)

    @property
    def dropped(self) -> int:
        """Earlier turns too old to be sent any more (the page says so)."""
        return len(self.turns) - len(self.history())

    def finished(self, question: str, answer: str) -> Conversation:
        return Conversation((*self.turns, Turn(question, answer)), question, True)

    def unfinished(self, question: str) -> Conversation:
        return Conversation(self.turns, question, False)

    def retry(self) -> Conversation:
        """Back to before the last question (its answer, if any, forgotten), to ask it again."""
        turns = self.turns[:-1] if self.answered else self.turns
        return Conversation(turns, self.asked, False)
