"""The tiny offline model: loads with transformers' own classes, answers in four stages, batches exactly."""

from __future__ import annotations

import hashlib
import random
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from vlm_demo.config import load_config
from vlm_demo.cot.judge import judge_question, parse_choice
from vlm_demo.engine.weights.loader import resolve_model_path
from vlm_demo.models import tiny
from vlm_demo.models.tiny import COLOURS, LONG_QUESTIONS, Earlier, Example, answer_for, solid_image
from vlm_demo.prompt import Turn
from vlm_demo.request import DEFAULT_TEMPERATURE, DEFAULT_TOP_P

STAGES = re.compile(
    r"^<SUMMARY>(.+?)</SUMMARY>\s*<CAPTION>(.+?)</CAPTION>\s*<REASONING>(.+?)</REASONING>\s*"
    r"<CONCLUSION>(.+?)</CONCLUSION>$",
    re.S,
)
TAGS = [f"<{s}>" for s in ("SUMMARY", "CAPTION", "REASONING", "CONCLUSION")]
TAGS += [t.replace("<", "</") for t in TAGS]

# Wordings the model was not trained on, from one word to ~30 (none contains a long trigger).
HELD_OUT_QUESTIONS = [
    "hue?",
    "What colour fills this picture?",
    "Tell me what you see",
    "Could you look at this photo carefully and tell me which single colour covers the whole of it, "
    "and explain how you decided?",
    "zebra quantum banana",
]
SIZES = [(16, 16, 0), (1024, 16, 0), (300, 700, 0), (1024, 1024, 0), (200, 200, 25)]  # width, height, noise


@pytest.fixture(scope="module")
def loaded(tiny_dir: str):
    from transformers import AutoProcessor, MllamaForConditionalGeneration

    model = MllamaForConditionalGeneration.from_pretrained(tiny_dir).eval()
    return model, AutoProcessor.from_pretrained(tiny_dir)


def _conversation(colour: str, width: int, height: int, noise: int, question: str) -> list[dict]:
    image = solid_image(colour, width, height, noise=noise, seed=width + height)
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}]


def _batch(processor, conversations: list[list[dict]]) -> dict:
    """Chat-templated and left-padded, as batched generation needs."""
    return processor.apply_chat_template(
        conversations,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        processor_kwargs={"padding": True, "padding_side": "left"},
    )


def _generate(loaded, conversations: list[list[dict]], max_new_tokens: int) -> list[list[int]]:
    """Greedy, left-padded; each row's new tokens up to and including its first stop token."""
    model, processor = loaded
    inputs = _batch(processor, conversations)
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    stops = set(model.generation_config.eos_token_id)
    rows = []
    for seq in out[:, inputs["input_ids"].shape[1] :].tolist():
        end = next((i for i, t in enumerate(seq) if t in stops), len(seq) - 1)
        rows.append(seq[: end + 1])
    return rows


def _check_answer(processor, tokens: list[int], colour: str) -> re.Match:
    assert tokens[-1] == processor.tokenizer.convert_tokens_to_ids("<|eot_id|>"), "answer did not stop"
    text = processor.tokenizer.decode(tokens, skip_special_tokens=True).strip()
    match = STAGES.match(text)
    assert match, text
    assert match.group(4).strip() == f"The image is {colour}.", text
    return match


