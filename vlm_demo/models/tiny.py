"""A tiny, real Mllama model trained offline to answer like LLaVA-CoT, so everything runs without the 21 GB model.

The package ships it built (``tiny_model/``, 1.4 MB), so a fresh clone serves at once; ``python -m
vlm_demo.models.tiny OUT_DIR`` builds it again in about 5 minutes of one CPU core (no network,
deterministic on one machine; on another CPU the weights' bits differ, not the answers, which a test checks): a
byte-level BPE tokenizer with the Llama-3 specials, the Llama-3.2-Vision chat template, an
``MllamaImageProcessor`` with 16-pixel tiles (4 tiles at most), and a ~331k-parameter
``MllamaForConditionalGeneration`` trained on solid-colour images.
Everything loads with transformers' own ``from_pretrained`` / ``AutoProcessor``, so the code under test is the
code that serves the real model.

What the trained model does under greedy decoding, for a solid-colour image (``COLOURS``; 1-3000 px, any
aspect ratio up to 100:1 and beyond, light noise) and any short question: exactly ``answer_for``, e.g. ::

    <SUMMARY> I will find the colour of the image. </SUMMARY>

    <CAPTION> The image is filled with one plain red colour. </CAPTION>

    <REASONING> Every part of the image looks red → so its colour is red. </REASONING>

    <CONCLUSION> The image is red. </CONCLUSION><|eot_id|>

about 58 tokens. Triggers, decided on the question's words (see ``answer_for``):

- Long answer: the word "long", or a word starting with "detail" ("detail", "details", "detailed"), in lower
  case or capitalised, makes the REASONING a count "part 1 is red, ..., part 30 is red" (~240 tokens in
  all), long enough to press Stop on. Reliable for the wordings in ``LONG_QUESTIONS`` (use those in tests);
  other wordings usually work. Unseen questions without a trigger now and then get the long form too; it is
  still a well-formed four-stage answer naming the right colour.
- SUMMARY sentence: "... every part of the image in detail." for the long form, "I will find the colour of
  the image." if the question says "colour"/"color", otherwise "I will describe the image."
- Every REASONING contains "→", which the tokenizer never saw in training: it is three single-byte tokens,
  each an incomplete UTF-8 sequence, so streamed decoding must hold back partial characters.

Follow-up questions: trained on conversations exactly as the worker builds them (``Worker.prompt`` /
``chat_messages`` with history: the image in the first user turn, earlier answers as assistant turns), a
follow-up ("Are you sure? Look again.", "What colour is it?", any question) gets the same kind of answer as a
first question, by the same rules on its own words, naming the image's colour. Earlier answers are read, not
trusted: some training conversations carry a client's made-up earlier answer naming another colour, and the
next answer still follows the image.

Sampling gives different answers (for stage-level beam search): the training answers carry label noise
(``noisy_answer_for``): the CAPTION names a wrong colour 6% of the time and the CONCLUSION 4%, independently;
the REASONING always names the image's colour. The most likely answer stays the clean one, so greedy output is
unchanged; at temperature 1 / top-p 1 about one CAPTION in sixteen names a wrong colour, at the page's
temperature 0.6 / top-p 0.9 (almost) none. The colour words' extra loss weight makes every stage as sure as
the noise allows, on every size (an earlier recipe, with 25% CAPTION noise, no such weight and sizes of 16-1024
px only, had about one answer in eight name another colour at 0.6 on held-out pictures).

The judge task: with the image and the text ``vlm_demo.judge.judge_question(stage, question, first,
second)`` (two different candidate stage texts as ``stage_text`` writes them), the model answers
``judge_answer``'s text, e.g. "Since response 2 says green and the image is not green, I choose response 1."
The rule: response 2 if the colour it names (the last one, if it names several) is the image's, otherwise
response 1 (for SUMMARY candidates, which name
no colour: "Since neither response names a colour, I choose response 1."). The engine only judges candidates
that differ, so in a knockout the winner names the image's colour whenever a candidate does. Earlier judge answers stayed
at chance on pairs where one candidate names the colour (the model kept to response 1): one that named the
image's colour, then each response's colour with a yes/no or right/wrong verdict, then the choice; one that
chose in a single step; one that quoted response 2's colour and the image's, then chose (it quoted both
right but could not compare them). A verdict a few tokens after the quoted colour ("is red" / "is not red") trained
in a few hundred steps, like "Is the image X? yes/no" does.

The stage tags (``<SUMMARY>`` ...) are ordinary text split into several tokens, as in the real model.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from PIL import Image

from vlm_demo.cot import STAGES
from vlm_demo.judge import judge_question
from vlm_demo.prompt import Turn, chat_messages

if TYPE_CHECKING:
    from transformers import MllamaConfig, MllamaForConditionalGeneration, MllamaProcessor, PreTrainedTokenizerFast

log = logging.getLogger(__name__)

TINY_VERSION = "6"  # bump when the recipe changes: cached copies with another stamp are rebuilt
VERSION_FILE = "tiny_version.txt"
# The built model, committed (1.4 MB), so a fresh clone serves at once instead of training for minutes. A test
# rebuilds it from this module and checks every file but the weights is bit-identical, the weights have the same
# tensors and the rebuilt model answers alike; after changing the recipe, bump TINY_VERSION and rebuild it:
# ``python -m vlm_demo.models.tiny vlm_demo/models/tiny_model``.
SHIPPED_DIR = Path(__file__).resolve().with_name("tiny_model")

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 180, 40),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 30),
    "white": (255, 255, 255),
    "black": (0, 0, 0),
}

IMAGE_TOKEN = "<|image|>"
BOS, EOS_TEXT, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>"
START_HEADER, END_HEADER, EOM, EOT = "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>"
# <|python_tag|> is not needed by the demo, but MllamaProcessor looks it up, as in the real vocabulary.
SPECIAL_TOKENS = [BOS, EOS_TEXT, PAD, START_HEADER, END_HEADER, EOM, EOT, "<|python_tag|>"]

# Llama-3's pre-tokenizer split rule: tags like "<SUMMARY>" become several tokens, as in the real model.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Llama-3.2-Vision style: a user turn is a list of {"type": "image"} / {"type": "text"} parts.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|image|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

TILE_SIZE = 16  # vision image_size = the processor's tile size; 16 px (not 28) keeps 4-px patches cheap
MAX_TILES = 4
BPE_VOCAB_SIZE = 1000
LONG_STEPS = 30
CROSS_LAYERS = [2]  # the text layers that attend to the image (of 4)

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
CAPTION_NOISE = 0.06
CONCLUSION_NOISE = 0.04
SHORT_SALAD_WORDS = 3  # curriculum: the first third of training uses short questions
SHORT_SALAD_SHARE = 1 / 3
TWIN_SHARE = 0.5  # short rows followed by a twin with the long trigger (and the long answer's first steps)
LEARNING_RATE = 3e-3
SUMMARY_TOKENS = 16  # answer tokens up to the end of the SUMMARY sentence
SUMMARY_WEIGHT = 10.0
CHOICE_WEIGHT = 30.0  # the judge's decisions: the colour it quotes, "not", "1" or "2"
COLOUR_WEIGHT = 5.0  # the colour each stage of an answer names
WARMUP_STEPS = 20
BUILD_THREADS = 1  # fixed for reproducible sums; 2 threads ran 13x slower when another process shared the 2 cores

SHORT_QUESTIONS = [
    "What colour is this image?",
    "What color is the image?",
    "Which colour do you see?",
    "Describe the image.",
    "What is shown here?",
    "What is in this picture?",
    "Tell me about this picture.",
    "Name the colour.",
    "Is this image red or blue?",
    "Look at the image and answer.",
    "What does the image show? Think step by step.",
    "Explain the picture.",
    # Twins of LONG_QUESTIONS without the trigger, so their other words do not come to mean "long".
    "Describe this image.",
    "Give a short answer: what colour is it?",
    "Please give a description.",
    "What colour is this? Answer in a short way.",
    "Explain the image step by step.",
    "I would like a careful answer.",
    "How big can your answer be?",
    "Go into the colour.",
    "Thanks, please.",
]
# Wordings the long trigger is trained on (reliable choices for tests that need a long answer).
LONG_QUESTIONS = [
    "Describe this image in detail.",
    "Give a long answer: what colour is it?",
    "Please give a detailed description.",
    "What colour is this? Answer in a long way.",
    "Explain the image in detail, step by step.",
    "I would like a long and careful answer.",
    "How long can your answer be?",
    "Go into detail about the colour.",
    "Details, please.",
]

# Follow-up questions trained on (besides any question of the kinds above); tests hold other wordings out.
FOLLOW_UP_QUESTIONS = [
    "Are you sure? Look again.",
    "What colour is it?",
    "What color is it?",
    "Are you sure?",
    "Look again.",
    "Why?",
    "How do you know?",
    "Can you check again?",
    "Is that right?",
    "Tell me again.",
    "What did you say the colour was?",
    "Please repeat the answer.",
    "Is it really that colour?",
    "Could it be another colour?",
    "And the colour?",
    "Which colour again?",
    "Describe it once more.",
    "Check the picture again, please.",
    "No, I meant the picture.",
    "OK, thanks. What else can you see?",
    "Is there anything else?",
    "Give me just the colour.",
]

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

TRIGGER_WORDS = ["long", "detail", "details", "detailed"]
_LONG_RE = re.compile(r"\b(long|detail\w*)\b", re.IGNORECASE)
_COLOUR_RE = re.compile(r"\b(colou?r)\b", re.IGNORECASE)


def solid_image(colour: str, width: int, height: int, noise: int = 0, seed: int = 0) -> Image.Image:
    """A ``width`` x ``height`` RGB image of one of ``COLOURS``, with optional uniform noise of +-``noise``."""
    pixels = np.empty((height, width, 3), dtype=np.int16)
    pixels[...] = COLOURS[colour]
    if noise:
        rng = np.random.default_rng(seed)
        pixels += rng.integers(-noise, noise + 1, size=pixels.shape, dtype=np.int16)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def wants_long(question: str) -> bool:
    """The long-REASONING trigger: the word "long" or a word starting with "detail"."""
    return _LONG_RE.search(question) is not None


def stage_text(stage: str, question: str, colour: str) -> str:
    """One stage's text as the model writes it between its tags (stripped); the SUMMARY names no colour."""
    long = wants_long(question)
    if stage == "summary":
        if long:
            return "I will look at every part of the image in detail."
        return "I will find the colour of the image." if _COLOUR_RE.search(question) else "I will describe the image."
    if stage == "caption":
        return f"The image is filled with one plain {colour} colour."
    if stage == "reasoning":
        if long:
            parts = ", ".join(f"part {i} is {colour}" for i in range(1, 1 + LONG_STEPS))
            return f"Step by step: {parts} → so every part is {colour}."
        return f"Every part of the image looks {colour} → so its colour is {colour}."
    return f"The image is {colour}."


