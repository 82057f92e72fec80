"""The package's layout as the architecture: parts in subpackages, imports one way, typed contracts between parts.

Read from the source with ``ast`` (nothing is imported), so a violation names the file and line.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from support import ROOT

PACKAGE = ROOT / "vlm_demo"


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported(path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """The package's modules that ``path`` imports, anywhere in it (function bodies and TYPE_CHECKING too)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name in known:
                yield name, node.lineno


def test_no_import_cycles_anywhere_in_the_package() -> None:
    known = modules()
    graph = {name: {dep for dep, _ in imported(path, known) if dep != name} for name, path in known.items()}
    for name in graph:  # importing a.b.c runs a and a.b first
        for dep in list(graph[name]):
            parts = dep.split(".")
            graph[name] |= (
                {".".join(parts[:i]) for i in range(1, len(parts))}
                - {name}
                - set(".".join(name.split(".")[:i]) for i in range(1, len(name.split("."))))
            )
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep) :] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_top_level_holds_only_the_door_and_the_shared_vocabulary() -> None:
    """The door (request), what comes back (results, stream), the conversation (prompt), the errors, the
    settings, how commands log, images; and two old command names kept as shims."""
    plain = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    shared = ["config", "errors", "images", "logs", "prompt", "request", "results", "stream"]
    assert plain == sorted([*shared, "gpucheck", "triton_serve"]), plain
    parts = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert parts == ["backends", "cot", "engine", "models", "tools", "triton", "web"], parts


def test_the_web_layer_calls_backends_and_streams_through_their_protocols() -> None:
    """No ``getattr``/``hasattr`` probing in the web layer: what it calls is in ``Backend`` and ``Stream``."""
    probes = []
    for path in (PACKAGE / "web").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
            ):
                probes.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not probes, probes


def test_the_triton_wire_contract_has_one_home() -> None:
    """Model names and the error marker are defined once, in ``vlm_demo.triton.contract``, and imported by
    the client, the PyTriton server, the handlers and both repository models."""
    known = modules()
    users = [
        "vlm_demo.backends.triton.infer",
        "vlm_demo.backends.triton.generate",
        "vlm_demo.triton.serve",
        "vlm_demo.triton.handlers",
        "vlm_demo.triton.repo.llama_3_2v_11b_cot_ensemble.1.model",
        "vlm_demo.triton.repo.vllm_model.1.model",
    ]
    for name in users:
        deps = {dep for dep, _ in imported(known[name], known)}
        assert "vlm_demo.triton.contract" in deps, name
    for name, path in known.items():
        if name == "vlm_demo.triton.contract":
            continue
        text = path.read_text()
        assert '= "llama_3_2v_11b_cot_ensemble"' not in text and "vlm_demo\\[" not in text, name


def test_the_api_and_mcp_doors_do_not_reach_into_the_pages_handlers() -> None:
    """``/v1`` and MCP are adapters over the answer service (``web/answers.py``), beside the page, not on it:
    nothing they import, directly or through another module of the package, is the page's handlers."""
    known = modules()
    doors = ("openai_api", "openai_wire", "responses_api", "responses_wire", "response_store", "mcp_tool")
    for door in (f"vlm_demo.web.api.{name}" for name in doors):
        seen, todo = set(), [door]
        while todo:
            name = todo.pop()
            for dep, line in imported(known[name], known):
                assert dep != "vlm_demo.web.page.handlers", f"{name}:{line} imports the page's handlers (from {door})"
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        assert "vlm_demo.web.answers" in seen or door.endswith(("_wire", "_store")), door


def test_the_engine_keeps_its_rooms_small_and_one_room_owns_the_rows_pages() -> None:
    """No engine class over 300 lines, no engine function over 60, ``rows.py`` at most 350 lines; and rows'
    pages are taken, shared and given back by the page table alone (the pool and the image-state cache aside)."""
    engine = PACKAGE / "engine"
    big = []
    for path in engine.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                size, limit = node.end_lineno - node.lineno + 1, 300 if isinstance(node, ast.ClassDef) else 60
                if size > limit:
                    big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} is {size} lines (at most {limit})")
    assert not big, big
    assert len((engine / "batching" / "rows.py").read_text().splitlines()) <= 350
    owners = {"page_table.py", "pages.py", "image_cache.py"}
    touching = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in PACKAGE.rglob("*.py")
        if path.name not in owners
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr in ("take", "share", "release")
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "pool"
    ]
    assert not touching, f"pages taken or given back outside the page table: {touching}"


def test_no_folder_of_the_package_holds_more_than_twelve_modules() -> None:
    """A newcomer finds a module by its room: every folder of the package holds at most 12 (``__init__`` too)."""
    crowded = {
        str(folder.relative_to(ROOT)): count
        for folder in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir())]
        if (count := len(list(folder.glob("*.py")))) > 12
    }
    assert not crowded, crowded


def test_each_module_name_means_one_thing() -> None:
    """One ``request.py``; no ``streams.py``/``streamer.py`` beside ``stream.py``; no kernel module named
    ``triton*`` beside the Triton server's packages."""
    names = [path.name for path in PACKAGE.rglob("*.py")]
    assert names.count("request.py") == 1
    assert "streams.py" not in names and "streamer.py" not in names
    kernels = [p for p in PACKAGE.rglob("triton*.py") if "engine" in p.relative_to(PACKAGE).parts]
    assert not kernels, kernels


def test_the_engines_ipc_and_what_the_web_process_imports_leave_torch_out() -> None:
    """The web process imports the engine's messages and handles (``vlm_demo.engine.ipc``), the web layer and
    the backends' clients; none of it may import torch (in a fresh interpreter)."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import vlm_demo.engine.ipc, vlm_demo.web\n"
        "names = ['vlm_demo.engine.ipc', 'vlm_demo.request', 'vlm_demo.backends.engine_client',\n"
        "         'vlm_demo.backends.triton.backend']\n"
        "for package in (vlm_demo.engine.ipc, vlm_demo.web):\n"
        "    names += [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + '.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules), len(names))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    heavy, _, count = out.stdout.strip().rpartition(" ")
    assert heavy == "[]" and int(count) > 10, out.stdout + out.stderr
