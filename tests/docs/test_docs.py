"""The documentation against what it describes: the architecture tree (``docs/architecture.md``), the options
tables (``docs/configuration.md``) and ``--help`` cannot drift; the README stays a landing page; headings name
topics, not issues; links between the pages lead somewhere; every folder the docs tell a user to create is ignored
by git. (Running the docs' commands is ``test_docs_commands.py``'s.)

Pure text, AST and git checks (no server, no model), so they run in a second or two.

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
import shlex
import subprocess
from pathlib import Path

from support import ROOT

from vlm_demo.config import EXAMPLES, GROUPS, build_parser, load_config, settings

README = ROOT / "README.md"
DOCS = ROOT / "docs"
ARCHITECTURE = DOCS / "architecture.md"
CONFIGURATION = DOCS / "configuration.md"
PACKAGE = ROOT / "vlm_demo"
SKIPPED_DIRS = {"__pycache__"}
DATA_FOLDERS = {"vlm_demo/models/tiny_model/"}  # listed as one folder line (a built model's files, no code)


def section(title: str, page: Path) -> str:
    """``page``'s text from the heading ``title`` to the next heading of the same level (or a higher one)."""
    text = page.read_text(encoding="utf-8")
    level = title.split(" ", 1)[0]
    start = text.index(title + "\n")
    following = re.search(rf"^#{{1,{len(level)}}} ", text[start + len(title) :], re.M)
    return text[start : start + len(title) + following.start()] if following else text[start:]


def tree_block() -> list[str]:
    """The lines of the first fenced block of "## The tree" (the folder tree)."""
    match = re.search(r"^```text\n(.*?)^```", section("## The tree", ARCHITECTURE), re.S | re.M)
    assert match, 'docs/architecture.md: the "## The tree" section has no fenced folder tree'
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
        assert indent % 2 == 0, f"docs/architecture.md tree line {number}: indent by two spaces per level: {line!r}"
        assert not name.endswith(","), (
            f"docs/architecture.md tree line {number}: one file per line, not {line.strip()!r}"
        )
        while folders and folders[-1][0] >= indent:
            folders.pop()
        path = f"{folders[-1][1]}{name}" if folders else name
        if name.endswith("/"):
            folders.append((indent, path))
            if folders_too:
                entries[path] = description.strip()
            continue
        assert path not in entries, f"docs/architecture.md tree: {path} is listed twice"
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
    assert not problems, "docs/architecture.md's tree " + "; and it ".join(problems)


def test_every_line_of_the_tree_says_what_its_file_holds() -> None:
    bare = sorted(path for path, description in tree_entries().items() if not description)
    assert not bare, f"docs/architecture.md's tree: say what these hold: {', '.join(bare)}"


def test_the_tree_parser_reads_folders_nested_paths_and_descriptions() -> None:
    entries = tree_entries()
    assert entries["app.py"].startswith("parse the options")
    assert "vlm_demo/web/static/loading.html" in entries
    assert "vlm_demo/triton/repo/vllm_model/1/model.py" in entries
    assert "vlm_demo/models/__init__.py" not in package_files()  # docstring only
    assert "vlm_demo/engine/__init__.py" in package_files()  # make_engine