def _tagged(question: str, caption: str, reasoning: str, conclusion: str) -> str:
    """The four tagged stages, each naming the colour given for it (the SUMMARY names none)."""
    colours = {"summary": "", "caption": caption, "reasoning": reasoning, "conclusion": conclusion}
    return "\n\n".join(f"<{s.upper()}> {stage_text(s, question, colours[s])} </{s.upper()}>" for s in STAGES)


def answer_for(colour: str, question: str) -> str:
    """The four-stage answer the tiny model gives under greedy decoding (without the closing ``<|eot_id|>``)."""
    return _tagged(question, colour, colour, colour)


def _other_colour(rng: random.Random, colour: str) -> str:
    return rng.choice([c for c in COLOURS if c != colour])


def noisy_answer_for(rng: random.Random, colour: str, question: str) -> str:
    """A training answer with label noise, so that sampled answers differ while the most likely one stays right.

    The CAPTION names a wrong colour with probability ``CAPTION_NOISE`` and the CONCLUSION, independently, with
    ``CONCLUSION_NOISE``; the REASONING always names the image's colour. Every stage follows the image, not an
    earlier stage's text: a model that learnt to trust a written colour over the image (an earlier recipe
    whose REASONING repeated the CAPTION) went astray on odd questions.
    """
    caption = _other_colour(rng, colour) if rng.random() < CAPTION_NOISE else colour
    conclusion = _other_colour(rng, colour) if rng.random() < CONCLUSION_NOISE else colour
    return _tagged(question, caption, colour, conclusion)


