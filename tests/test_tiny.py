"""The tiny offline model: loads with transformers' own classes, answers in four stages, batches exactly."""

from __future__ import annotations

import hashlib
import random
import re
from pathlib import Path

import pytest
import torch

from vlm_demo.judge import judge_question, parse_choice
from vlm_demo.models import tiny
from vlm_demo.models.tiny import COLOURS, LONG_QUESTIONS, solid_image

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
# about colour).
GRID_SIZES = [
    (1, 1), (2, 3), (3, 2), (5, 9), (8, 1), (1, 8), (11, 5), (17, 23), (31, 4), (64, 2), (2, 64), (128, 9),
    (777, 333), (1024, 200), (200, 1024), (1200, 1800), (3000, 30), (2000, 1000),
]  # fmt: skip
GRID_WORDINGS = [
    "What colour is this image?", "hue?", "Tell me what you see", "What is shown here?", "what's this",
    "Which colour dominates this photograph, and why do you think so?", "Describe the picture.", "Explain.",
    "Please identify the main colour in the picture I uploaded.", "Is this a cat?", "colour", "¿De qué color es?",
    "How many objects are in the image?", "Look closely: what does the image show, and what colour is it?",
    "I wonder what this is about", "Can you see anything unusual here?", "wat colr is ths", "zebra quantum banana",
]  # fmt: skip


def test_greedy_answers_over_a_wide_grid_of_unseen_inputs_name_the_colour(loaded) -> None:
    """Every colour at every grid size, each with another unseen wording and light noise now and then: the
    model's own greedy answer (plain ``generate``, no stage grammar) is four well-formed stages naming the
    image's colour; 18 of them (three per colour) are also run alone and must equal their batched row."""
    processor = loaded[1]
    rng = random.Random(22)
    cases = [
        (colour, w, h, rng.choice([0, 0, 5, 15, 25]), GRID_WORDINGS[(i * 5 + j) % len(GRID_WORDINGS)])
        for i, colour in enumerate(COLOURS)
        for j, (w, h) in enumerate(GRID_SIZES)
    ]
    for start in range(0, len(cases), 36):
        chunk = cases[start : start + 36]
        batched = _generate(loaded, [_conversation(*case) for case in chunk], max_new_tokens=320)
        for case, tokens in zip(chunk, batched):
            _check_answer(processor, tokens, case[0])
        for case, tokens in list(zip(chunk, batched))[::6]:  # batch == single: 3 per colour, spread out
            assert _generate(loaded, [_conversation(*case)], max_new_tokens=320)[0] == tokens, case


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
def test_the_shipped_model_is_exactly_what_the_recipe_builds(tmp_path: Path) -> None:
    """The committed tiny model is reproducible: built again from this repository's code, every file of it
    (weights, tokenizer, configs, stamp) is bit-identical to the shipped copy."""
    out = tmp_path / "rebuilt"
    tiny.build_tiny(out)
    (out / tiny.VERSION_FILE).write_text(tiny.TINY_VERSION + "\n")  # as ensure_tiny and the CLI stamp it
    shipped = sorted(p.name for p in tiny.SHIPPED_DIR.iterdir())
    assert sorted(p.name for p in out.iterdir()) == shipped
    for name in shipped:
        digest = hashlib.sha256((out / name).read_bytes()).hexdigest()
        assert digest == hashlib.sha256((tiny.SHIPPED_DIR / name).read_bytes()).hexdigest(), (
            f"{name} differs from the shipped copy: after changing the recipe, bump TINY_VERSION and run "
            "python -m vlm_demo.models.tiny vlm_demo/models/tiny_model"
        )


def test_the_shipped_model_is_used_unless_another_folder_is_asked_for(tmp_path: Path, monkeypatch) -> None:
    """No build on a fresh clone: the shipped copy is the default. A folder of one's own (``VLM_TINY_DIR``)
    wins, and a shipped copy of an older recipe is passed over for the cache, where the model is built."""
    monkeypatch.delenv(tiny.TINY_DIR_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert tiny.default_tiny_dir() == tiny.SHIPPED_DIR and tiny.ensure_tiny() == str(tiny.SHIPPED_DIR)
    assert not (tmp_path / ".cache").exists()
    monkeypatch.setenv(tiny.TINY_DIR_ENV, str(tmp_path / "mine"))
    assert tiny.default_tiny_dir() == tmp_path / "mine"
    monkeypatch.delenv(tiny.TINY_DIR_ENV)
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    (stale / tiny.VERSION_FILE).write_text("old\n")
    monkeypatch.setattr(tiny, "SHIPPED_DIR", stale)
    assert tiny.default_tiny_dir() == tmp_path / ".cache" / "vlm_demo" / "tiny"


def test_ensure_tiny_builds_once_and_rebuilds_a_stale_version(tmp_path: Path, monkeypatch) -> None:
    builds = []

    def fake_build(out_dir, seed: int = 0) -> str:
        builds.append(out_dir)
        (Path(out_dir) / "config.json").write_text("{}")
        return str(out_dir)

    monkeypatch.setattr(tiny, "build_tiny", fake_build)
    monkeypatch.setenv(tiny.TINY_DIR_ENV, str(tmp_path / "model"))
    path = Path(tiny.ensure_tiny())
    assert path == tmp_path / "model" and len(builds) == 1
    assert (path / tiny.VERSION_FILE).read_text().strip() == tiny.TINY_VERSION
    assert tiny.ensure_tiny() == str(path) and len(builds) == 1
    (path / tiny.VERSION_FILE).write_text("old\n")
    assert tiny.ensure_tiny(str(path)) == str(path) and len(builds) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.lock", "model"]  # no build folders left


def test_noisy_training_answers_follow_the_image() -> None:
    """Label noise: the CAPTION is wrong ~25% of the time and the CONCLUSION ~15%, independently; the REASONING
    always names the image's colour."""
    rng = random.Random(0)
    wrong_captions = wrong_conclusions = 0
    for _ in range(2000):
        match = STAGES.match(tiny.noisy_answer_for(rng, "red", "What colour?"))
        caption = re.search(r"plain (\w+) colour", match.group(2)).group(1)
        assert re.findall(r"looks (\w+) → so its colour is (\w+)", match.group(3)) == [("red", "red")]
        wrong_captions += caption != "red"
        wrong_conclusions += match.group(4).strip() != "The image is red."
    assert 0.22 < wrong_captions / 2000 < 0.28 and 0.12 < wrong_conclusions / 2000 < 0.18


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
    assert 1 <= wrong <= 2 * len(texts) // 3, texts  # ~25% at 1; the most likely caption stays the right one
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
    pairs = [tiny._candidate_colours(rng, "red") for _ in range(400)]
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