def options_rows() -> dict[str, tuple[str, str, str, str]]:
    """docs/configuration.md's options tables: the flags cell -> (group heading, env, default, what), backticks
    removed from the first three."""
    rows = {}
    heading = ""
    for line in section("## Options", CONFIGURATION).splitlines():
        if line.startswith("### "):
            heading = line[4:].strip()
        if not line.startswith("| `--"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        assert len(cells) == 4, f"docs/configuration.md options row needs 4 cells (flag, env, default, what): {line!r}"
        flags, env, default, what = (cell.replace("`", "") if i < 3 else cell for i, cell in enumerate(cells))
        assert flags not in rows, f"docs/configuration.md's options tables list {flags} twice"
        rows[flags] = (heading, env, default, what)
    return rows


def help_rows() -> dict[str, tuple[str, str, str, str]]:
    """What ``python app.py --help`` says of every option: flags -> (its group's title, env, default, what)."""
    rows = {}
    for group in build_parser("docs check")._action_groups:
        for action in group._group_actions:
            if action.dest == "help":
                continue
            text = action.help.replace("%%", "%")
            match = re.fullmatch(r"(.*) \[default: (.*); env (\w+)\]", text, re.S)
            assert match, f"--help of {action.option_strings} does not end with [default: …; env …]: {text!r}"
            what, default, env = match.groups()
            title = group.title[0].upper() + group.title[1:]
            rows[" / ".join(action.option_strings)] = (title, env, default, what)
    return rows


def test_every_setting_has_a_help_group_and_help_groups_them_in_order() -> None:
    ungrouped = [f.name for f in settings() if f.metadata.get("group") not in GROUPS]
    assert not ungrouped, f"these Config fields need a 'group' metadata from GROUPS ({', '.join(GROUPS)}): {ungrouped}"
    titles = [group.title for group in build_parser("docs check")._action_groups if group._group_actions]
    assert titles[1:] == list(GROUPS.values()), titles  # after argparse's own "options" (--help)


def test_the_help_epilogue_examples_parse() -> None:
    """Each example at the end of ``--help`` is a command line ``app.py`` accepts."""
    examples = [line.split("  ", 2) for line in EXAMPLES.splitlines() if "python app.py" in line]
    assert len(examples) >= 4
    for parts in examples:
        command = next(part for part in parts if "python app.py" in part).strip()
        words = shlex.split(command)
        environ = {}
        while "=" in words[0]:
            name, _, value = words.pop(0).partition("=")
            environ[name] = value
        assert words[:2] == ["python", "app.py"], command
        load_config(words[2:], environ=environ)  # a bad example ends the test with argparse's one line


def test_the_options_tables_have_every_flag_and_only_flags_that_exist() -> None:
    table, flags = options_rows(), help_rows()
    missing = sorted(set(flags) - set(table))
    unknown = sorted(set(table) - set(flags))
    problems = []
    if missing:
        problems.append(f"lack {', '.join(missing)}: add a row as `python app.py --help` prints it")
    if unknown:
        problems.append(f"list {', '.join(unknown)}, which app.py does not take")
    assert not problems, "docs/configuration.md's options tables " + "; and they ".join(problems)


def test_each_option_row_says_what_help_says_under_its_group() -> None:
    """The group, the variable, the default as ``--help`` prints it, and the Config field's help, word for word."""
    table = options_rows()
    wrong = []
    for flag, said in help_rows().items():
        row = table.get(flag)
        if row is None:
            continue  # the test above names it
        for column, expected, found in zip(("group", "env", "default", "what"), said, row):
            if expected != found:
                wrong.append(f"{flag} {column}: {expected!r} (as --help says), not {found!r}")
    assert not wrong, "docs/configuration.md's options tables differ from python app.py --help:\n" + "\n".join(wrong)


def test_the_model_default_says_a_machine_without_a_gpu_falls_back_to_tiny() -> None:
    _, _, default, _ = help_rows()["--model"]
    assert default == "Xkev/Llama-3.2V-11B-cot, or tiny on a machine without a CUDA GPU", default


# ---- the pages -------------------------------------------------------------------------------------------


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose(page: Path) -> str:
    """The page without its fenced blocks (a ``#`` comment in a code block is not a heading)."""
    return re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)


def headings(page: Path) -> list[str]:
    return [line for line in prose(page).splitlines() if re.match(r"#{1,6} ", line)]


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"^#+ ", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_the_readme_is_a_landing_page_with_contents() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move details to docs/ (at most 300)"
    text = README.read_text(encoding="utf-8")
    contents = text[text.index("**Contents**") :].split("\n\n", 1)[0]
    sections = [anchor(h) for h in headings(README) if h.startswith("## ")]
    linked = re.findall(r"\]\(#([^)]+)\)", contents)
    assert linked == sections, f"the README's contents line should link every section in order: {sections}"


def test_no_heading_names_an_issue() -> None:
    named = [f"{page.name}: {h}" for page in pages() for h in headings(page) if re.search(r"\bissues?\b", h, re.I)]
    assert not named, "headings name topics, not issues (say what, not when): " + "; ".join(named)