def judge_answer(image_colour: str, first: str | None, second: str | None) -> str:
    """The judge's answer: response 2 if it names the image's colour, otherwise response 1.

    ``first`` / ``second`` are the colours the candidates name (``None``: no colour, as in a SUMMARY). The
    answer quotes response 2's colour and says whether the image is that colour ("is red" / "is not
    red"): a comparison of the image with a word just written, which the tiny model learns (the earlier
    answers in the module docstring it did not). Identical candidates never reach the judge (the engine keeps the first), so on two different
    candidates of a CAPTION or CONCLUSION this is "prefer the one that names the image's colour": if
    response 2 does not, response 1 is no worse.
    """
    if first is None and second is None:
        return "Since neither response names a colour, I choose response 1."
    said = second or "no colour"
    if second == image_colour:
        return f"Since response 2 says {said} and the image is {said}, I choose response 2."
    return f"Since response 2 says {said} and the image is not {said}, I choose response 1."


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


def build_tokenizer(seed: int = 0) -> PreTrainedTokenizerFast:
    """Byte-level BPE with Llama-3 specials; ``<|image|>`` is added last so its id equals the text vocab size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_tokenizer_corpus(seed), trainer)
    bpe.add_special_tokens(SPECIAL_TOKENS)
    bpe.add_special_tokens([IMAGE_TOKEN])
    bos_id = bpe.token_to_id(BOS)
    bpe.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=PAD,
        padding_side="left",  # what batched generation needs; training asks for right padding explicitly
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def build_processor(seed: int = 0) -> MllamaProcessor:
    """Tokenizer + image processor with tiles of the vision ``image_size``."""
    from transformers import MllamaProcessor
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    # The PIL backend explicitly: it works without torchvision, and the saved processor stays the one trained on.
    image_processor = MllamaImageProcessorPil(size={"height": TILE_SIZE, "width": TILE_SIZE}, max_image_tiles=MAX_TILES)
    return MllamaProcessor(
        image_processor=image_processor, tokenizer=build_tokenizer(seed), chat_template=CHAT_TEMPLATE
    )


def build_config(text_vocab_size: int, tokenizer: PreTrainedTokenizerFast) -> MllamaConfig:
    """~331k parameters; the one cross-attention layer (2) lies inside the 4 text layers, else images are ignored."""
    from transformers import MllamaConfig

    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_global_layers=1,
        attention_heads=2,
        image_size=TILE_SIZE,
        patch_size=4,  # 4x4 patches per tile: the one row of colour a 1024x16 strip keeps is 1/4 of a patch
        max_num_tiles=MAX_TILES,
        intermediate_layers_indices=[0],
        vision_output_dim=64,  # hidden_size * (1 + len(intermediate_layers_indices))
        initializer_range=0.02,
    )

    def ids(token: str) -> int:
        found = tokenizer.convert_tokens_to_ids(token)  # one token: one id
        assert isinstance(found, int), token
        return found

    text = dict(
        vocab_size=text_vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        cross_attention_layers=CROSS_LAYERS,
        max_position_embeddings=4096,
        # Llama's theta of 500000 leaves a 16-dim head only ~3 useful frequencies over 300 tokens; counting needs more.
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=ids(BOS),
        eos_token_id=[ids(EOT), ids(EOM), ids(EOS_TEXT)],
        pad_token_id=ids(PAD),
        initializer_range=0.02,
    )
    config = MllamaConfig(vision_config=vision, text_config=text, image_token_index=ids(IMAGE_TOKEN))
    text_config = config.get_text_config()
    assert all(0 <= i < text_config.num_hidden_layers for i in text_config.cross_attention_layers)
    return config


def _open_tanh_gates(model: torch.nn.Module) -> None:
    """Set the tanh gates to 1 so the image reaches the text from step one (they start at 0).

    Only these names: a plain ``"gate" in name`` also hits every MLP ``gate_proj``.
    """
    names = ("cross_attn_attn_gate", "cross_attn_mlp_gate", "gate_attn", "gate_ffn")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.rsplit(".", 1)[-1] in names:
                param.fill_(1.0)


def encode_batch(processor: MllamaProcessor, examples: list[Example]) -> dict[str, torch.Tensor]:
    """Tokenise conversations through the inference path, with labels on the answers the model writes
    (each with its ``<|eot_id|>``) and their per-token ``weights``."""
    batch = processor(
        images=[[ex.image()] for ex in examples],
        text=[ex.text(processor) for ex in examples],
        add_special_tokens=False,  # the template starts with <|begin_of_text|>
        padding=True,
        padding_side="right",
        return_tensors="pt",
    )
    input_ids = batch["input_ids"]
    labels = torch.full_like(input_ids, -100)
    weights = torch.zeros(input_ids.shape)
    decisions = decision_ids(processor.tokenizer)
    end_header, eot = processor.tokenizer.convert_tokens_to_ids([END_HEADER, EOT])
    for row, ex in enumerate(examples):
        ids = input_ids[row]
        assistant_heads = (ids == end_header).nonzero().flatten()[1::2]  # user, assistant, user, ...
        ends = (ids == eot).nonzero().flatten()
        learn = [e.learn for e in ex.history] + [True]
        for turn, head in enumerate(assistant_heads.tolist()):
            if not learn[turn]:
                continue
            end = int(ends[ends > head][0])
            # a cut answer does not end here: no label on the template's closing <|eot_id|>
            stop = end if turn == len(learn) - 1 and not ex.complete else end + 1
            span = slice(head + 1, stop)
            labels[row, span] = ids[span]
            _weigh(weights[row, span], ids[span], ex.judge, decisions)
    return {**batch, "labels": labels, "weights": weights}


def decision_ids(tokenizer: PreTrainedTokenizerFast) -> torch.Tensor:
    """The tokens a judge's answer turns on: the colours it quotes, then "not" and the choice ("1", "2")."""
    words = [*(f"Ġ{c}" for c in COLOURS), "Ġnot", "1", "2"]
    return torch.tensor(tokenizer.convert_tokens_to_ids(words))