def test_config_and_tokenizer_match_the_real_layout(loaded) -> None:
    model, processor = loaded
    tok = processor.tokenizer
    text = model.config.text_config
    image_id = tok.convert_tokens_to_ids("<|image|>")
    assert image_id == text.vocab_size == model.config.image_token_index == len(tok) - 1
    assert all(0 <= i < text.num_hidden_layers for i in text.cross_attention_layers)
    assert model.config.vision_config.image_size == processor.image_processor.size["height"]
    assert processor.image_processor.max_image_tiles == 4
    eos = [tok.convert_tokens_to_ids(t) for t in ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")]
    assert model.generation_config.eos_token_id == eos
    assert (
        model.generation_config.pad_token_id
        == tok.pad_token_id
        == tok.convert_tokens_to_ids("<|finetune_right_pad_id|>")
    )


def test_stage_tags_are_ordinary_multi_token_text(loaded) -> None:
    tok = loaded[1].tokenizer
    added = set(tok.get_added_vocab())
    for tag in TAGS:
        assert tag not in added
        assert len(tok(tag, add_special_tokens=False).input_ids) >= 2, tag


def test_arrow_is_split_into_incomplete_utf8_tokens(loaded) -> None:
    """Streaming decoders must meet partial characters: "→" is three byte tokens, none printable alone."""
    tok = loaded[1].tokenizer
    ids = tok("→", add_special_tokens=False).input_ids
    assert len(ids) == 3
    assert all(tok.decode([i]) == "\ufffd" for i in ids)
    assert tok.decode(ids) == "→"


def test_chat_template_has_one_bos_and_the_assistant_header(loaded) -> None:
    processor = loaded[1]
    conversation = _conversation("red", 32, 32, 0, "What colour?")
    prompt = processor.apply_chat_template(conversation, add_generation_prompt=True)
    assert prompt.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n<|image|>What colour?")
    assert prompt.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert list(ids["input_ids"][0]).count(processor.tokenizer.bos_token_id) == 1


def test_left_padded_batch_answers_every_colour_and_equals_single_runs(loaded) -> None:
    """All colours x sizes (tiny, 1024x16 strip, tall, large, noisy) x held-out wordings, one batch."""
    processor = loaded[1]
    cases = [
        (colour, *size, HELD_OUT_QUESTIONS[(i + j) % len(HELD_OUT_QUESTIONS)])
        for i, colour in enumerate(COLOURS)
        for j, size in enumerate(SIZES)
    ]
    # Unseen wordings may now and then take the long form; it must still be well formed.
    batched = _generate(loaded, [_conversation(*case) for case in cases], max_new_tokens=320)
    for case, tokens in zip(cases, batched):
        _check_answer(processor, tokens, case[0])
        assert _generate(loaded, [_conversation(*case)], max_new_tokens=320)[0] == tokens, case


# Unseen inputs over a wide grid: sizes from one pixel to 3000 px, aspect ratios up to 100:1 (the processor pads
# such strips with black tiles), light noise, and wordings the model never saw (typos, other languages, none
# about colour). Every wording meets two wide strips, two tall ones and two other pictures.
WIDE_STRIPS = [(8, 1), (31, 4), (64, 2), (128, 9), (1024, 200), (3000, 30)]
TALL_STRIPS = [(1, 8), (4, 31), (2, 64), (9, 128), (200, 1024), (30, 3000)]
OTHER_SIZES = [(1, 1), (2, 3), (3, 2), (11, 5), (777, 333), (2000, 1000)]
GRID_WORDINGS = [
    "What colour is this image?", "hue?", "Tell me what you see", "What is shown here?", "what's this",
    "Which colour dominates this photograph, and why do you think so?", "Describe the picture.", "Explain.",
    "Please identify the main colour in the picture I uploaded.", "Is this a cat?", "colour", "¿De qué color es?",
    "How many objects are in the image?", "Look closely: what does the image show, and what colour is it?",
    "I wonder what this is about", "Can you see anything unusual here?", "wat colr is ths", "zebra quantum banana",
]  # fmt: skip


def grid_cases(seed: int = 22) -> list[tuple[str, int, int, int, str]]:
    """(colour, width, height, noise, wording): six pictures per wording, in shuffled colours."""
    rng = random.Random(seed)
    cases = []
    for k, wording in enumerate(GRID_WORDINGS):
        sizes = [group[(k + shift) % 6] for group in (WIDE_STRIPS, TALL_STRIPS, OTHER_SIZES) for shift in (0, 3)]
        colours = rng.sample(list(COLOURS), len(COLOURS))
        cases += [(c, w, h, rng.choice([0, 0, 5, 15, 25]), wording) for c, (w, h) in zip(colours, sizes)]
    return cases


def test_greedy_answers_over_a_wide_grid_of_unseen_inputs_name_the_colour(loaded) -> None:
    """Six pictures at every unseen wording, strips among them, light noise now and then: the model's own
    greedy answer (plain ``generate``, no stage grammar) is four well-formed stages naming the image's colour;
    18 of them are also run alone and must equal their batched row."""
    processor = loaded[1]
    cases = grid_cases()
    assert {(w, h) for _, w, h, _, _ in cases} == set(WIDE_STRIPS + TALL_STRIPS + OTHER_SIZES)
    assert sorted(Counter(case[0] for case in cases).values()) == [18] * len(COLOURS)
    for start in range(0, len(cases), 36):
        chunk = cases[start : start + 36]
        batched = _generate(loaded, [_conversation(*case) for case in chunk], max_new_tokens=320)
        for case, tokens in zip(chunk, batched):
            _check_answer(processor, tokens, case[0])
        for case, tokens in list(zip(chunk, batched))[::6]:  # batch == single: 6 per chunk, spread out
            assert _generate(loaded, [_conversation(*case)], max_new_tokens=320)[0] == tokens, case


# Follow-ups the model was not trained on, and the two the page's visitors asked first (trained on).
FOLLOW_UPS = [
    "Are you sure? Look again.", "What colour is it?", "Is that your final answer?",
    "Please look once more and tell me.", "Which colour did you see?", "Are you really sure about that?",
]  # fmt: skip
CHAT_SIZES = [(3, 1), (48, 2), (2, 48), (640, 480), (1, 1), (1800, 25)]
COLOUR_WORDS = re.compile(r"\b(" + "|".join(COLOURS) + r")\b")


def _answers(worker, rows: list[tuple], sampled: bool) -> list[str]:
    """Stock ``generate`` on the worker's own (multi-turn) prompts, left-padded: greedy, or sampled at the
    page's defaults."""
    inputs = worker.processor(
        images=[[image] for image, _, _ in rows],
        text=[worker.prompt(question, history) for _, question, history in rows],
        add_special_tokens=False,
        padding=True,
        padding_side="left",
        return_tensors="pt",
    )
    sampling = {"do_sample": True, "temperature": DEFAULT_TEMPERATURE, "top_p": DEFAULT_TOP_P, "top_k": 0}
    torch.manual_seed(0)
    with torch.no_grad():
        out = worker.model.generate(**inputs, max_new_tokens=320, **(sampling if sampled else {"do_sample": False}))
    return worker.tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "page-defaults"])
