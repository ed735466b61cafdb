"""The wheels a GPU machine's image lacks, carried along with the repository to a machine without
network, and which of the project's modules an interpreter can import.

    .venv/bin/python scripts/gpu_wheels.py fetch     # on a networked machine: wheels into .whl/
    python3 scripts/gpu_wheels.py missing            # on any machine: what it cannot import

``fetch`` (what ``bash scripts/gpu_check.sh --fetch-wheels`` runs) downloads, with ``pip
download``, the wheels of ``CARRIED`` at the versions this interpreter has installed (those the
test suite ran with), built for ``--python-version`` (default 3.12, the GPU image's) on
manylinux x86_64, without their dependencies. It checks each wheel's metadata: that it installs
on that Python and that a wheel requiring torch accepts ``--torch-version`` (default 2.11, the
GPU image's). It adds ``/.whl/`` to git's exclude file so the folder is never committed.
``scripts/gpu_check.sh`` installs the folder's wheels into a temporary target put on
``PYTHONPATH``: the image's own torch is never replaced.
"""

import argparse
import email.parser
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import zipfile

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEEL_DIR = os.path.join(ROOT, ".whl")
EXCLUDE_LINE = "/.whl/"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")

# distribution -> the module it provides. The GPU image (as read on 2026-11-17) has torch, triton,
# transformers, peft, tensorboard, pyarrow, pillow and pytest, but not torchdata (the data loader).
CARRIED = {
    "torchdata": "torchdata",
}
# Modules the GPU check needs (the recipes' imports and the `cuda` tests'), and the one only some
# paths need (parquet files and hub datasets), reported but not required.
REQUIRED_MODULES = (
    "torch",
    "numpy",
    "torchdata",
    "pyarrow",
    "PIL",
    "tokenizers",
    "safetensors",
    "tensorboard",
    "transformers",
    "pytest",
)
OPTIONAL_MODULES = ("datasets", "peft", "triton")


def module_versions(modules: tuple[str, ...]) -> dict[str, str | None]:
    """``{module: its distribution's version, or None when it cannot be imported}``, found
    without importing anything."""
    versions = {}
    provided_by = importlib.metadata.packages_distributions()
    for module in modules:
        if importlib.util.find_spec(module) is None:
            versions[module] = None
            continue
        distributions = provided_by.get(module, [module])
        try:
            versions[module] = importlib.metadata.version(distributions[0])
        except importlib.metadata.PackageNotFoundError:
            versions[module] = "?"
    return versions


def wheel_metadata(path: str) -> email.message.Message:
    """The METADATA of a wheel file."""
    with zipfile.ZipFile(path) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(wheel.read(name).decode())


def check_wheel(path: str, python_version: str, torch_version: str) -> None:
    """ValueError when the wheel does not install on ``python_version`` or, requiring torch,
    does not accept ``torch_version``."""
    metadata = wheel_metadata(path)
    name = os.path.basename(path)
    requires_python = metadata.get("Requires-Python")
    if requires_python and not SpecifierSet(requires_python).contains(python_version):
        raise ValueError(f"{name} requires Python {requires_python}, not {python_version}")
    for line in metadata.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        if canonicalize_name(requirement.name) == "torch" and not requirement.marker:
            if not requirement.specifier.contains(torch_version, prereleases=True):
                raise ValueError(f"{name} requires {line}, not torch {torch_version}")


def add_to_git_exclude() -> str:
    """Add ``/.whl/`` to the checkout's git exclude file (once); returns the file's path."""
    path = subprocess.run(
        ["git", "rev-parse", "--git-path", "info/exclude"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    path = os.path.join(ROOT, path)
    lines = open(path, encoding="utf-8").read().splitlines() if os.path.exists(path) else []
    if EXCLUDE_LINE not in lines:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(EXCLUDE_LINE + "\n")
    return path


def fetch(python_version: str, torch_version: str) -> int:
    os.makedirs(WHEEL_DIR, exist_ok=True)
    pins = []
    for distribution in CARRIED:
        try:
            pins.append(f"{distribution}=={importlib.metadata.version(distribution)}")
        except importlib.metadata.PackageNotFoundError:
            print(f"error: {distribution} is not installed here, so its version is unknown", file=sys.stderr)
            return 1
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", python_version, "--implementation", "cp", *platforms, "-d", WHEEL_DIR, *pins]
    print("+ " + " ".join(cmd), flush=True)
    if subprocess.run(cmd, cwd=ROOT, check=False).returncode != 0:
        print("error: pip download failed (see above)", file=sys.stderr)
        return 1
    wanted = {canonicalize_name(d) for d in CARRIED}
    wheels = sorted(
        os.path.join(WHEEL_DIR, n)
        for n in os.listdir(WHEEL_DIR)
        if n.endswith(".whl") and canonicalize_name(n.split("-")[0]) in wanted
    )
    for wheel in wheels:
        try:
            check_wheel(wheel, python_version, torch_version)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
    exclude = add_to_git_exclude()
    size = sum(os.path.getsize(w) for w in wheels)
    print(f"{len(wheels)} wheels in {WHEEL_DIR} ({size / 2**20:.1f} MiB), ignored through {exclude}:")
    for wheel in wheels:
        print(f"  {os.path.basename(wheel)}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    fetch_parser = commands.add_parser("fetch", help="download the carried wheels into .whl/")
    fetch_parser.add_argument("--python-version", default="3.12", help="the GPU image's Python (default: %(default)s)")
    fetch_parser.add_argument("--torch-version", default="2.11", help="the GPU image's torch (default: %(default)s)")
    commands.add_parser("missing", help="print the modules this interpreter cannot import; exit 1 if any is required")
    args = parser.parse_args()
    if args.command == "fetch":
        return fetch(args.python_version, args.torch_version)
    required = module_versions(REQUIRED_MODULES)
    optional = module_versions(OPTIONAL_MODULES)
    for module, version in {**required, **optional}.items():
        origin = importlib.util.find_spec(module).origin if version else ""
        print(f"{module:14} {version or 'MISSING':14} {origin}".rstrip())
    return 1 if None in required.values() else 0


if __name__ == "__main__":
    sys.exit(main())