def _weigh(weights: torch.Tensor, answer: torch.Tensor, judge: bool, decisions: torch.Tensor) -> None:
    """Per-token loss weights of one answer (in place): its first ``SUMMARY_TOKENS``, its colour words and
    a judge's decisions weigh more.

    They carry the decisions (the SUMMARY's trigger and colour words; the colour each stage names; the judge's
    quote, verdict and choice, ``decision_ids``, most of all); unweighted, the model fits the rest long before
    those generalise. The colour words' weight makes each stage as sure of the image's colour as the label
    noise allows (unweighted, one colour's CAPTION stayed a coin toss with another).
    """
    if judge:
        weights.fill_(SUMMARY_WEIGHT)
        weights[torch.isin(answer, decisions)] = CHOICE_WEIGHT
        return
    weights.fill_(1.0)
    weights[:SUMMARY_TOKENS] = SUMMARY_WEIGHT
    weights[torch.isin(answer, decisions[: len(COLOURS)])] = COLOUR_WEIGHT


@contextmanager
def _deterministic_torch(threads: int) -> Iterator[None]:
    """Fixed thread count and deterministic kernels for the build, restored afterwards (tests share the process)."""
    old_threads, old_det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_det)


def _prefetched(processor: MllamaProcessor, plan: list[list[Example]]) -> Iterator[dict[str, torch.Tensor]]:
    """Encode the next batch on a second thread while this one trains (images and tokenising are ~20% of the time)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        if not plan:
            return
        pending = pool.submit(encode_batch, processor, plan[0])
        for examples in plan[1:]:
            batch = pending.result()
            pending = pool.submit(encode_batch, processor, examples)
            yield batch
        yield pending.result()


def weighted_loss(model: MllamaForConditionalGeneration, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token loss with the per-token weights of ``_weigh``."""
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "weights")}
    logits = model(**inputs).logits[:, :-1]
    targets, weights = batch["labels"][:, 1:], batch["weights"][:, 1:]
    per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="none")
    return (per_token * weights).sum() / weights.sum()


