"""The training data generator: seeded conversations, judge prompts and follow-ups, batch by batch, and the
tokenizer's corpus."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

from PIL import Image

from vlm_demo.cot.judge import judge_question
from vlm_demo.cot.stages import STAGES
from vlm_demo.models.tiny.contract import (
    FOLLOW_UP_QUESTIONS,
    LONG_QUESTIONS,
    SHORT_QUESTIONS,
    TRIGGER_WORDS,
    _other_colour,
    answer_for,
    judge_answer,
    noisy_answer_for,
    stage_text,
    wants_long,
)
from vlm_demo.models.tiny.pictures import COLOURS, solid_image
from vlm_demo.prompt import Turn, chat_messages

if TYPE_CHECKING:
    from transformers import MllamaProcessor

TRAIN_STEPS = 1500
BATCH_SIZE = 12
LONG_BATCH_SIZE = 6
JUDGE_BATCH_SIZE = 12
LONG_JUDGE_BATCH_SIZE = 3
# The kind of each training batch, in turn (see make_batch_examples).
BATCH_CYCLE = (
    "short", "judge", "chat", "long", "judge", "chat", "short", "judge", "chat", "long", "judge", "long_judge",
)  # fmt: skip
EARLIER_TURNS = (1, 1, 2, 3)  # how many earlier turns a follow-up row has, drawn evenly from these
CHAT_BATCH_ROWS = {1: 10, 2: 7, 3: 5}  # rows of a follow-up batch by its earlier turns: about 1600 tokens
CLIENT_ANSWER_SHARE = 0.15  # earlier answers that are a client's text, not the model's
CHAT_TWIN_SHARE = 0.2  # follow-ups with the long trigger (and the long answer's first steps)
LONG_CHAT_SHARE = 1 / 2  # long rows in a conversation (half of them the long answer comes first)
JUDGE_STAGE_WEIGHTS = (1, 3, 3, 3)  # SUMMARY, CAPTION, REASONING, CONCLUSION
JUDGE_LONG_QUESTION_SHARE = 0.15  # judge prompts whose question has the long trigger (not for REASONING)
SHORT_SALAD_WORDS = 3  # curriculum: the first third of training uses short questions
SHORT_SALAD_SHARE = 1 / 3
TWIN_SHARE = 0.5  # short rows followed by a twin with the long trigger (and the long answer's first steps)

# Random "word salad" questions keep unseen wordings and lengths from derailing the stages.
SALAD_WORDS = (
    "the a an of to in is it this that what which how why where who when image picture photo colour color "
    "shade hue tone see look show tell name describe explain answer question please could would you me my "
    "your we our they there here some any all one two three big small bright dark light plain square wide "
    "tall left right top bottom middle very quite just only also and or but not with without from about "
    "think step by reason carefully quickly simply exactly really cat dog tree sky sea house car road sun "
    "moon water fire grass snow paint wall paper screen flag box ball cup book chair table door window "
    "happy sad old new good bad best red green blue yellow white black long detail details detailed give "
    "short careful way description thanks like would go into can be step do does did have has was were will "
    "should must may might shall am are been being get got make made know want need find use work call try "
    "ask feel leave put mean keep let begin seem help talk turn start hear play run move live believe hold "
    "bring happen write provide sit stand lose pay meet include continue set learn change lead understand "
    "watch follow stop create speak read allow add spend grow open walk win offer remember love consider "
    "appear buy wait serve die send expect build stay fall cut reach kill remain suggest raise pass sell "
    "people year day thing man world life hand part child eye woman place week case point government "
    "company number group problem fact time way information kind most other such first last great little "
    "own same able different large important early young few public bad next"
).split()

GIBBERISH_LETTERS = "abcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstuvwxyzéèàçüöñ'-"
ONSETS = ["", *"b c d f g h j k l m n p r s t v w z ch sh th ph tr st gr pl br qu".split()]
CODAS = ["", "", "", "n", "r", "s", "t", "m", "l", "nt", "ng", "ck", "st", "rd", "ph"]


class Earlier(NamedTuple):
    """An earlier turn of a training conversation. ``learn``: the answer is one the model would write (it is
    trained on, like the last one); otherwise it is what a client might send (another colour, a bare word) and
    only read: the next answer must follow the image, not what an earlier answer said."""

    question: str
    answer: str
    learn: bool


@dataclass(frozen=True)
class Example:
    """One training conversation: an image recipe, the user's text and the answer the model must learn.

    ``complete=False`` marks a cut answer (the long answer's first steps: cheap rows that teach the long
    trigger and the step counting inside short batches); its ``<|eot_id|>`` gets no label.
    """

    colour: str
    width: int
    height: int
    noise: int
    seed: int
    question: str
    answer: str
    complete: bool = True
    judge: bool = False
    history: tuple[Earlier, ...] = ()  # earlier turns about the same image, oldest first

    def image(self) -> Image.Image:
        return solid_image(self.colour, self.width, self.height, self.noise, self.seed)

    def text(self, processor: MllamaProcessor) -> str:
        """The whole conversation through the chat template, built as the worker builds a prompt
        (``chat_messages``), so training sees exactly what serving sends, follow-ups included."""
        messages = chat_messages(self.question, [Turn(e.question, e.answer) for e in self.history])
        messages.append({"role": "assistant", "content": [{"type": "text", "text": self.answer}]})
        return processor.apply_chat_template(messages)


def _random_size(rng: random.Random) -> tuple[int, int]:
    """Sizes from one pixel to 3000: 40% are strips, which the processor pads with black tiles.

    Half of the strips are extreme (32:1 to 128:1): resized into 4 tiles of 16 px they keep one row of colour
    per tile (a 3000x30 picture looks like a 1024x16 one), and without them the model answers "black". Sides
    are log-uniform, so tiny pictures (upscaled, often onto part of one tile) are as common as large ones.
    """
    draw = rng.random()
    if draw < 0.4:
        long_side = round(2 ** rng.uniform(3, 11.6))
        ratio = 2 ** (rng.uniform(5, 7) if draw < 0.2 else rng.uniform(1.5, 5))
        short = max(1, round(long_side / ratio))
        return (long_side, short) if rng.random() < 0.5 else (short, long_side)
    return round(2 ** rng.uniform(0, 11)), round(2 ** rng.uniform(0, 11))


def _gibberish(rng: random.Random) -> str:
    """A made-up word: unseen words must not flip the long trigger.

    Half are random letters (some accented), half English-like syllables, whose BPE pieces are the ones
    real unseen words ("photograph", "dominant") break into.
    """
    if rng.random() < 0.5:
        return "".join(rng.choices(GIBBERISH_LETTERS, k=rng.randint(1, 9)))
    syllables = (rng.choice(ONSETS) + rng.choice("aeiouy") + rng.choice(CODAS) for _ in range(rng.randint(1, 4)))
    return "".join(syllables)


def _random_question(rng: random.Random, max_words: int = 20) -> str:
    """A question without the long trigger: half fixed wordings, half word salad with some made-up words."""
    if rng.random() < 0.5:
        return rng.choice(SHORT_QUESTIONS)
    count = rng.randint(1, max_words)
    words = [_gibberish(rng) if rng.random() < 0.25 else rng.choice(SALAD_WORDS) for _ in range(count)]
    text = " ".join(w for w in words if not wants_long(w)) or "what"
    if rng.random() < 0.5:
        text = text.capitalize()
    return text + rng.choice(["?", "?", ".", "", "!"])


def _with_trigger(rng: random.Random, question: str) -> str:
    """``question`` with a trigger word (lower case or capitalised) inserted somewhere, now and then alone."""
    word = rng.choice(TRIGGER_WORDS)
    word = rng.choice([word, word, word.capitalize()])
    if rng.random() < 0.05:
        return word + rng.choice(["", "?", "."])
    words = question.split(" ")
    words.insert(rng.randint(0, len(words)), word)
    return " ".join(words)


def _long_question(rng: random.Random) -> str:
    """A question with the long trigger: a trained wording, or a random question with a trigger word added."""
    if rng.random() < 0.4:
        return rng.choice(LONG_QUESTIONS)
    return _with_trigger(rng, _random_question(rng))


def _random_image(rng: random.Random) -> tuple[str, tuple[int, int, int, int]]:
    """Colour, and the width, height, noise and noise seed of a training image."""
    width, height = _random_size(rng)
    noise = 0 if rng.random() < 0.5 else rng.randint(1, 30)
    return rng.choice(list(COLOURS)), (width, height, noise, rng.randrange(2**31))


def _answer_example(rng: random.Random, question: str) -> Example:
    colour, image = _random_image(rng)
    return Example(colour, *image, question, noisy_answer_for(rng, colour, question))


def _candidate_colours(rng: random.Random, colour: str) -> tuple[str, str]:
    """Two different colours: mostly one of them the image's (either one), else neither.

    Never the same colour twice: the engine judges only candidates that differ.
    """
    draw = rng.random()
    if draw < 0.45:
        return colour, _other_colour(rng, colour)
    if draw < 0.9:
        return _other_colour(rng, colour), colour
    first = _other_colour(rng, colour)
    return first, rng.choice([c for c in COLOURS if c not in (colour, first)])


def _judge_example(rng: random.Random, question: str, stage: str) -> Example:
    """The judge task: the image, two candidate texts of one stage, and the choice by ``judge_answer``'s rule."""
    colour, image = _random_image(rng)
    if stage == "summary":  # no colour to compare: the plans of the three kinds of question
        first, second = (stage_text(stage, rng.choice(["colour?", "long", "x"]), "") for _ in range(2))
        text, answer = judge_question(stage, question, first, second), judge_answer(colour, None, None)
    else:
        colours = _candidate_colours(rng, colour)
        first, second = (stage_text(stage, question, c) for c in colours)
        text, answer = judge_question(stage, question, first, second), judge_answer(colour, *colours)
    return Example(colour, *image, text, answer, judge=True)


