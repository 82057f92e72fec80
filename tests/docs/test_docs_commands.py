"""Every command and code block of the README and docs/ runs as written on the default setup.

The pages' fenced blocks (and the ``python app.py …`` / ``python -m vlm_demo…`` commands quoted in their text)
are read and each is checked the way it can be here:

- a ``python`` or ``js`` block runs, from the repository's root, against ``python app.py`` as a newcomer starts
  it (no ``--model``: the tiny one on this machine without a GPU; ``--mcp-server`` for the MCP example);
- a ``bash`` block that calls ``curl`` runs whole in bash, each curl failing on an HTTP error, against that
  server, or against one started with the page's credentials (``--auth alice:s3cret --metrics-token TOKEN``)
  when the block uses them;
- any other command line is checked by what it calls: ``python app.py`` and every ``python -m vlm_demo…``
  command by the program's own argument parser (the same words must parse; starting each server or benchmark
  would take many minutes), ``pytest`` by collecting what it names, ``python -c`` and ``ruff`` by running,
  ``pip install -r FILE`` by the file. What needs what this
  machine lacks (Docker, the Hub, Debian's mirror, CI itself) is named in ``NOT_RUN`` with why, and anything
  else fails the test until this module learns it.

Only the port changes: ``127.0.0.1:7860`` in a block becomes the test server's address.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import ROOT, free_port, start_app, stop_app, wait_ready

from vlm_demo.config import load_config

pytestmark = pytest.mark.slow

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCS_URL = "http://127.0.0.1:7860"
SECURED = ("alice:s3cret", "Bearer TOKEN")  # the credentials the docs' examples use
NOT_RUN = {  # first word(s) -> why the check does not run it here; the command is still read
    "apt-get": "installs from Debian's mirror as root: CI's .ci/run does it",
    "hf auth login": "asks for the reader's own Hub token",
    "docker": "no Docker on these machines",
    "bash .ci/run": "it is CI itself",
    "mypy": "a minute of CPU: CI's .ci/run runs it before the tests",
}


@dataclass
class Block:
    page: str
    line: int
    language: str
    text: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.language})"


def blocks() -> list[Block]:
    found = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        start = None
        for number, line in enumerate(lines, 1):
            if line.startswith("```"):
                if start is None:
                    start, language = number, line[3:].strip()
                else:
                    text = "\n".join(lines[start:number - 1])  # fmt: skip
                    found.append(Block(page.relative_to(ROOT).as_posix(), start, language, text))
                    start = None
    return found


def quoted_commands() -> list[tuple[str, str]]:
    """``python app.py …`` and ``python -m vlm_demo…`` quoted in the pages' text (placeholders like ``...`` or
    ``a|b`` excepted: those describe a command's shape, they are not one to type)."""
    found = []
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
        for quoted in re.findall(r"`((?:[A-Z_]+=\S+ )*python (?:app\.py|-m vlm_demo)[^`]*)`", text):
            if not re.search(r"\.\.\.|…|\||\[|<", quoted):
                found.append((page.name, quoted))
    return found


def command_lines(script: str) -> Iterator[list[str]]:
    """The commands of a shell snippet as word lists: continued lines joined, comments dropped, ``&&`` and ``;``
    separating commands, a trailing ``&`` (run in the background) dropped."""
    pending = ""
    for line in script.splitlines():
        pending += line + "\n"
        if pending.rstrip().endswith("\\"):
            pending = pending.rstrip()[:-1] + " "
            continue
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on on the next line
            continue
        pending = ""
        command: list[str] = []
        for word in [*words, "&&"]:
            if word in ("&&", ";", "&"):
                if command:
                    yield command
                command = []
            else:
                command.append(word)


# ---- the servers ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(tiny_dir: str) -> Iterator[dict[str, str]]:
    """``python app.py --mcp-server`` as a newcomer starts it, and one with the docs' credentials."""
    ports = {"open": free_port(), "secured": free_port()}
    procs = {
        "open": start_app(ports["open"], "--mcp-server", model=None),
        "secured": start_app(ports["secured"], "--auth", SECURED[0], "--metrics-token", "TOKEN", model=None),
    }
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    try:
        for name, proc in procs.items():
            wait_ready(proc, urls[name])
        yield urls
    finally:
        for proc in procs.values():
            stop_app(proc)


def against(text: str, url: str) -> str:
    return text.replace(DOCS_URL, url).replace(DOCS_URL.removeprefix("http://"), url.removeprefix("http://"))


def run(argv: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kwargs)


# ---- code that runs against the server ------------------------------------------------------------------

SERVED = [b for b in blocks() if b.language in ("python", "js") or (b.language == "bash" and "curl " in b.text)]


