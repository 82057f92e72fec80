"""Each error's facts have one home, its class in ``vlm_demo/errors.py``: the stable code, ``/v1``'s HTTP status
and OpenAI error kind, the title the page and the MCP tool show, the Triton wire's ``vlm_demo[code]`` marker.

An error added with only some of them, or a door that keeps a table of its own, fails here.
"""

from __future__ import annotations

import ast

import pytest
from support import ROOT

from vlm_demo import errors
from vlm_demo.errors import BY_CODE, DemoError
from vlm_demo.triton.contract import error_from_text, error_text
from vlm_demo.web.api.mcp_tool import refusal
from vlm_demo.web.api.openai_wire import APIError
from vlm_demo.web.page.handlers import PageError
from vlm_demo.web.page.render import error_status

ALL = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, DemoError) and c is not DemoError]


def test_every_error_class_declares_each_of_its_facts_itself() -> None:
    """Inherited facts would be its parent's (a new error that forgot its status would answer 500 as a
    "generation failure"); every code names one class, and the wire finds it by that code."""
    for cls in ALL:
        missing = [fact for fact in ("code", "status", "kind", "title") if fact not in vars(cls)]
        assert not missing, f"{cls.__name__} does not declare {missing}"
        assert cls.title and cls.title != DemoError.title and 400 <= cls.status < 600, cls
    codes = [cls.code for cls in ALL]
    assert len(codes) == len(set(codes)), codes
    assert BY_CODE == {cls.code: cls for cls in ALL}
    assert errors.by_code("from_a_newer_server") is errors.GenerationError


@pytest.mark.parametrize("cls", ALL, ids=lambda cls: cls.__name__)
def test_every_door_takes_an_errors_facts_from_its_class(cls: type[DemoError]) -> None:
    error = cls("Something specific went wrong; do this instead.")
    api = APIError.of(error)
    assert (api.status, api.kind, api.code) == (cls.status, cls.kind, cls.code)  # /v1
    assert api.body()["error"]["message"] == str(error)
    assert (api.response().headers.get("retry-after") == "1") == (cls.status in (429, 503))
    assert PageError(error).title == cls.title and PageError(error).retry_helps == cls.retry_helps  # the toast, Retry
    assert error_status(error) == f"Error ({cls.code}): {error}"  # /ask_batch's status output
    tool = refusal(error)  # the MCP tool
    assert tool.isError and tool.content[0].text == f"{cls.title}: {error}"
    back = error_from_text(f"Traceback (most recent call last):\nRuntimeError: {error_text(error)}\n")  # Triton
    assert type(back) is cls and str(back) == str(error)


def test_no_module_keeps_a_table_of_errors_of_its_own() -> None:
    """A dict keyed by error codes outside ``errors.py`` (as ``STATUS``, ``ERROR_TITLES`` and
    ``ERRORS_BY_CODE`` once were) is a second home for a fact; read from the source, so it names the line."""
    tables = []
    for path in (ROOT / "vlm_demo").rglob("*.py"):
        if path == ROOT / "vlm_demo" / "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict):
                keys = [k for k in node.keys if k is not None]
                coded = [
                    k
                    for k in keys
                    if (isinstance(k, ast.Constant) and k.value in BY_CODE)
                    or (isinstance(k, ast.Attribute) and k.attr == "code")
                ]
                if len(coded) >= 2:
                    tables.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not tables, tables
