"""Each sampling field is declared once, on ``SamplingParams`` with its knob (``vlm_demo/request.py``), and every
door is built from it: the page's inputs, ``/v1``'s fields, the MCP tool's parameters, the Triton infer
inputs (and the model repository's config), the generate contract's ``sampling_parameters``, the response
cache's key. A field added to one door only, or a door that lists fields of its own, fails here; a field
that crosses a door must come back out the same.
"""

from __future__ import annotations

import dataclasses
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
from support import ROOT, door

from vlm_demo.backends.base import Features
from vlm_demo.backends.cache import cache_key
from vlm_demo.backends.triton import infer
from vlm_demo.backends.triton.generate import encode_image
from vlm_demo.backends.triton.remote import ModelInfo
from vlm_demo.errors import InvalidRequestError
from vlm_demo.models.tiny import solid_image
from vlm_demo.request import DEFAULTS, KNOBS, STAGE_BEAM, Limits, SamplingParams, ValidParams, sampling_from
from vlm_demo.triton import contract
from vlm_demo.triton.handlers import decode_generate_request, decode_infer_request
from vlm_demo.web.api import openai_api
from vlm_demo.web.api.mcp_tool import tool
from vlm_demo.web.page.contract import INPUTS, OPTIONAL_INPUTS

LIMITS = Limits(max_new_tokens=2048)
# Every field set away from its default, so a field a door drops comes back different.
UNUSUAL = SamplingParams(777, 0.375, 0.75, seed=4242, reasoning=STAGE_BEAM, beams=5)  # exact in FP32
TRITON_TYPES = {"INT32": "TYPE_INT32", "INT64": "TYPE_INT64", "FP32": "TYPE_FP32", "BYTES": "TYPE_STRING"}


def test_every_field_a_caller_sets_has_a_knob_and_each_door_lists_exactly_the_knobs_it_should() -> None:
    assert [f.name for f in dataclasses.fields(SamplingParams)] == list(KNOBS)  # what a caller may set
    checked = [f.name for f in dataclasses.fields(ValidParams)]
    assert [name for name in checked if name not in KNOBS] == ["seeded", "proof"]  # set by validated() only
    assert [name for name in checked if name in KNOBS] == list(KNOBS)
    assert all(knob.help.strip() for knob in KNOBS.values())
    assert INPUTS == ("image", "question", *(name for name, knob in KNOBS.items() if knob.label))
    assert OPTIONAL_INPUTS == ("reasoning", "beams")  # the page's contract: clients of the first five inputs
    api = {knob.api for knob in KNOBS.values() if knob.api}
    assert openai_api.SUPPORTED == {"model", "messages", "stream", "stream_options", "user", *openai_api.TOKENS} | api
    assert contract.SAMPLING_INPUTS == {n: contract.DTYPES[k.triton] for n, k in KNOBS.items() if k.triton}
    assert contract.SAMPLING_KEYS == {k.vllm: n for n, k in KNOBS.items() if k.vllm}


def test_the_model_repositorys_ensemble_declares_every_sampling_input_with_its_type() -> None:
    """The classic repository's config.pbtxt is a copy Triton reads (it cannot import Python): it must list
    each sampling input the contract sends, optional, with its knob's type."""
    text = (ROOT / "vlm_demo/triton/repo/llama_3_2v_11b_cot_ensemble/config.pbtxt").read_text()
    declared = dict(re.findall(r'name: "(\w+)" data_type: (TYPE_\w+) dims: \[ 1 \] optional: true', text))
    for name, knob in KNOBS.items():
        if knob.triton:
            assert declared.get(name) == TRITON_TYPES[knob.triton], name


def test_the_mcp_tool_offers_every_api_field_with_its_knobs_range_and_default() -> None:
    backend = SimpleNamespace(model="tiny", features=Features())
    schema = tool(SimpleNamespace(limits=LIMITS, backend=backend)).inputSchema  # type: ignore[arg-type]
    offered = {name for name, knob in KNOBS.items() if knob.api}
    assert set(schema["properties"]) == {"image", "question"} | offered
    for name in offered:
        knob, prop = KNOBS[name], schema["properties"][name]
        bounds = knob.bounds(LIMITS.max_new_tokens)
        if bounds is not None:
            assert (prop["minimum"], prop["maximum"]) == bounds, name
        if knob.choices:
            assert prop["enum"] == list(knob.values)
        assert prop.get("default") == DEFAULTS[name] and knob.help in prop["description"], name
    without = tool(SimpleNamespace(limits=LIMITS, backend=SimpleNamespace(model="m", features=Features(False))))
    assert "reasoning" not in without.inputSchema["properties"] and "stage-beam" not in without.description