def _follow_up(rng: random.Random, max_words: int) -> str:
    """A follow-up question: a trained follow-up wording, or any question a first turn could ask."""
    return rng.choice(FOLLOW_UP_QUESTIONS) if rng.random() < 0.5 else _random_question(rng, max_words)


def _client_answer(rng: random.Random, question: str) -> str:
    """An earlier answer the model did not write (an API client sends any text): any colour, any form."""
    colour = rng.choice(list(COLOURS))
    forms = [answer_for(colour, question), f"The image is {colour}.", colour, f"It looks {colour} to me."]
    return rng.choice([*forms, " ".join(rng.choices(SALAD_WORDS, k=rng.randint(1, 12)))])


def _earlier_turns(
    rng: random.Random, colour: str, count: int, max_words: int, long_first: bool = False
) -> tuple[Earlier, ...]:
    """``count`` earlier turns about an image of ``colour``: mostly the model's own (noisy) answers, now and
    then a client's text, which must not sway the next answer."""
    turns = []
    for index in range(count):
        if index == 0:
            question = _long_question(rng) if long_first else _random_question(rng, max_words)
        else:
            question = _follow_up(rng, max_words)
        if rng.random() < CLIENT_ANSWER_SHARE:
            turns.append(Earlier(question, _client_answer(rng, question), learn=False))
        else:
            turns.append(Earlier(question, noisy_answer_for(rng, colour, question), learn=True))
    return tuple(turns)


