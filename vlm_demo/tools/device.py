"""Run the GPU check on a lent device machine that has no package registry, in one command.

The device's image has its own Python (3.12), torch (2.11, CUDA 13) and an older transformers than
ours, and cannot install anything from the network. So:

- here: ``python -m vlm_demo.tools.device prepare`` downloads the wheels it lacks (the pinned
  transformers and torchao, and the tokenizers, regex and pillow builds we test with, for its Python) into
  ``.device/wheels``, ignored by git, and checks that they and the working tree fit the 64 MiB that
  travel to the device (the device tool's ``carry=[".device/wheels"]``: only the wheels travel);
- there: ``python3 -m vlm_demo.tools.device gpucheck --out $OUT`` installs them into ``.device/site``
  (``pip install --no-deps --no-index --target``: nothing of the image is replaced, our copies just
  come first on ``PYTHONPATH``), then runs ``python -m vlm_demo.tools.gpucheck --json
  $OUT/gpucheck.json --deadline-s 360``, kills it ``KILL_GRACE_S`` after that deadline should its own
  watchdog not have ended it, and leaves the log next to the report.

Only the standard library is imported here: it must run on the bare device image.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import os
import shutil
import subprocess
import sys
import threading
import time
import zipfile

from vlm_demo import REPO_ROOT
from vlm_demo.tools.gpucheck import DEADLINE_S, pinned_versions

DEVICE_DIR = os.path.join(REPO_ROOT, ".device")
CARRY = ".device/wheels"  # the device tool's carry list is [CARRY]: this folder alone travels
TRAVEL_CAP = 64 * 1024**2  # what travels to the device: the working tree and the carried paths together
DEVICE_PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# transformers and torchao as pinned (the image has neither at our versions), and what transformers checks at import
CARRIED = ("transformers", "torchao", "tokenizers", "regex", "pillow")
KILL_GRACE_S = 20.0  # after gpucheck's deadline: its watchdog's backstop fires at 15 s, this kill at 20


def wanted_wheels() -> list[str]:
    """``name==version`` for each carried package: as pinned in requirements.txt, else as installed here."""
    pins = pinned_versions()
    specs = []
    for name in CARRIED:
        version = pins.get(name) or importlib.metadata.version(name)
        specs.append(f"{name}=={version}")
    return specs


def prepare(folder: str, python: str, packages: list[str] | None = None) -> list[str]:
    """Download the carried wheels for ``python`` (e.g. "3.12") into ``folder/wheels``; returns their files."""
    wheels = os.path.join(folder, "wheels")
    shutil.rmtree(wheels, ignore_errors=True)
    os.makedirs(wheels)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", wheels]
    command += ["--python-version", python, "--implementation", "cp"]
    command += [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(command + (packages or wanted_wheels()), check=True)
    return sorted(glob.glob(os.path.join(wheels, "*.whl")))


def tree_bytes(root: str = REPO_ROOT) -> int:
    """Bytes of the working tree that travels to the device: tracked and untracked-not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    paths = (os.path.join(root, p) for p in listed.decode().split("\0") if p)
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p))


def travel_summary(files: list[str], tree: int, carry: str = CARRY) -> tuple[str, bool]:
    """The line ``prepare`` prints (the wheels and the working tree against the cap) and whether they fit."""
    wheels = sum(os.path.getsize(f) for f in files)
    total, mib = wheels + tree, 1024**2
    line = (
        f"{len(files)} wheels ({wheels / mib:.1f} MiB) in {carry} + the working tree ({tree / mib:.1f} MiB) = "
        f"{total / mib:.1f} MiB of the {TRAVEL_CAP / mib:.0f} MiB that travel; carry exactly [{carry!r}]"
    )
    return line, total <= TRAVEL_CAP


def install(folder: str) -> str:
    """Install the carried wheels into ``folder/site`` (no index, no dependencies); returns that folder.

    With pip when the image has it; else each wheel is unpacked there (a wheel is a zip of what an
    install puts in site-packages), so a bare interpreter is enough."""
    wheels = sorted(glob.glob(os.path.join(folder, "wheels", "*.whl")))
    if not wheels:
        raise SystemExit(f"no wheels in {folder}/wheels: run `python -m vlm_demo.tools.device prepare` first")
    site = os.path.join(folder, "site")
    shutil.rmtree(site, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target", site]
    if subprocess.run(command + wheels).returncode != 0:
        print("device: pip could not install the wheels; unpacking them instead", file=sys.stderr)
        shutil.rmtree(site, ignore_errors=True)
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(site)
    return site


def run_gpucheck(folder: str, out: str, deadline_s: float, extra: list[str]) -> int:
    """gpucheck with the carried packages first on the path, its output teed to ``out/gpucheck.log``; killed
    ``KILL_GRACE_S`` after ``deadline_s`` if still running (a timer: a silent hang blocks the reading)."""
    site = install(folder)
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (site, REPO_ROOT, os.environ.get("PYTHONPATH")) if p))
    env["PYTHONUNBUFFERED"] = "1"
    command = [sys.executable, "-m", "vlm_demo.tools.gpucheck", "--json", os.path.join(out, "gpucheck.json")]
    command += ["--deadline-s", str(deadline_s), *extra]
    started = time.monotonic()
    with open(os.path.join(out, "gpucheck.log"), "w") as log:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            proc.kill()

        killer = threading.Timer(deadline_s + KILL_GRACE_S, kill)
        killer.daemon = True
        killer.start()
        assert proc.stdout is not None
        try:
            for line in iter(proc.stdout.readline, b""):
                text = line.decode("utf-8", "replace")
                sys.stdout.write(text)
                log.write(text)
        finally:
            killer.cancel()
        code = proc.wait()
        if killed.is_set():
            log.write(f"device: gpucheck overran its deadline ({deadline_s:.0f} s) and was killed\n")
    print(f"device: gpucheck exited {code} after {time.monotonic() - started:.0f} s; report in {out}")
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlm_demo.tools.device", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=DEVICE_DIR, help="where the carried wheels live (default .device/)")
    commands = parser.add_subparsers(dest="command", required=True)
    ready = commands.add_parser("prepare", help="here: download the wheels the device lacks")
    ready.add_argument("--python", default=DEVICE_PYTHON, help="the device's Python version (default 3.12)")
    check = commands.add_parser("gpucheck", help="there: install the carried wheels and run the GPU check")
    check.add_argument("--out", default=os.environ.get("OUT", "out"), help="where the report goes (default $OUT)")
    check.add_argument(
        "--deadline-s",
        type=float,
        default=DEADLINE_S,
        help=f"gpucheck's watchdog; the runner kills it {KILL_GRACE_S:.0f} s later (default {DEADLINE_S:.0f} s)",
    )
    check.add_argument("extra", nargs=argparse.REMAINDER, help="more gpucheck flags, after --")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        carry = os.path.relpath(os.path.join(args.dir, "wheels"), REPO_ROOT)
        line, fits = travel_summary(prepare(args.dir, args.python), tree_bytes(), carry)
        print(line)
        if not fits:
            print("device: too much to carry: the device tool refuses more than 64 MiB in all", file=sys.stderr)
        return 0 if fits else 1
    extra = [a for a in args.extra if a != "--"]
    if "--deadline-s" in extra:
        parser.error("give --deadline-s before --: the runner's own kill follows it")
    return run_gpucheck(args.dir, args.out, args.deadline_s, extra)


if __name__ == "__main__":
    sys.exit(main())
