"""The README against the code it describes: the architecture tree and the options table cannot drift.

Pure text and AST checks (no server, no model), so they run in well under a second.

The tree's rule: one line per file under ``vlm_demo/`` (modules, static files, the Triton repository's
files), each saying what it holds; an ``__init__.py`` is listed where it defines something, and left out
where it holds only its docstring (its folder's line says what the package is). A line is
``NAME  what it holds``, indented two spaces per folder level; a name ending in ``/`` is a folder, and a
name may carry a short path (``1/model.py``). A folder of data (``DATA_FOLDERS``: the shipped tiny model's
files) is one line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from support import ROOT

from vlm_demo.config import build_parser

README = ROOT / "README.md"
PACKAGE = ROOT / "vlm_demo"
SKIPPED_DIRS = {"__pycache__"}
DATA_FOLDERS = {"vlm_demo/models/tiny_model/"}  # listed as one folder line (a built model's files, no code)


def section(title: str) -> str:
    """The README's text from the heading ``title`` to the next heading of the same level."""
    text = README.read_text(encoding="utf-8")
    level = title.split(" ", 1)[0]
    start = text.index(title + "\n")
    following = re.search(rf"^{level} ", text[start + len(title) :], re.M)
    return text[start : start + len(title) + following.start()] if following else text[start:]


def tree_block() -> list[str]:
    """The lines of the first fenced block of "## Architecture" (the folder tree)."""
    match = re.search(r"^```\n(.*?)^```", section("## Architecture"), re.S | re.M)
    assert match, 'README.md: the "## Architecture" section has no fenced folder tree'
    return match.group(1).splitlines()


def tree_entries(folders_too: bool = False) -> dict[str, str]:
    """Every file the tree lists (and every folder, with ``folders_too``), as a repository-relative path ->
    its description."""
    entries: dict[str, str] = {}
    folders: list[tuple[int, str]] = []  # (indent, path) of the open folders
    for number, line in enumerate(tree_block(), 1):
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        name, _, description = line.strip().partition(" ")
        assert indent % 2 == 0, f"README.md tree line {number}: indent by two spaces per level: {line!r}"
        assert not name.endswith(","), f"README.md tree line {number}: one file per line, not {line.strip()!r}"
        while folders and folders[-1][0] >= indent:
            folders.pop()
        path = f"{folders[-1][1]}{name}" if folders else name
        if name.endswith("/"):
            folders.append((indent, path))
            if folders_too:
                entries[path] = description.strip()
            continue
        assert path not in entries, f"README.md tree: {path} is listed twice"
        entries[path] = description.strip()
    return entries


def defines_something(init: Path) -> bool:
    """Whether an ``__init__.py`` holds more than its docstring (then the tree lists it)."""
    body = ast.parse(init.read_text(encoding="utf-8")).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return bool(body)


def package_files() -> set[str]:
    """The files the tree must list: everything under vlm_demo/ but caches and docstring-only __init__.py."""
    found = set()
    for path in PACKAGE.rglob("*"):
        relative = path.relative_to(PACKAGE)
        if not path.is_file() or SKIPPED_DIRS & set(relative.parts) or path.name.startswith("."):
            continue
        if path.suffix == ".pyc" or (path.name == "__init__.py" and not defines_something(path)):
            continue
        if any(path.relative_to(ROOT).as_posix().startswith(folder) for folder in DATA_FOLDERS):
            continue
        found.add(path.relative_to(ROOT).as_posix())
    return found


def test_the_architecture_tree_lists_every_file_of_the_package_and_nothing_else() -> None:
    listed = {path for path in tree_entries() if path.startswith("vlm_demo/")}
    present = package_files()
    missing, stale = sorted(present - listed), sorted(listed - present)
    stale += sorted(path for path in tree_entries() if path not in listed and not (ROOT / path).is_file())
    problems = []
    if missing:
        problems.append(
            f"does not list {', '.join(missing)}: add one line per file saying what it holds "
            "(an __init__.py only when it defines something)"
        )
    if stale:
        problems.append(f"lists {', '.join(stale)}, which the repository does not have")
    unlisted = sorted(folder for folder in DATA_FOLDERS if not tree_entries(folders_too=True).get(folder))
    if unlisted:
        problems.append(f"does not list the data folder {', '.join(unlisted)} with what it holds")
    assert not problems, "README.md's Architecture tree " + "; and it ".join(problems)


def test_every_line_of_the_tree_says_what_its_file_holds() -> None:
    bare = sorted(path for path, description in tree_entries().items() if not description)
    assert not bare, f"README.md's Architecture tree: say what these hold: {', '.join(bare)}"


def test_the_tree_parser_reads_folders_nested_paths_and_descriptions() -> None:
    entries = tree_entries()
    assert entries["app.py"].startswith("parse the options")
    assert "vlm_demo/web/static/loading.html" in entries
    assert "vlm_demo/triton/repo/vllm_model/1/model.py" in entries
    assert "vlm_demo/models/__init__.py" not in package_files()  # docstring only
    assert "vlm_demo/engine/__init__.py" in package_files()  # make_engine


def options_rows() -> dict[str, tuple[str, str, str]]:
    """The README's options table: the flags cell -> (env, default, what), backticks removed."""
    rows = {}
    for line in section("## Options").splitlines():
        if not line.startswith("| `--"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        assert len(cells) == 4, f"README.md options row needs 4 cells (flag, env, default, what): {line!r}"
        flags, env, default, what = (cell.replace("`", "") if i < 3 else cell for i, cell in enumerate(cells))
        assert flags not in rows, f"README.md's options table lists {flags} twice"
        rows[flags] = (env, default, what)
    return rows


def help_rows() -> dict[str, tuple[str, str, str]]:
    """What ``python app.py --help`` says of every option: flags -> (env, default, what)."""
    rows = {}
    for action in build_parser("README check")._actions:
        if action.dest == "help":
            continue
        text = action.help.replace("%%", "%")
        match = re.fullmatch(r"(.*) \[default: (.*); env (\w+)\]", text, re.S)
        assert match, f"--help of {action.option_strings} does not end with [default: …; env …]: {text!r}"
        what, default, env = match.groups()
        rows[" / ".join(action.option_strings)] = (env, default, what)
    return rows


def test_the_options_table_has_every_flag_and_only_flags_that_exist() -> None:
    table, flags = options_rows(), help_rows()
    missing = sorted(set(flags) - set(table))
    unknown = sorted(set(table) - set(flags))
    problems = []
    if missing:
        problems.append(f"lacks {', '.join(missing)}: add a row as `python app.py --help` prints it")
    if unknown:
        problems.append(f"lists {', '.join(unknown)}, which app.py does not take")
    assert not problems, "README.md's options table " + "; and it ".join(problems)


def test_each_option_row_says_what_help_says() -> None:
    """The variable, the default as ``--help`` prints it, and the Config field's help, word for word."""
    table = options_rows()
    wrong = []
    for flag, said in help_rows().items():
        row = table.get(flag)
        if row is None:
            continue  # the test above names it
        for column, expected, found in zip(("env", "default", "what"), said, row):
            if expected != found:
                wrong.append(f"{flag} {column}: {expected!r} (as --help says), not {found!r}")
    assert not wrong, "README.md's options table differs from python app.py --help:\n" + "\n".join(wrong)