def test_every_link_between_the_pages_leads_somewhere() -> None:
    """Relative links name files that exist, and their ``#anchors`` headings that exist on that page."""
    broken = []
    for page in pages():
        for target in re.findall(r"\]\(([^)\s]+)\)|src=\"([^\"]+)\"", prose(page)):
            target = next(t for t in target if t)
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, fragment = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif fragment and linked.suffix == ".md" and fragment not in {anchor(h) for h in headings(linked)}:
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "broken links: " + "; ".join(broken)


def test_every_fenced_block_says_its_language() -> None:
    """So a reader's viewer colours it and the docs check knows what to run (bash, python, js; text for the rest)."""
    bare = []
    for page in pages():
        inside = False
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if line.startswith("```"):
                if not inside and line == "```":
                    bare.append(f"{page.name}:{number}")
                inside = not inside
    assert not bare, "give these code blocks a language: " + ", ".join(bare)


def test_every_folder_the_docs_have_you_create_is_ignored_by_git() -> None:
    """A virtual environment made where the docs say (``.venv`` in the clone) must not count as the project's
    files: git would offer to commit it, and the device tool would carry it."""
    made = {
        folder
        for page in pages()
        for folder in re.findall(r"python -m venv (?:--\S+ )*([\w./-]+)", page.read_text(encoding="utf-8"))
    }
    assert ".venv" in made and ".venv-triton" in made, made
    folders = [folder.rstrip("/") + "/" for folder in sorted(made)]  # a folder, even before it exists
    done = subprocess.run(["git", "check-ignore", *folders], cwd=ROOT, capture_output=True, text=True)
    ignored = {line.rstrip("/") for line in done.stdout.split()}
    assert ignored == made, f"add to .gitignore: {sorted(made - ignored)}"


TRITON_RECIPE_PLACES = [README, DOCS / "development.md", DOCS / "triton.md", ROOT / ".ci" / "run"]


def triton_recipe(text: str) -> list[str]:
    """The commands that make ``.venv-triton`` in ``text`` (continued lines joined, pip's ``-q`` left out)."""
    joined = re.sub(r"\\\n\s*", "", text)
    lines = [line.strip() for line in joined.splitlines()]
    made = [line for line in lines if line.startswith("python -m venv") and ".venv-triton" in line]
    if not made:
        return []
    start = lines.index(made[0])
    recipe = []
    for line in lines[start:]:
        if not (line.startswith(("python -m venv", "python -c")) or "-m pip install" in line or "/pip install" in line):
            break
        recipe.append(line.replace(" -q ", " "))
    return recipe


def test_the_triton_environment_has_one_recipe_that_reuses_the_runtimes_torch() -> None:
    """The README, development.md, triton.md and CI make ``.venv-triton`` the same way, and that way never installs
    a second torch: the runtime's packages are seen through a ``.pth`` file written by the runtime's own Python
    (``--system-site-packages`` from an activated ``.venv`` would give the base interpreter's instead), so pip
    finds torch installed. (That pip then plans no torch is checked by test_docs_commands.py, in a throwaway venv.)"""
    recipes = {place.relative_to(ROOT).as_posix(): triton_recipe(place.read_text(encoding="utf-8")) for place in
               TRITON_RECIPE_PLACES}  # fmt: skip
    assert all(recipes.values()), {place: recipe for place, recipe in recipes.items() if not recipe}
    first = next(iter(recipes.values()))
    assert all(recipe == first for recipe in recipes.values()), recipes
    assert not any("--system-site-packages" in line for line in first), first
    assert any(line.startswith("python -c") and "runtime.pth" in line for line in first), first
    assert first[-1].endswith("-m pip install -r requirements-triton.txt"), first
    for page in pages():  # and no other page has a recipe of its own
        assert triton_recipe(page.read_text(encoding="utf-8")) in ([], first), page.name


