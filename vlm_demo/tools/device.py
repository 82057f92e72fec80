"""Run the GPU check on a lent device machine that has no package registry, in one command.

The device's image has its own Python (3.12), torch (2.11, CUDA 13) and an older transformers than
ours, and cannot install anything from the network. So:

- here: ``python -m vlm_demo.tools.device prepare`` downloads the wheels it lacks (the pinned
  transformers, and the tokenizers, regex and pillow builds we test with, for its Python) into
  ``.device/wheels`` (ignored by git; carried to the device with the working tree);
- there: ``python -m vlm_demo.tools.device gpucheck --out $OUT`` installs them (``pip install --no-deps
  --no-index --target``: nothing of the image is replaced, our copies just come first on ``PYTHONPATH``),
  then runs ``python -m vlm_demo.tools.gpucheck --json $OUT/gpucheck.json`` under an outer time limit on
  top of gpucheck's own watchdog, and leaves the log next to the report.

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
import time
import zipfile

from vlm_demo import REPO_ROOT

DEVICE_DIR = os.path.join(REPO_ROOT, ".device")
DEVICE_PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64")
CARRIED = ("transformers", "tokenizers", "regex", "pillow")  # transformers' pin, and what it checks at import


def wanted_wheels() -> list[str]:
    """``name==version`` for each carried package: transformers as pinned, the rest as installed here."""
    from vlm_demo.tools.gpucheck import pinned_versions

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
    command += ["--python-version", python] + [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(command + (packages or wanted_wheels()), check=True)
    return sorted(glob.glob(os.path.join(wheels, "*.whl")))


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
    """gpucheck with the carried packages first on the path, its output teed to ``out/gpucheck.log``."""
    site = install(folder)
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (site, REPO_ROOT, os.environ.get("PYTHONPATH")) if p))
    env["PYTHONUNBUFFERED"] = "1"
    command = [sys.executable, "-m", "vlm_demo.tools.gpucheck", "--json", os.path.join(out, "gpucheck.json")]
    command += ["--deadline-s", str(deadline_s), *extra]
    started = time.monotonic()
    with open(os.path.join(out, "gpucheck.log"), "w") as log:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, b""):
            text = line.decode("utf-8", "replace")
            sys.stdout.write(text)
            log.write(text)
            if time.monotonic() - started > deadline_s + 30:  # gpucheck's own watchdog did not fire: stop it
                proc.kill()
                log.write("device: gpucheck overran its deadline and was killed\n")
                break
        code = proc.wait()
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
    check.add_argument("--deadline-s", type=float, default=540.0, help="gpucheck's watchdog (default 540 s)")
    check.add_argument("extra", nargs=argparse.REMAINDER, help="more gpucheck flags, after --")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        files = prepare(args.dir, args.python)
        size = sum(os.path.getsize(f) for f in files) / 1e6
        print(f"{len(files)} wheels ({size:.0f} MB) in {args.dir}/wheels; carry `.device` to the device machine")
        return 0
    extra = [a for a in args.extra if a != "--"]
    return run_gpucheck(args.dir, args.out, args.deadline_s, extra)


if __name__ == "__main__":
    sys.exit(main())