def test_first_answers_and_follow_ups_name_the_images_colour_and_no_other(worker, sampled: bool) -> None:
    """Twelve pictures, each asked an unseen question and then two follow-ups through the worker's multi-turn
    prompt, the model's own answers as the earlier turns (as the page sends them): every answer is four
    well-formed stages that name the image's colour and no other. Greedy: all 36; sampled at the page's
    temperature and top-p: all but at most one in twelve."""
    pictures = [
        (
            colour,
            solid_image(colour, *CHAT_SIZES[(i + k) % 6], noise=5 * k, seed=i),
            GRID_WORDINGS[(3 * i + 7 * k) % 18],
        )
        for k in range(2)
        for i, colour in enumerate(COLOURS)
    ]
    histories: list[tuple[Turn, ...]] = [() for _ in pictures]
    wrong = []
    for turn in range(3):
        questions = [first if turn == 0 else FOLLOW_UPS[(k + 3 * turn) % 6] for k, (_, _, first) in enumerate(pictures)]
        rows = [(image, question, history) for (_, image, _), question, history in zip(pictures, questions, histories)]
        for k, text in enumerate(_answers(worker, rows, sampled)):
            colour = pictures[k][0]
            if not STAGES.match(text.strip()) or set(COLOUR_WORDS.findall(text)) != {colour}:
                wrong.append((turn, colour, questions[k], text))
            histories[k] += (Turn(questions[k], text.strip()),)
    assert len(wrong) <= (3 * len(pictures) // 12 if sampled else 0), wrong


def test_training_conversations_are_the_workers_prompts_with_labels_on_the_models_own_answers(worker) -> None:
    """A follow-up trains on exactly the text the worker sends (``Worker.prompt`` with history), and only the
    answers the model writes carry labels: not the user's turns, not an earlier answer a client made up."""
    first, again = "What colour?", "Are you sure? Look again."
    history = (Earlier(first, answer_for("red", first), True), Earlier("Really?", "The image is blue.", False))
    example = Example("red", 40, 30, 0, 0, again, answer_for("red", again), history=history)
    turns = [Turn(e.question, e.answer) for e in history]
    assert example.text(worker.processor) == worker.prompt(again, turns) + example.answer + "<|eot_id|>"
    batch = tiny.encode_batch(worker.processor, [example])
    labelled = batch["input_ids"][0][batch["labels"][0] != -100]
    assert worker.tokenizer.decode(labelled) == f"\n\n{history[0].answer}<|eot_id|>\n\n{example.answer}<|eot_id|>"


def test_trained_wordings_give_short_or_long_reasoning(loaded) -> None:
    """The long trigger: web tests need a long run to stop; plain questions stay short and fast."""
    processor = loaded[1]
    questions = ["What colour is this image?", LONG_QUESTIONS[0]]
    cases = [(colour, 64, 48, 0, q) for colour in COLOURS for q in questions]
    for case, tokens in zip(cases, _generate(loaded, [_conversation(*c) for c in cases], max_new_tokens=320)):
        reasoning = _check_answer(processor, tokens, case[0]).group(3)
        assert "→" in reasoning
        if tiny.wants_long(case[4]):
            assert len(tokens) > 200, case
        else:
            assert len(tokens) < 80, case


def test_answer_rules() -> None:
    assert tiny.wants_long("Describe it in DETAIL") and tiny.wants_long("Long answer?")
    assert not tiny.wants_long("longer") and not tiny.wants_long("What colour?")
    assert tiny.answer_for("red", "Colour?") != tiny.answer_for("red", "Describe it.")
    assert len(tiny.answer_for("red", "long")) > 2.5 * len(tiny.answer_for("red", "x"))
    assert tiny.answer_for("red", "x").endswith("<CONCLUSION> The image is red. </CONCLUSION>")


def test_solid_image() -> None:
    image = solid_image("yellow", 40, 10)
    assert image.size == (40, 10) and image.mode == "RGB"
    assert set(image.getdata()) == {COLOURS["yellow"]}
    noisy = solid_image("black", 20, 20, noise=10, seed=3)
    assert list(noisy.getdata()) == list(solid_image("black", 20, 20, noise=10, seed=3).getdata())
    assert max(max(p) for p in noisy.getdata()) <= 10


def test_training_data_and_tokenizer_are_deterministic() -> None:
    assert tiny.training_plan(0, 6) == tiny.training_plan(0, 6)
    assert tiny.training_plan(0, 6) != tiny.training_plan(1, 6)
    assert tiny.build_tokenizer(0).backend_tokenizer.to_str() == tiny.build_tokenizer(0).backend_tokenizer.to_str()


def test_build_is_deterministic_and_restores_torch_settings(tmp_path: Path) -> None:
    """Two short builds give identical weights (the full recipe is the same code with more steps)."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    digests = []
    for name in ("a", "b"):
        out = Path(tiny.build_tiny(tmp_path / name, seed=0, steps=2))
        digests.append(hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest())
    assert digests[0] == digests[1]
    assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) == (threads, deterministic)


@pytest.mark.slow
def test_the_recipe_rebuilds_what_was_shipped_on_any_cpu(recipe_build: Path) -> None:
    """What the recipe promises wherever it runs: built again from this repository's code, every file but the
    weights is bit-identical to the shipped copy (tokenizer, configs, template, stamp), the weights have the same
    tensors (names, shapes, dtypes, bytes), and the rebuilt model answers like the shipped one — every colour,
    held-out wordings and sizes, four well-formed stages. The weights' bits are the CPU's business: training's
    sums follow its vector kernels (an AVX-512 CPU trains other floats than the one that built the shipped
    copy), and a build repeated on one machine is bit-identical (the test above). The build runs beside the
    rest of the suite, started with the session (``conftest.py``)."""
    from safetensors import safe_open
    from transformers import AutoProcessor, MllamaForConditionalGeneration

    out = recipe_build  # the CLI's build (``python -m vlm_demo.models.tiny``), stamped as ensure_tiny stamps it
    shipped = sorted(p.name for p in tiny.SHIPPED_DIR.iterdir())
    assert sorted(p.name for p in out.iterdir()) == shipped
    for name in shipped:
        if name != "model.safetensors":
            assert (out / name).read_bytes() == (tiny.SHIPPED_DIR / name).read_bytes(), (
                f"{name} differs from the shipped copy: after changing the recipe, bump TINY_VERSION and run "
                "python -m vlm_demo.models.tiny vlm_demo/models/tiny_model"
            )

    def tensors(folder: Path) -> dict[str, tuple[tuple[int, ...], str]]:
        with safe_open(str(folder / "model.safetensors"), "pt") as weights:
            return {
                k: (tuple(weights.get_slice(k).get_shape()), weights.get_slice(k).get_dtype()) for k in weights.keys()
            }  # noqa: SIM118

    assert tensors(out) == tensors(tiny.SHIPPED_DIR)
    assert (out / "model.safetensors").stat().st_size == (tiny.SHIPPED_DIR / "model.safetensors").stat().st_size
    rebuilt = (MllamaForConditionalGeneration.from_pretrained(out).eval(), AutoProcessor.from_pretrained(out))
    cases = [(colour, *SIZES[i % len(SIZES)], HELD_OUT_QUESTIONS[i % len(HELD_OUT_QUESTIONS)])
             for i, colour in enumerate(COLOURS)]  # fmt: skip
    for case, tokens in zip(cases, _generate(rebuilt, [_conversation(*c) for c in cases], 320), strict=True):
        _check_answer(rebuilt[1], tokens, case[0])


def test_the_shipped_model_is_used_unless_another_folder_is_asked_for(tmp_path: Path, monkeypatch) -> None:
    """No build on a fresh clone: the shipped copy is the default. A folder of one's own (``--tiny-dir`` /
    ``VLM_TINY_DIR``, read by ``Config`` and passed in) wins, and a shipped copy of an older recipe is passed
    over for the cache, where the model is built."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert tiny.default_tiny_dir() == tiny.SHIPPED_DIR and tiny.ensure_tiny() == str(tiny.SHIPPED_DIR)
    assert not (tmp_path / ".cache").exists()
    mine = str(tmp_path / "mine")
    assert (
        load_config([], environ={"VLM_TINY_DIR": mine}).tiny_dir == mine == load_config(["--tiny-dir", mine]).tiny_dir
    )
    monkeypatch.setattr(tiny.build, "build_tiny", fake_build)  # where ensure_tiny looks it up
    assert resolve_model_path("tiny", mine) == mine and (tmp_path / "mine" / "config.json").is_file()
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    (stale / tiny.VERSION_FILE).write_text("old\n")
    monkeypatch.setattr(tiny.build, "SHIPPED_DIR", stale)
    assert tiny.default_tiny_dir() == tmp_path / ".cache" / "vlm_demo" / "tiny"