def installed_with(requirements: list[str]) -> set[str]:
    """The distributions ``requirements`` install, with everything they require (as installed here), by
    canonical name."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: set[tuple[str, frozenset[str]]] = set()
    pending = [Requirement(r) for r in requirements]
    while pending:
        requirement = pending.pop()
        key = (canonicalize_name(requirement.name), frozenset(requirement.extras))
        if key in found:
            continue
        found.add(key)
        try:
            needs = [Requirement(r) for r in requires(requirement.name) or []]
        except PackageNotFoundError:
            continue
        pending += [
            n for n in needs if n.marker is None or any(n.marker.evaluate({"extra": e}) for e in key[1] or {""})
        ]
    return {name for name, _ in found}


def requirements_in(path: Path) -> list[str]:
    """The requirements a requirements file names (its ``-r`` includes followed)."""
    found = []
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            found += requirements_in(path.parent / line[3:].strip())
        elif line and not line.startswith("-"):
            found.append(line)
    return found


def pip_installs(args: list[str]) -> list[str]:
    """The requirements a ``pip install ARGS`` names, its ``-r`` files' included (other options left out)."""
    found, words = [], iter(args)
    for word in words:
        if word in ("-r", "--requirement"):
            found += requirements_in(ROOT / next(words))
        elif word in ("-c", "--constraint", "-i", "--index-url", "--extra-index-url", "-f", "--find-links"):
            next(words)
        elif not word.startswith("-"):
            found.append(word)
    return found


def test_every_python_example_imports_only_what_its_install_brings() -> None:
    """A page's Python block runs after the Quick start's install (``requirements.txt``) plus what that page has
    you ``pip install`` before it: ``docs/api.md``'s ``openai`` example failed with ModuleNotFoundError after the
    Quick start (openai came only with requirements-dev.txt)."""
    import sys
    from importlib.metadata import packages_distributions

    from packaging.utils import canonicalize_name

    runtime = requirements_in(ROOT / "requirements.txt")
    providers = packages_distributions()
    problems = []
    for page in pages():
        extra: list[str] = []
        text = page.read_text(encoding="utf-8")
        for block in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
            language, code = block.groups()
            if language == "bash":
                for line in re.findall(r"^\s*(?:\S*python -m )?pip install (.*)$", code, flags=re.M):
                    extra += pip_installs(shlex.split(line, comments=True))
            if language != "python":
                continue
            brought = installed_with(runtime + extra)
            for node in ast.walk(ast.parse(code)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                for module in modules:
                    top = module.split(".")[0]
                    if top in sys.stdlib_module_names or top == "vlm_demo":
                        continue
                    dists = {canonicalize_name(d) for d in providers.get(top, [top])}
                    if not dists & brought:
                        line = text[: block.start()].count("\n") + 1
                        problems.append(f"{page.name}:{line}: imports {module}, which the install it names lacks")
    assert not problems, "\n".join(problems)


# ---- the benchmark pages -----------------------------------------------------------------------------------

BENCHMARKS = DOCS / "BENCHMARKS.md"


def numbers(text: str) -> list[str]:
    """The figures in ``text`` as written (``1,430`` as ``1430``)."""
    return [n.replace(",", "") for n in re.findall(r"(?<![\w.])\d[\d,]*(?:\.\d+)?", text)]


def test_benchmarks_is_one_page_of_todays_figures_that_links_the_rest() -> None:
    """Today's figures on one page a reader gets through; earlier ones and the GPU check's manual elsewhere."""
    text = BENCHMARKS.read_text(encoding="utf-8")
    lines = len(text.splitlines())
    assert lines < 400, f"docs/BENCHMARKS.md has {lines} lines: move superseded figures to benchmarks-history.md"
    assert "(benchmarks-history.md" in text and "(gpu.md#" in text
    assert "(BENCHMARKS.md" in (DOCS / "benchmarks-history.md").read_text(encoding="utf-8")


def test_the_readmes_figures_are_on_the_benchmarks_page() -> None:
    """Each figure the README's Benchmarks section puts in bold is one of BENCHMARKS.md's, as rounded there (one
    said to be approximate, ``~`` or "about", within 2 %)."""
    readme = section("## Benchmarks", README)
    measured = [float(n) for n in numbers(BENCHMARKS.read_text(encoding="utf-8"))]
    missing = []
    for span in re.findall(r"\*\*(.+?)\*\*", readme, re.S):
        approximate = "~" in span or "about" in span
        for figure in numbers(span):
            value, decimals = float(figure), len(figure.partition(".")[2])
            if not any(
                round(m, decimals) == value or (approximate and abs(m - value) <= 0.02 * value) for m in measured
            ):
                missing.append(f"{figure} (in **{span}**)")
    assert not missing, "README's Benchmarks quote figures docs/BENCHMARKS.md does not have: " + "; ".join(missing)