@pytest.mark.parametrize("block", SERVED, ids=str)
def test_the_block_runs_against_the_server(block: Block, servers: dict[str, str], tmp_path: Path) -> None:
    secured = any(credential in block.text for credential in SECURED)
    code = against(block.text, servers["secured" if secured else "open"])
    if block.language == "python":
        script = tmp_path / "example.py"
        script.write_text(code)
        done = run([sys.executable, str(script)])
    elif block.language == "js":
        if shutil.which("node") is None:
            pytest.skip("no node on this machine")
        script = tmp_path / "example.mjs"
        script.write_text(code)
        done = run(["node", str(script)])
    else:  # every curl fails on an HTTP error (as written, curl -s prints a 404's body and succeeds)
        prelude = 'set -eo pipefail\ncurl() { command curl --fail-with-body "$@"; }\n'
        done = run(["bash", "-c", prelude + code])
    assert done.returncode == 0, f"{block} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert done.stdout.strip(), f"{block} printed nothing"
    for colour in re.findall(r"assets/tiny/(\w+)\.png", block.text):  # a picture the tiny model answers: it does
        assert colour in done.stdout.lower(), f"{block}: the tiny model did not say {colour}:\n{done.stdout[-2000:]}"
    assert "event: error" not in done.stdout and '"error"' not in done.stdout, f"{block}:\n{done.stdout[-2000:]}"


# ---- command lines, checked by what they call ------------------------------------------------------------

HARNESS = r"""
import argparse, json, runpy, sys

class Parsed(Exception):
    pass

parse = argparse.ArgumentParser.parse_known_args

def parse_then_stop(self, args=None, namespace=None):
    parse(self, args, namespace)
    raise Parsed

argparse.ArgumentParser.parse_known_args = parse_then_stop
results = []
for module, args in json.loads(sys.argv[1]):
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        results.append("it ran without parsing its arguments")
    except Parsed:
        results.append("")
    except SystemExit as exit:
        results.append(f"exit {exit.code}")
    except BaseException as err:
        results.append(repr(err))
print(json.dumps(results))
"""


def command_cases() -> list[tuple[str, list[str]]]:
    cases = []
    for block in blocks():
        if block.language == "bash" and "curl " not in block.text:
            cases += [(str(block), words) for words in command_lines(block.text)]
    cases += [(page, shlex.split(quoted)) for page, quoted in quoted_commands()]
    return cases