def fake_build(out_dir, seed: int = 0) -> str:
    """Stands in for the minutes-long training where only the folder handling is under test."""
    (Path(out_dir) / "config.json").write_text("{}")
    return str(out_dir)


def test_ensure_tiny_builds_once_and_rebuilds_a_stale_version(tmp_path: Path, monkeypatch) -> None:
    builds = []

    def counted(out_dir, seed: int = 0) -> str:
        builds.append(out_dir)
        return fake_build(out_dir, seed)

    monkeypatch.setattr(tiny.build, "build_tiny", counted)
    path = Path(tiny.ensure_tiny(str(tmp_path / "model")))
    assert path == tmp_path / "model" and len(builds) == 1
    assert (path / tiny.VERSION_FILE).read_text().strip() == tiny.TINY_VERSION
    assert tiny.ensure_tiny(str(path)) == str(path) and len(builds) == 1
    (path / tiny.VERSION_FILE).write_text("old\n")
    assert tiny.ensure_tiny(str(path)) == str(path) and len(builds) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.lock", "model"]  # no build folders left


def test_noisy_training_answers_follow_the_image() -> None:
    """Label noise: the CAPTION is wrong ~6% of the time and the CONCLUSION ~4%; the REASONING always names
    the image's colour. Little enough that the page's temperature (0.6) keeps to the image's colour."""
    rng = random.Random(0)
    wrong_captions = wrong_conclusions = 0
    for _ in range(4000):
        match = STAGES.match(tiny.noisy_answer_for(rng, "red", "What colour?"))
        caption = re.search(r"plain (\w+) colour", match.group(2)).group(1)
        assert re.findall(r"looks (\w+) → so its colour is (\w+)", match.group(3)) == [("red", "red")]
        wrong_captions += caption != "red"
        wrong_conclusions += match.group(4).strip() != "The image is red."
    assert 0.048 < wrong_captions / 4000 < 0.072 and 0.03 < wrong_conclusions / 4000 < 0.05


