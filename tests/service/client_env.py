"""The tinker-cookbook's Python environment for the service tests: a venv of its own in
``.venv-tinker-client/`` (git-ignored) at the repository root, since the cookbook caps
transformers below the main environment's version. The client only talks HTTP to the server,
so the two environments share nothing but the wire.

``client_python()`` builds it on first use and reuses it while its stamp matches. A build
installs exactly the pins of ``client_requirements.txt`` without dependency resolution
(``pip install --no-deps``). A pinned distribution that the main environment already has at
that version (torch, numpy, pandas, pyarrow, ...) is not installed again: its files are
symlinked from the main environment's site-packages, so building costs only the downloads of
what differs. The stamp names the pins, the interpreter and every linked distribution's place,
so a main environment that changes one of them makes the next call rebuild. Parallel pytest
workers serialize on a file lock; the stamp is written last, so an interrupted build is redone.
Never ``pip install`` or uninstall in it by hand: an uninstall would delete the linked files in
the main environment; change the pins instead.
"""

import fcntl
import shutil
import subprocess
import sys
import sysconfig
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path, PurePosixPath

from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_DIR = REPO_ROOT / ".venv-tinker-client"
REQUIREMENTS = Path(__file__).with_name("client_requirements.txt")
STAMP_FILE = "tinker-client.stamp"
INSTALL_TIMEOUT_S = 900


@dataclass(frozen=True)
class Pin:
    name: str
    version: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


@dataclass(frozen=True)
class Plan:
    """What a build does: the pins to link from the main environment, the pins to install."""

    linked: tuple[tuple[Pin, metadata.Distribution], ...]
    installed: tuple[Pin, ...]

    def stamp(self) -> str:
        lines = [f"python {sys.version.split()[0]} {Path(sys.base_prefix).resolve()}"]
        lines += [f"install {pin.requirement}" for pin in self.installed]
        lines += [f"link {pin.requirement} from {_site_dir(dist)}" for pin, dist in self.linked]
        return "\n".join(lines) + "\n"


def client_python() -> str:
    """The path of the client venv's python, building the venv first when its stamp does not match."""
    python = VENV_DIR / "bin" / "python"
    with _file_lock(VENV_DIR.with_name(VENV_DIR.name + ".lock")):
        plan = _plan()
        stamp_path = VENV_DIR / STAMP_FILE
        if not (stamp_path.is_file() and stamp_path.read_text() == plan.stamp()):
            _build(plan)
            stamp_path.write_text(plan.stamp())
    return str(python)


def _read_pins(path: Path = REQUIREMENTS) -> list[Pin]:
    pins = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise ValueError(f"{path}:{number}: expected 'name==version', got {line!r}")
        pins.append(Pin(name.strip(), version.strip()))
    return pins


@contextmanager
def _file_lock(path: Path):
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _plan() -> Plan:
    linked, installed = [], []
    for pin in _read_pins():
        dist = _main_distribution(pin)
        if dist is not None and _linkable_files(dist) is not None:
            linked.append((pin, dist))
        else:
            installed.append(pin)
    return Plan(tuple(linked), tuple(installed))


def _main_distribution(pin: Pin) -> metadata.Distribution | None:
    """The main environment's distribution of ``pin`` (the one its imports find), if its version is the pin's."""
    try:
        dist = metadata.distribution(pin.name)
    except metadata.PackageNotFoundError:
        return None
    # ==2.13.0 accepts a local build label (torch's 2.13.0+cpu), as pip does.
    return dist if SpecifierSet(f"=={pin.version}").contains(dist.version, prereleases=True) else None


def _linkable_files(dist: metadata.Distribution) -> list[PurePosixPath] | None:
    """The files of ``dist``'s RECORD inside its site-packages folder (not its scripts or man
    pages, which the client never runs); None when it has no RECORD."""
    if not dist.files:
        return None
    paths = (PurePosixPath(str(file)) for file in dist.files)
    return [path for path in paths if not path.is_absolute() and ".." not in path.parts]


def _site_dir(dist: metadata.Distribution) -> Path:
    return Path(str(dist.locate_file(""))).resolve()


def _build(plan: Plan) -> None:
    if VENV_DIR.exists():
        shutil.rmtree(VENV_DIR)
    _run([sys._base_executable, "-m", "venv", "--without-pip", str(VENV_DIR)], "creating the venv")
    site = Path(sysconfig.get_path("purelib", vars={"base": str(VENV_DIR), "platbase": str(VENV_DIR)}))
    _link(plan.linked, site)
    if plan.installed:
        pip = [sys.executable, "-m", "pip", "--python", str(VENV_DIR / "bin" / "python"), "install"]
        flags = ["--no-deps", "--only-binary=:all:", "--no-compile", "--no-input", "--disable-pip-version-check"]
        _run([*pip, *flags, *(pin.requirement for pin in plan.installed)], "installing " + str(REQUIREMENTS))


def _link(linked: tuple[tuple[Pin, metadata.Distribution], ...], site: Path) -> None:
    """Symlink each linked distribution's files into ``site``: a folder whole when no other
    distribution of its site-packages has files in it, else folder by folder (namespace
    packages such as ``google/``)."""
    owners_by_site: dict[Path, dict[PurePosixPath, set[str]]] = {}
    for _, dist in linked:
        source = _site_dir(dist)
        if source not in owners_by_site:
            owners_by_site[source] = _folder_owners(source)
        owners = owners_by_site[source]
        name = canonicalize_name(dist.metadata["Name"])
        files = set(_linkable_files(dist))
        pending = [PurePosixPath()]
        while pending:
            folder = pending.pop()
            entries = {
                file.parts[len(folder.parts)] for file in files if file.parts[: len(folder.parts)] == folder.parts
            }
            (site / folder).mkdir(parents=True, exist_ok=True)
            for entry in sorted(entries):
                path = folder / entry
                if path in files:
                    if (source / path).exists():
                        (site / path).symlink_to(source / path)
                elif owners[path] == {name}:
                    (site / path).symlink_to(source / path, target_is_directory=True)
                else:
                    pending.append(path)


def _folder_owners(site: Path) -> dict[PurePosixPath, set[str]]:
    """For each folder under ``site`` that a RECORD names files in: the distributions that do."""
    owners: dict[PurePosixPath, set[str]] = defaultdict(set)
    for dist in metadata.distributions(path=[str(site)]):
        name = canonicalize_name(dist.metadata["Name"])
        for file in dist.files or ():
            for parent in PurePosixPath(str(file)).parents:
                owners[parent].add(name)
    return owners


def _run(command: list[str], what: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"{what} for the tinker client failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )


if __name__ == "__main__":
    print(client_python())