def test_every_field_crosses_each_triton_contract_and_comes_back_the_same() -> None:
    request = door(solid_image("red", 16, 12), "What colour?", UNUSUAL)
    info = ModelInfo("infer", {name: [1] for name in contract.INFER_INPUTS}, list(contract.INFER_OUTPUTS), False, False)
    (decoded,) = decode_infer_request(infer.arrays(info, "m", request), LIMITS, 1024)
    sent = {n: getattr(request.params, n) for n in contract.SAMPLING_INPUTS}
    assert {n: getattr(decoded.params, n) for n in contract.SAMPLING_INPUTS} == sent
    sampling = json.dumps(contract.sampling_parameters(request.params))
    inputs = {
        contract.TEXT_INPUT: contract.chat_prompt("What colour?").encode(),
        contract.IMAGE_INPUT: encode_image(request.image),
        contract.SAMPLING_PARAMETERS: sampling,
    }
    arrays = {name: np.array([value], dtype=np.object_) for name, value in inputs.items()}
    call = decode_generate_request(arrays, None, LIMITS, 1024)
    back = call.request.params
    assert {n: getattr(back, n) for n in contract.SAMPLING_KEYS.values()} == {
        n: getattr(request.params, n) for n in contract.SAMPLING_KEYS.values()
    }


def test_the_response_cache_keys_on_every_field() -> None:
    base = door(solid_image("red", 16, 12), "What colour?", dataclasses.replace(UNUSUAL, temperature=0.0))
    key = cache_key("m", base)
    for name, knob in KNOBS.items():
        if name in ("seed", "temperature") or knob.choices:
            continue
        other = dataclasses.replace(base, params=dataclasses.replace(base.params, **{name: _other(name)}))
        assert cache_key("m", other) != key, f"the cache would answer a different {name} with the same text"


def _other(name: str) -> object:
    value = getattr(UNUSUAL, name)
    return (not value) if isinstance(value, bool) else value + 1


@pytest.mark.parametrize(
    "values, message",
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be a whole number from 1 to 2048."),
        ({"max_new_tokens": "many"}, "max_new_tokens must be a number, not 'many'."),
        ({"max_new_tokens": None}, "max_new_tokens must be a finite number."),
        ({"temperature": 2.5}, "temperature must be a number from 0 to 2."),
        ({"top_p": 0, "temperature": 0.5}, "top_p must be above 0 when sampling"),
        ({"seed": 1.5}, "seed must be a whole number."),
        ({"reasoning": "deep"}, "reasoning must be one of 'normal', 'stage-beam', not 'deep'."),
        ({"beams": 1}, "beams must be a whole number from 2 to 8."),
        ({"beams": 9}, "beams must be a whole number from 2 to 8."),
    ],
)
def test_the_door_checks_each_field_by_its_knob_with_a_message_naming_it(values: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as refused:
        sampling_from(values, LIMITS)
    assert refused.value.param == ("top_p" if "top_p" in values else next(iter(values)))


def test_left_out_fields_take_their_defaults_within_the_servers_cap() -> None:
    params = sampling_from({"reasoning": None, "beams": ""}, Limits(max_new_tokens=300))
    assert (params.max_new_tokens, params.temperature, params.top_p) == (300, 0.6, 0.9)
    assert (params.reasoning, params.beams, params.seed) == ("normal", 2, None)
    assert sampling_from({"seed": 7, "temperature": "0.5"}, LIMITS).validated(2048).seeded
    # One candidate per stage is the benchmarks' baseline: validated() takes it, no door does.
    assert SamplingParams(beams=1, reasoning=STAGE_BEAM).validated(2048).beams == 1


def test_a_door_validates_once_so_an_unseeded_sampled_answer_is_never_taken_for_a_seeded_one() -> None:
    """The bug of issue #50: the door drew a seed, then validated again and took that seed for the caller's, so
    every sampled answer was ``seeded`` and the response cache stored answers nobody could ask for again."""
    sampled = sampling_from({"temperature": 0.8}, LIMITS)
    assert sampled.seed is None  # still loose: the door's checks draw no seed
    request = door(solid_image("red", 16, 12), "What colour?", sampled)
    assert isinstance(request.params, ValidParams) and request.params.seed is not None
    assert not request.params.seeded and not request.params.repeatable
    assert cache_key("m", request) is None  # never stored, never counted
    chosen = door(solid_image("red", 16, 12), "What colour?", sampling_from({"temperature": 0.8, "seed": 3}, LIMITS))
    assert chosen.params.seeded and chosen.params.seed == 3 and cache_key("m", chosen) is not None
    greedy = door(solid_image("red", 16, 12), "What colour?", sampling_from({"temperature": 0}, LIMITS))
    assert not greedy.params.seeded and greedy.params.repeatable and cache_key("m", greedy) is not None


def test_checked_parameters_come_only_from_validation_and_keep_their_proof_across_processes() -> None:
    import pickle

    with pytest.raises(TypeError, match="only from SamplingParams.validated"):
        ValidParams(10, 0.5, 0.9, False, 1, "normal", 2, True, proof=object())  # type: ignore[arg-type]
    params = SamplingParams(10, 0.5).validated(2048)
    again = pickle.loads(pickle.dumps(params))  # the engine process receives them
    assert again == params and dataclasses.replace(again, max_new_tokens=5).max_new_tokens == 5
