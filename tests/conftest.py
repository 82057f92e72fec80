"""Shared fixtures: the tiny model (shipped built with the package) is loaded once per session; and no process the
tests start may outlive the session."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from support import outliving
from triton_interpreter import mend as mend_triton_interpreter

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch thread a test process (read when torch loads, after this): three workers and the servers they start share
# two cores, where a thread per core in each only waits on the others' (the tiny model gains nothing from two).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The Triton decode attention on CPU tensors (Triton's interpreter); read when its kernels are first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
mend_triton_interpreter()  # runtime loop bounds and bf16 products under the interpreter (tests/triton_interpreter.py)


@pytest.fixture(scope="session")
def tiny_dir() -> str:
    """Path of the trained tiny model folder (the shipped copy unless ``VLM_TINY_DIR`` names another)."""
    from vlm_demo.config import load_config
    from vlm_demo.models.tiny import ensure_tiny

    return ensure_tiny(load_config([]).tiny_dir or None)


@pytest.fixture(scope="session")
def worker(tiny_dir):
    """One loaded tiny-model worker shared by the engine tests (loading twice wastes CPU)."""
    from vlm_demo.engine.weights.loader import load

    return load(tiny_dir, device="cpu")


@pytest.fixture
def engines(worker):
    """``engines(kind=ContinuousEngine, faults="", **config)``: started engines over the shared tiny worker
    (4 rows, no batch window unless the test says), each shut down after the test. ``faults`` plans
    failpoints (``engine/batching/faults.py``)."""
    from vlm_demo.config import Config
    from vlm_demo.engine.batching.continuous import ContinuousEngine
    from vlm_demo.engine.batching.faults import FailPoints

    made = []

    def make(kind=ContinuousEngine, faults: str = "", **settings):
        config = Config(**{"batching": kind.batching, "max_batch_size": 4, "batch_window_ms": 0.0, **settings})
        engine = kind(worker, config)
        engine.failpoint = FailPoints.parse(faults).hit if faults else None
        made.append(engine.start())
        return engine

    yield make
    for engine in made:
        engine.shutdown()


# Every process the tests start inherits this mark (servers, their engine processes and GPU workers, tritonserver
# and its model processes, whatever their process group or parent): at the session's end none may be left.
SESSION_MARK = "VLM_TEST_SESSION"
os.environ[SESSION_MARK] = uuid.uuid4().hex


# multiprocessing's helpers of this very process (the resource tracker that its engine processes' shared memory
# starts, a fork server): they end when it exits, after this check, and are no test's leftover.
OWN_HELPERS = (b"multiprocessing.resource_tracker", b"multiprocessing.forkserver")


def marked_processes() -> set[int]:
    """The live processes, other than this one and its own multiprocessing helpers, that carry this session's mark
    in their environment."""
    mark = f"{SESSION_MARK}={os.environ[SESSION_MARK]}".encode()
    found = set()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark not in environ.read_bytes().split(b"\0"):
                continue
            command = (environ.parent / "cmdline").read_bytes()
            parent = int((environ.parent / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):  # gone meanwhile, or not ours to read
            continue
        if parent == os.getpid() and any(helper in command for helper in OWN_HELPERS):
            continue
        found.add(int(environ.parent.name))
    return found - {os.getpid()}


# The tiny model's recipe trains for ~3 minutes of one core: too long for the README's test command, so its rebuild
# check runs when asked (``--recipe``: CI's second step, .ci/run). Asked in a run of one process, the build starts
# with the session, in the background (one thread), and the test collects it at its turn.
RECIPE_TEST = ("test_tiny.py", "test_the_recipe_rebuilds_what_was_shipped_on_any_cpu")
RECIPE_BUILD = pytest.StashKey[tuple[subprocess.Popen, Path]]()


def is_recipe(item: pytest.Item) -> bool:
    return (item.path.name, item.name) == RECIPE_TEST


# The longest modules (minutes of one core: interpreted kernels, servers, the browser) go to the workers first, so
# no worker is left with one of them while the others idle at the end (``--dist loadscope`` keeps a module on one
# worker: its servers start once). Measured with ``--durations=0`` (docs/development.md).
LONGEST_FIRST = (
    "tests/e2e/test_browser.py",
    "tests/e2e/test_app.py",
    "tests/tools/test_gpucheck.py",
    "tests/tools/test_bench.py",
    "tests/docs/test_docs_commands.py",
    "tests/kernels/test_triton_attention.py",
    "tests/models/test_quantize.py",
    "tests/test_cli.py",
    "tests/e2e/test_stops.py",
    "tests/models/test_realshape.py",
    "tests/e2e/test_triton.py",
    "tests/engine/test_structure.py",
    "tests/kernels/test_kernels.py",
    "tests/docs/test_quickstart.py",
    "tests/web/test_openai_api.py",
    "tests/engine/test_process.py",
)


TEST_WORKERS = 3  # the most: each holds torch, a tiny model and the servers it starts


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--recipe",
        action="store_true",
        help="also rebuild the tiny model from its recipe and compare it with the shipped copy (~4 minutes of one "
        "core; CI runs it as a second step)",
    )


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject's addopts): worker processes for a run of folders (the whole suite); one process
    when files or single tests are named (a module stays on one worker anyway), for a collection only, or with
    ``--recipe``. ``VLM_TEST_WORKERS`` sets how many a run of folders gets."""
    if config.option.collectonly or config.getoption("recipe"):
        return 0
    if not any(Path(arg.split("::")[0]).is_dir() for arg in config.args):
        return 0
    if os.environ.get("VLM_TEST_WORKERS"):
        return int(os.environ["VLM_TEST_WORKERS"])
    return min(TEST_WORKERS, (os.cpu_count() or 1) + 1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("recipe"):
        recipe = [item for item in items if is_recipe(item)]
        if recipe:
            config.hook.pytest_deselected(items=recipe)
            items[:] = [item for item in items if item not in recipe]
    rank = {name: place for place, name in enumerate(LONGEST_FIRST)}
    root = Path(config.rootpath)
    items.sort(key=lambda item: rank.get(item.path.relative_to(root).as_posix(), len(rank)))  # stable: else as found


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly or not any(map(is_recipe, session.items)):
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects it; the one that runs it builds then
        return
    session.config.stash[RECIPE_BUILD] = start_recipe_build()


def start_recipe_build() -> tuple[subprocess.Popen, Path]:
    """``python -m vlm_demo.models.tiny`` into a temporary folder, at the tests' priority (a lower one starves it
    on a loaded machine)."""
    folder = Path(tempfile.mkdtemp(prefix="tiny-recipe-"))
    with open(folder / "build.log", "wb") as log:
        build = subprocess.Popen(
            [sys.executable, "-m", "vlm_demo.models.tiny", str(folder / "rebuilt")],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parents[1],
        )
    return build, folder


def pytest_sessionfinish(session: pytest.Session) -> None:
    build, folder = session.config.stash.get(RECIPE_BUILD, (None, None))
    if build is not None:
        build.kill()
        build.wait()
        shutil.rmtree(folder, ignore_errors=True)
    left = outliving(marked_processes(), wait_s=10) if sys.platform.startswith("linux") else []
    if left:  # a test, fixture or server that does not stop what it started: said, and the run fails
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = f"processes the tests started were still running at the session's end (killed now): {left}"
        if reporter is not None:
            reporter.ensure_newline()
            reporter.write_line(message, red=True, bold=True)
        else:
            print(message, file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def recipe_build(request: pytest.FixtureRequest) -> Path:
    """The folder the recipe built (``python -m vlm_demo.models.tiny``), started with the session."""
    if RECIPE_BUILD not in request.config.stash:
        request.config.stash[RECIPE_BUILD] = start_recipe_build()
    build, folder = request.config.stash[RECIPE_BUILD]
    code = build.wait(timeout=3600)
    assert code == 0, (folder / "build.log").read_text()[-4000:]
    return folder / "rebuilt"