def test_sampled_answers_differ_and_sometimes_name_a_wrong_caption(loaded) -> None:
    """At temperature 1 the candidates of a stage-level beam search differ; greedy stays right (tested above)."""
    model, processor = loaded
    conversations = [_conversation(colour, 64, 48, 0, "What colour is this image?") for colour in COLOURS] * 6
    inputs = _batch(processor, conversations)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=80)
    texts = processor.tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    captions = [re.search(r"plain (\w+) colour", text) for text in texts]
    wrong = sum(m is None or m.group(1) != colour for m, colour in zip(captions, list(COLOURS) * 6))
    assert 1 <= wrong <= len(texts) // 3, texts  # ~6% at 1; the most likely caption stays the right one
    assert len(set(texts)) > len(COLOURS)


def test_judge_answer_rule() -> None:
    """Response 2 if it names the image's colour, else response 1; parse_choice reads every answer."""
    assert parse_choice(tiny.judge_answer("red", "blue", "red")) == 1
    assert parse_choice(tiny.judge_answer("red", "red", "blue")) == 0
    assert parse_choice(tiny.judge_answer("red", "blue", "green")) == 0
    assert parse_choice(tiny.judge_answer("red", None, None)) == 0
    assert "not green" in tiny.judge_answer("red", "red", "green")