def test_every_command_line_is_one_its_program_accepts() -> None:
    problems: list[str] = []
    modules: list[tuple[str, str, list[str]]] = []  # (where, module, args) for the harness
    selections: list[tuple[str, dict]] = []  # (where, what a pytest command selects), counted in one collection
    for where, words in command_cases():
        line = shlex.join(words)
        environ = {}
        while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
            name, _, value = words.pop(0).partition("=")
            environ[name] = value
        first = words[0]
        python = first in ("python", "python3") or first.endswith("/bin/python")
        if any(line == key or line.startswith(key + " ") for key in NOT_RUN):
            continue
        if python and words[1:2] == ["app.py"]:
            try:
                load_config(words[2:], environ=environ)
            except SystemExit as err:
                if err.code:  # --help exits 0
                    problems.append(f"{where}: {line}: {err}")
        elif python and words[1:3] == ["-m", "pytest"]:
            selections.append((f"{where}: {line}", selection_of(words[3:])))
        elif python and words[1:3] == ["-m", "venv"]:
            continue  # the folder must be ignored by git: test_docs.py checks every one
        elif python and words[1] == "-c":
            done = run([sys.executable, "-c", words[2]], timeout=120)
            if done.returncode != 0:
                problems.append(f"{where}: {line}: {done.stderr[-1500:]}")
        elif python and words[1] == "-m" and words[2].startswith("vlm_demo"):
            modules.append((where, words[2], words[3:]))
        elif first in (".", "source") and words[1].endswith("/bin/activate"):
            continue  # made by the python -m venv before it
        elif first == "pip" or first.endswith("/bin/pip") or (python and words[1:3] == ["-m", "pip"]):
            named = [word for word in words[words.index("install") + 1 :] if not word.startswith("-")]
            if "-r" in words:
                requirements = words[words.index("-r") + 1]
                if not (ROOT / requirements).is_file():
                    problems.append(f"{where}: {line}: no {requirements}")
            elif not named or not set(named) <= requirement_lines(ROOT / "requirements-dev.txt"):
                problems.append(f"{where}: {line}: install from a requirements file, or what requirements-dev.txt pins")
        elif first == "ruff":
            done = run(["bash", "-c", line], timeout=120)
            if done.returncode != 0:
                problems.append(f"{where}: {line}: {done.stdout[-1500:]}")
        elif first == "hf" and words[1:2] in (["download"], ["upload"]) or words[:3] == ["hf", "repos", "create"]:
            command = words[: 3 if words[1] == "repos" else 2]  # the Hub cannot be reached from here: its options
            done = run([*command, "--help"], timeout=120)
            options = set(re.findall(r"--[\w-]+", done.stdout))
            unknown = [w.split("=")[0] for w in words if w.startswith("--") and w.split("=")[0] not in options]
            if done.returncode != 0 or unknown:
                problems.append(f"{where}: {line}: {shlex.join(command)} does not exist here or lacks {unknown}")
        else:
            problems.append(f"{where}: {line}: teach tests/docs/test_docs_commands.py how to check this command")
    if modules:
        done = run([sys.executable, "-c", HARNESS, json.dumps([[m, a] for _, m, a in modules])], timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        for (where, module, args), result in zip(modules, json.loads(done.stdout.splitlines()[-1]), strict=True):
            if result:
                problems.append(f"{where}: python -m {module} {shlex.join(args)}: {result}\n{done.stderr[-1500:]}")
    counts = selected_counts([selection for _, selection in selections])
    problems += [f"{where}: selects no test" for (where, _), count in zip(selections, counts, strict=True) if not count]
    assert not problems, "\n".join(problems)


def requirement_lines(path: Path) -> set[str]:
    """The requirements ``path`` names, as written (comments left out)."""
    return {line.split("#")[0].strip() for line in path.read_text().splitlines()} - {""}


def selection_of(args: list[str]) -> dict:
    """What a pytest command line selects: its paths, ``-k`` and ``-m`` expressions (output options dropped)."""
    selection: dict = {"paths": [], "k": None, "m": None}
    words = iter(args)
    for word in words:
        if word in ("-k", "-m"):
            selection[word[1]] = next(words)
        elif not word.startswith("-"):
            selection["paths"].append(word)
    return selection


COUNTER = """
import json, os
from _pytest.mark import KeywordMatcher, MarkMatcher
from _pytest.mark.expression import Expression

def chosen(item, paths, k, m):
    if paths and not any(item.nodeid == p or item.nodeid.startswith((p + "::", p.rstrip("/") + "/")) for p in paths):
        return False
    if k and not Expression.compile(k).evaluate(KeywordMatcher.from_item(item)):
        return False
    return not m or Expression.compile(m).evaluate(MarkMatcher.from_markers(item.iter_markers()))

def pytest_collection_modifyitems(items):
    selections = json.loads(os.environ["DOCS_SELECTIONS"])
    counts = [sum(chosen(item, s["paths"], s["k"], s["m"]) for item in items) for s in selections]
    with open(os.environ["DOCS_COUNTS"], "w") as out:
        json.dump(counts, out)
"""


def selected_counts(selections: list[dict]) -> list[int]:
    """How many tests each selection picks, by pytest's own matching, from one collection of the whole suite
    (a collection costs tens of seconds here: one, not one per command)."""
    if not selections:
        return []
    with tempfile.TemporaryDirectory() as scratch:
        Path(scratch, "docs_counter.py").write_text(COUNTER)
        counts = Path(scratch, "counts.json")
        env = dict(os.environ, DOCS_SELECTIONS=json.dumps(selections), DOCS_COUNTS=str(counts))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [scratch, env.get("PYTHONPATH")]))
        done = run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "docs_counter"], env=env, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:]
        return json.loads(counts.read_text())


def test_the_docker_command_mounts_what_the_repository_has() -> None:
    """Not run (no Docker here): the paths it hands the container exist in the repository."""
    docker = [b for b in blocks() if "docker run" in b.text]
    assert docker, "the Triton page's container command is gone"
    for block in docker:
        for path in re.findall(r"/app/([\w./-]+)", block.text):
            assert (ROOT / path).exists(), f"{block}: /app/{path} is not in the repository"


def test_the_triton_environments_recipe_installs_no_torch(tmp_path: Path) -> None:
    """The README's recipe for ``.venv-triton``, run in a throwaway folder with pip's install a dry run: pip plans
    PyTriton, numpy below 2 and what they need, and no torch (nor any CUDA library): the runtime's is reused."""
    from test_docs import triton_recipe

    venv = tmp_path / "venv-triton"
    recipe = [line.replace(".venv-triton", str(venv)) for line in triton_recipe((ROOT / "README.md").read_text())]
    *setup, install = recipe
    report = tmp_path / "report.json"
    script = "set -eo pipefail\n" + "\n".join(setup) + f"\n{install} --dry-run --quiet --report {report}\n"
    done = run(["bash", "-c", script], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    planned = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert {"nvidia-pytriton", "numpy"} <= planned, planned
    assert not {name for name in planned if name.startswith(("torch", "nvidia-")) and name != "nvidia-pytriton"}, (
        planned
    )