def _chat_example(rng: random.Random, max_words: int, earlier: int, long_answer: bool = False) -> Example:
    """A follow-up about the same image: ``earlier`` turns, then a question whose answer follows the image."""
    colour, image = _random_image(rng)
    history = _earlier_turns(rng, colour, earlier, max_words)
    question = _follow_up(rng, max_words)
    if long_answer:
        question = _with_trigger(rng, question)
        return Example(colour, *image, question, noisy_answer_for(rng, colour, question), history=history)
    if rng.random() < CHAT_TWIN_SHARE:  # the long answer's first steps, as a short batch's twin rows
        question = _with_trigger(rng, question)
        answer = noisy_answer_for(rng, colour, question)
        cut = answer[: answer.index(f", part {rng.randint(2, 9)} ")]
        return Example(colour, *image, question, cut, complete=False, history=history)
    return Example(colour, *image, question, noisy_answer_for(rng, colour, question), history=history)


def _long_example(rng: random.Random) -> Example:
    """A long answer: alone, as the last answer of a conversation, or as the first of one with a short
    follow-up (a page visitor's "Describe this picture in detail." and then "Are you sure?")."""
    draw = rng.random()
    if draw < LONG_CHAT_SHARE / 2:
        return _chat_example(rng, 20, rng.choice(EARLIER_TURNS), long_answer=True)
    if draw < LONG_CHAT_SHARE:
        colour, image = _random_image(rng)
        history = _earlier_turns(rng, colour, 1, 20, long_first=True)
        question = _follow_up(rng, 20)
        return Example(colour, *image, question, noisy_answer_for(rng, colour, question), history=history)
    return _answer_example(rng, _long_question(rng))