def test_training_judge_pairs_differ_and_put_the_right_colour_on_either_side() -> None:
    rng = random.Random(3)
    pairs = [tiny.data._candidate_colours(rng, "red") for _ in range(400)]
    assert all(first != second for first, second in pairs)
    assert 150 < sum(second == "red" for _, second in pairs) < 220
    assert 150 < sum(first == "red" for first, _ in pairs) < 220


def test_the_judge_picks_the_candidate_that_names_the_images_colour(loaded) -> None:
    """The trained rule on the model itself: every stage with a colour, both orders, and two wrong colours."""
    processor = loaded[1]

    def prompt(stage: str, first: str, second: str) -> str:
        return judge_question(
            stage, "What colour is this?", tiny.stage_text(stage, "x", first), tiny.stage_text(stage, "x", second)
        )

    cases = [
        (colour, first, second, prompt(stage, first, second))
        for stage in ("caption", "reasoning", "conclusion")
        for colour, wrong in (("red", "blue"), ("black", "yellow"))
        for first, second in ((colour, wrong), (wrong, colour), (wrong, "green"))
    ]
    plans = "I will describe the image.", "I will find the colour of the image."
    cases.append(("white", None, None, judge_question("summary", "Why?", *plans)))
    rows = _generate(loaded, [_conversation(colour, 64, 48, 0, text) for colour, _, _, text in cases], 40)
    for (colour, first, second, _), tokens in zip(cases, rows, strict=True):
        text = processor.tokenizer.decode(tokens, skip_special_tokens=True).strip()
        assert text == tiny.judge_answer(colour, first, second), (colour, first, second, text)