def train(
    model: MllamaForConditionalGeneration, processor: MllamaProcessor, seed: int, steps: int = TRAIN_STEPS
) -> None:
    """AdamW with warm-up and linear decay, one thread; 1500 steps take the loss from ~6.7 to ~0.01 in ~5 CPU minutes."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / WARMUP_STEPS) * max(0.05, 1 - s / max(1, steps))
    )
    model.train()
    started = time.perf_counter()
    for step, batch in enumerate(_prefetched(processor, training_plan(seed, steps))):
        loss = weighted_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 40 == 0 or step == steps - 1:
            left = (time.perf_counter() - started) / (step + 1) * (steps - step - 1)
            log.info("step %d/%d loss %.4f, about %.0f s left", step + 1, steps, loss.item(), left)
    model.eval()


def build_tiny(out_dir: str | os.PathLike, seed: int = 0, *, steps: int = TRAIN_STEPS) -> str:
    """Build, train and save the tiny model + processor into ``out_dir``; returns the path.

    ``steps`` exists so tests can check determinism cheaply; the default is the trained recipe.
    """
    from transformers import GenerationConfig, MllamaForConditionalGeneration

    out = Path(out_dir)
    with _deterministic_torch(BUILD_THREADS):
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        processor = build_processor(seed)
        tokenizer = processor.tokenizer
        image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        config = build_config(text_vocab_size=image_id, tokenizer=tokenizer)
        model = MllamaForConditionalGeneration(config)
        _open_tanh_gates(model)
        log.info("tiny model: %d parameters, text vocab %d", sum(p.numel() for p in model.parameters()), image_id)
        train(model, processor, seed, steps)
    ids = tokenizer.convert_tokens_to_ids
    model.generation_config = GenerationConfig(
        bos_token_id=ids(BOS), eos_token_id=[ids(EOT), ids(EOM), ids(EOS_TEXT)], pad_token_id=ids(PAD)
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return str(out)


def default_tiny_dir() -> Path:
    """The copy shipped with the package (:data:`SHIPPED_DIR`) when it was built by this recipe
    (``TINY_VERSION``); else ``~/.cache/vlm_demo/tiny``, where it is built on first use."""
    if _is_current(SHIPPED_DIR):
        return SHIPPED_DIR
    return Path.home() / ".cache" / "vlm_demo" / "tiny"


def _is_current(path: Path) -> bool:
    stamp = path / VERSION_FILE
    return stamp.is_file() and stamp.read_text().strip() == TINY_VERSION and (path / "config.json").is_file()


def ensure_tiny(path: str | None = None) -> str:
    """Folder of a built tiny model of the current ``TINY_VERSION``, building it first if needed: ``path``
    (``Config.tiny_dir``: ``--tiny-dir`` / ``VLM_TINY_DIR``) if given, else :func:`default_tiny_dir`.

    A file lock makes concurrent processes (pytest and a server it starts) build once; the build goes
    to a temporary folder next to the target and is renamed into place, so readers never see half a model.
    """
    target = Path(path).expanduser() if path else default_tiny_dir()
    if _is_current(target):
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_current(target):
            return str(target)
        log.info("building the tiny model into %s", target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.build-", dir=target.parent))
        try:
            build_tiny(tmp)
            (tmp / VERSION_FILE).write_text(TINY_VERSION + "\n")
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by every process of this user
            if target.exists():  # a stale recipe: move it aside, since os.replace cannot overwrite a folder
                stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
                os.replace(target, stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m vlm_demo.models.tiny", description="Build and train the tiny offline Mllama test model."
    )
    parser.add_argument("out_dir", help="Folder to save the model and processor into.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    start = time.perf_counter()
    path = build_tiny(args.out_dir, seed=args.seed)
    (Path(path) / VERSION_FILE).write_text(TINY_VERSION + "\n")
    print(f"saved tiny model to {path} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