def make_batch_examples(rng: random.Random, kind: str, max_words: int = 20) -> list[Example]:
    """One batch of ``kind`` (the names in ``BATCH_CYCLE``).

    - "short": short answers, some followed by a twin. A twin has the same image and the same question plus
      a trigger word, and keeps only the first steps of the long answer: the pair shows that the trigger word
      alone decides the length, at little cost.
    - "chat": follow-ups: one to three earlier turns, then a question; every answer the model would have
      written is trained on, so the earlier turns teach first answers too.
    - "long": full long answers, half of them in a conversation. Keeping them (and long judge prompts) in
      their own batches stops every short batch being padded to ~300 tokens.
    - "judge": judge prompts on SUMMARY, CAPTION, short REASONING or CONCLUSION candidates.
    - "long_judge": judge prompts on long REASONING candidates (~500 tokens).
    """
    if kind == "long":
        return [_long_example(rng) for _ in range(LONG_BATCH_SIZE)]
    if kind == "chat":  # rows with as many earlier turns, so that little of the batch is padding
        earlier = rng.choice(EARLIER_TURNS)
        return [_chat_example(rng, max_words, earlier) for _ in range(CHAT_BATCH_ROWS[earlier])]
    if kind == "long_judge":
        return [_judge_example(rng, _long_question(rng), "reasoning") for _ in range(LONG_JUDGE_BATCH_SIZE)]
    if kind == "judge":
        batch = []
        for _ in range(JUDGE_BATCH_SIZE):
            stage = rng.choices(STAGES, weights=JUDGE_STAGE_WEIGHTS)[0]
            long_ok = stage != "reasoning" and rng.random() < JUDGE_LONG_QUESTION_SHARE
            question = _long_question(rng) if long_ok else _random_question(rng, max_words)
            batch.append(_judge_example(rng, question, stage))
        return batch
    batch = []
    while len(batch) < BATCH_SIZE:
        example = _answer_example(rng, _random_question(rng, max_words))
        batch.append(example)
        if len(batch) < BATCH_SIZE and rng.random() < TWIN_SHARE:
            question = _with_trigger(rng, example.question)
            answer = noisy_answer_for(rng, example.colour, question)
            cut = answer[: answer.index(f", part {rng.randint(2, 9)} ")]
            batch.append(replace(example, question=question, answer=cut, complete=False))
    return batch


def training_plan(seed: int, steps: int = TRAIN_STEPS) -> list[list[Example]]:
    """All training batches, drawn from one seeded generator: the same seed gives the same data."""
    rng = random.Random(seed)
    return [
        make_batch_examples(
            rng,
            BATCH_CYCLE[step % len(BATCH_CYCLE)],
            max_words=SHORT_SALAD_WORDS if step < steps * SHORT_SALAD_SHARE else 20,
        )
        for step in range(steps)
    ]


def _tokenizer_corpus(seed: int) -> list[str]:
    """Text for BPE training: answers, judge prompts and answers, questions and salad, with non-ASCII removed.

    Keeping "→" out of the BPE corpus means it is never merged: it stays three byte tokens, each an
    incomplete UTF-8 sequence on its own, which is what a streaming decoder must cope with.
    The trigger and colour words are repeated in every casing and position (a question's first word has no
    leading space), so each is one token wherever it stands, not pieces shared with other words ("lo" + "ng").
    """
    rng = random.Random(seed)
    lines = []
    for colour in COLOURS:
        for question in SHORT_QUESTIONS + LONG_QUESTIONS + FOLLOW_UP_QUESTIONS:
            lines += [question, answer_for(colour, question)]
        for stage in STAGES:
            colours = colour, _other_colour(rng, colour)
            first, second = (stage_text(stage, "x", c) for c in colours)
            lines += [judge_question(stage, "x", first, second), judge_answer(colour, *colours)]
    lines.append(judge_answer("red", None, None))
    lines += [" ".join(rng.choices(SALAD_WORDS, k=12)) for _ in range(200)]
    key_words = [*TRIGGER_WORDS, "colour", "color", "no", *COLOURS]
    every_form = [[w, w.capitalize(), f"a {w}", f"A {w.capitalize()}"] for w in key_words * 20 + SALAD_WORDS]
    lines += [line for forms in every_form for line in forms]
    return [line.encode("ascii", "ignore").decode() for line in lines]
