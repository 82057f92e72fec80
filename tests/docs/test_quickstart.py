"""The README's own steps, as a newcomer takes them: its Quick start, line by line, in a fresh copy of the
repository with the virtual environment inside it, then its test command there.

A newcomer's ``.venv`` once made the README's test command fail: git did not ignore it, so the device tool
counted its 1.6 GB against what may travel. This runs the steps where that showed. What differs from a
newcomer's run, and why:

- the copy is what a clone of this working tree holds (tracked files and new ones git does not ignore), made a
  git repository of its own;
- ``python -m venv`` gets ``--system-site-packages`` and a ``.pth`` line naming the site-packages of the Python
  running the tests: its packages serve the installs, so nothing big is installed again (what is missing still
  is, as for a newcomer) — also when the tests run inside the README's own activated ``.venv``, whose packages
  a nested venv's ``--system-site-packages`` alone does not see (it takes the interpreter behind the venv);
- ``python app.py`` runs until its page is healthy (on a free port, through ``GRADIO_SERVER_PORT``, which the
  app honours), then it is stopped;
- the test command runs a few tests (the docs' checks, the device tool's count of the working tree, the
  shipped tiny model), not the whole suite again.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from support import ROOT, free_port

pytestmark = pytest.mark.slow

README = ROOT / "README.md"
SELECTED = [
    "tests/docs/test_docs.py",
    "tests/tools/test_gpucheck.py::test_prepare_counts_the_wheels_and_the_working_tree_against_the_64_mib_that_travel",
    "tests/models/test_tiny.py::test_the_shipped_model_is_used_unless_another_folder_is_asked_for",
]
SERVE_UNTIL_HEALTHY = """python app.py > app.log 2>&1 &
app=$!
for _ in $(seq 240); do
  curl -sf "http://127.0.0.1:$GRADIO_SERVER_PORT/health" > health.json && break
  kill -0 $app || { cat app.log; exit 1; }
  sleep 1
done
kill $app; wait $app || true
cat health.json"""


def first_bash_block(heading: str) -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index(heading + "\n") :]
    return re.search(r"^```bash\n(.*?)^```", section, re.S | re.M).group(1)


def fresh_copy(into: Path) -> Path:
    """What a clone of this working tree holds, as a git repository of its own."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    quiet = {"stdout": subprocess.DEVNULL, "check": True, "cwd": into}
    subprocess.run(["git", "init", "-q"], **quiet)
    subprocess.run(["git", "add", "-A"], **quiet)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "clone"], **quiet)
    return into


def test_the_readmes_quick_start_and_test_command_pass_in_a_fresh_clone(tmp_path: Path) -> None:
    clone = fresh_copy(tmp_path / "clone")
    quick_start = first_bash_block("## Quick start")
    assert "python -m venv .venv" in quick_start and "\npython app.py\n" in "\n" + quick_start, quick_start
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    ours = sysconfig.get_paths()["purelib"]  # where the running tests' packages are (a venv's, when in one)
    steps = quick_start.replace(
        "python -m venv .venv",
        f"python -m venv --system-site-packages .venv && echo '{ours}' > .venv/lib/{version}/site-packages/tests.pth",
    )
    steps = re.sub(r"^python app\.py$", SERVE_UNTIL_HEALTHY, steps, flags=re.M)
    test_command = first_bash_block("## Tests")
    assert test_command.rstrip().endswith("python -m pytest -q"), test_command
    steps += test_command.rstrip() + " -p no:cacheprovider " + " ".join(SELECTED) + "\n"
    steps += "git status --porcelain\n"  # what the steps left that git would offer to commit
    env = dict(
        os.environ,
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),  # `python`: the tests' Python
        GRADIO_SERVER_PORT=str(free_port()),
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    env.pop("VIRTUAL_ENV", None)
    done = subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + steps],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = done.stdout
    assert done.returncode == 0, f"the README's steps failed in a fresh clone:\n{out[-4000:]}\n{done.stderr[-4000:]}"
    assert '"ready":true' in out.replace(" ", ""), out[-3000:]  # python app.py served a healthy page
    # the runtime was not installed again: the tests' own packages served the install
    assert "Requirement already satisfied: torch" in out and "Collecting torch" not in out, out[:3000]
    assert re.search(r"^\d+ passed", out, re.M) and " failed" not in out, out[-3000:]
    assert (clone / ".venv" / "bin" / "python").exists()
    untracked = [line for line in out.splitlines() if line.startswith("?? ")]
    assert untracked == ["?? app.log", "?? health.json"], f"git would offer to commit: {untracked}"
