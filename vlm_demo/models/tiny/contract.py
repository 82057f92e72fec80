"""The tiny model's behaviour contract: what it answers, to which question, and the judge's rule.

A tiny, real Mllama model trained offline to answer like LLaVA-CoT, so everything runs without the 21 GB model.

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

The judge task: with the image and the text ``vlm_demo.cot.judge.judge_question(stage, question, first,
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

import random
import re

from vlm_demo.cot.stages import STAGES
from vlm_demo.models.tiny.pictures import COLOURS

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

LONG_STEPS = 30
CAPTION_NOISE = 0.06
CONCLUSION_NOISE = 0.04

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

TRIGGER_WORDS = ["long", "detail", "details", "detailed"]
_LONG_RE = re.compile(r"\b(long|detail\w*)\b", re.IGNORECASE)
_COLOUR_RE = re.compile(r"\b(colou?r)\b", re.IGNORECASE)


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
