"""A run directory's files are pflkit's own: they are never reached through a link planted there.

Run directories are shared between people, so anything in one may have been replaced: a symbolic link where
``metrics.jsonl`` was would make an append land in the link's target, a FIFO would hang a reader, a link to
``/dev/zero`` would fill memory. Every file pflkit writes, appends to or reads back in a run directory goes
through these primitives (the single source of truth for that):

- ``open_append`` / ``open_rw``: ``O_NOFOLLOW`` (a link as the last path component fails), ``O_NONBLOCK`` while
  opening (a FIFO without a reader fails instead of hanging), then ``fstat``: only a regular file is accepted;
- ``write_atomic``: rewrite through a fresh temporary file in the same directory (``O_EXCL``: never an existing
  entry) and ``os.replace``, after refusing a link or special file at the target;
- ``ensure_dir``: create a directory, or accept an existing one only when it is a real directory (not a link);
- ``check_run_dir``: refuse a run directory in which one of pflkit's own names is a link or not what pflkit
  writes there (checked before a start reusing it or a resume writes anything);
- ``read_regular``: bounded read of a regular file (no links, FIFOs or devices; a size limit);
- ``OwnDir``: a folder held open by descriptor (the spill store's ``client_state/``): its files are created,
  renamed, read and removed relative to that descriptor, so replacing the folder by a link while the run is live
  redirects nothing.

Refusals are ``RunFileError`` (a ``CheckpointError``: the CLI prints one line, exit status 2) naming the file.
For paths, only the last component is protected against links: the run directory itself is the user's choice,
``tb/`` (written by TensorBoard's own writer) is checked with ``lstat`` when a run starts or resumes, and
``client_state/`` is an ``OwnDir``.
"""
from __future__ import annotations

import os
import secrets
import stat
import tempfile
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Optional, Union

from .errors import CheckpointError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_AT = all(f in os.supports_dir_fd for f in (os.open, os.rename, os.unlink, os.stat))  # os.replace: as rename
_FIX = "remove it (pflkit writes only its own files and folders in a run directory) and try again"
_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once: rewritten files get the permissions a plain open() would give them


class RunFileError(CheckpointError):
    """A file or folder of a run directory is a link, a FIFO, a device or too large: refused, never followed."""


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "not a regular file"


def refused(path: Union[str, Path], what: str) -> RunFileError:
    return RunFileError(f"{path} is {what}, not pflkit's own file or folder; refused: {_FIX}")


def _open(path: Path, flags: int, mode: int = 0o644) -> int:
    """fd of ``path`` opened without following a link; only a regular file is accepted."""
    try:
        fd = os.open(path, flags | _NOFOLLOW | _NONBLOCK | _CLOEXEC, mode)
    except OSError as exc:
        try:
            st = os.lstat(path)
        except OSError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise refused(path, _kind(st.st_mode)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise refused(path, _kind(st.st_mode))
        if _NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_rw(path: Union[str, Path], mode: int = 0o644) -> int:
    """Raw fd for reading and writing ``path`` (created when missing), never through a link."""
    return _open(Path(path), os.O_RDWR | os.O_CREAT, mode)


def open_append(path: Union[str, Path], encoding: str = "utf-8") -> IO[str]:
    """Text file appending to ``path`` (created when missing), never through a link."""
    fd = _open(Path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    return os.fdopen(fd, "a", encoding=encoding)


def open_read(path: Union[str, Path]) -> IO[bytes]:
    """Binary file reading ``path``, which must be a regular file (never a link, FIFO or device)."""
    return os.fdopen(_open(Path(path), os.O_RDONLY), "rb")


def check_entry(path: Union[str, Path], directory: bool = False) -> bool:
    """Whether ``path`` exists as pflkit's own entry (a regular file, or a real directory with ``directory``);
    a link or anything else there is refused. False when nothing is there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise RunFileError(f"cannot inspect {path}: {exc.strerror or exc}") from None
    ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    if not ok:
        raise refused(path, _kind(st.st_mode))
    return True


def write_atomic(path: Union[str, Path], data: Union[bytes, str]) -> None:
    """Replace ``path`` with ``data`` via a new temporary file and a rename (a kill leaves the old or the new
    file, never half a file); a link or special file at ``path`` is refused, never written through."""
    path = Path(path)
    check_entry(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=temporary_prefix(path.name), suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_UMASK)  # mkstemp makes 0600; run directories are shared
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def ensure_dir(path: Union[str, Path]) -> Path:
    """Create the directory ``path`` (its parent must exist) or accept it when it is a real directory."""
    path = Path(path)
    try:
        os.mkdir(path)
    except FileExistsError:
        check_entry(path, directory=True)
    return path


def check_tree(path: Union[str, Path]) -> None:
    """``path`` (if present) is a real directory whose entries are regular files or real directories, checked
    recursively: a folder pflkit writes into (``tb/``, ``client_state/``) holds nothing planted."""
    if not check_entry(path, directory=True):
        return
    for entry in os.scandir(path):
        if entry.is_dir(follow_symlinks=False):
            check_tree(entry.path)
        else:
            check_entry(entry.path)


def check_run_dir(run_dir: Union[str, Path], files: Iterable[str], dirs: Iterable[str] = ()) -> None:
    """Refuse ``run_dir`` when one of pflkit's own ``files`` there is not a regular file, or one of its ``dirs``
    is not a real directory of regular files (a link, FIFO or device planted by someone else)."""
    run_dir = Path(run_dir)
    for name in files:
        check_entry(run_dir / name)
    for name in dirs:
        check_tree(run_dir / name)


def read_regular(path: Union[str, Path], limit: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them (a larger file is a RunFileError); links,
    FIFOs and devices are refused without blocking."""
    with open_read(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise RunFileError(f"{path} holds {size} bytes, more than the {limit} bytes pflkit reads from such a file; "
                               f"refused")
        data = f.read(limit + 1)
    if len(data) > limit:  # grew while being read
        raise RunFileError(f"{path} holds more than the {limit} bytes pflkit reads from such a file; refused")
    return data


def temporary_prefix(name: str) -> str:
    """Prefix of ``write_atomic``'s temporary files for ``name`` (they end in ``.tmp``)."""
    return f".{name}-"


def remove_temporaries(directory: Union[str, Path], names: Iterable[str]) -> int:
    """Delete temporaries ``write_atomic`` left for ``names`` in ``directory`` when killed mid-write; how many."""
    n = 0
    for name in names:
        for p in Path(directory).glob(f"{temporary_prefix(name)}*.tmp"):
            try:
                os.unlink(p)  # a link is removed itself, never its target
                n += 1
            except OSError:
                pass
    return n


def unlink_entry(path: Union[str, Path]) -> None:
    """Remove ``path`` when present (a link is removed itself, never its target)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class OwnDir:
    """A folder pflkit owns, held open (``O_DIRECTORY | O_NOFOLLOW``) from its first use: files in it are named
    relative to the descriptor, never through a path that could be re-pointed. Where the platform has no
    ``dir_fd`` support the paths are used (with ``O_NOFOLLOW`` on the file)."""

    def __init__(self, path: Union[str, Path]) -> None:
        self.path = Path(path)
        self.fd: Optional[int] = None

    def _open_dir(self) -> Optional[int]:
        if self.fd is None and _AT:
            ensure_dir(self.path)
            try:
                self.fd = os.open(self.path, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
            except OSError:
                check_entry(self.path, directory=True)  # a link or a file: refused, naming it
                raise
        elif not _AT:
            ensure_dir(self.path)
        return self.fd

    def _name(self, name: str) -> Union[str, Path]:
        return name if self.fd is not None else self.path / name

    def write(self, name: str, fill: Callable[[IO[bytes]], Any]) -> None:
        """Create ``name`` whole: ``fill(f)`` writes a new temporary file, which is then renamed to ``name``."""
        dir_fd = self._open_dir()
        tmp = f"{temporary_prefix(name)}{secrets.token_hex(8)}.tmp"
        fd = os.open(self._name(tmp), os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600,
                     dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as f:
                fill(f)
            os.replace(self._name(tmp), self._name(name), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            self.unlink(tmp)
            raise

    def read(self, name: str, limit: int) -> bytes:
        """The bytes of the regular file ``name`` (at most ``limit``; links, FIFOs, devices and larger files are
        refused, naming the file)."""
        dir_fd = self._open_dir()
        shown = self.path / name
        try:
            fd = os.open(self._name(name), os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC, dir_fd=dir_fd)
        except OSError:
            try:
                st = os.stat(self._name(name), dir_fd=dir_fd, follow_symlinks=False)
            except OSError:
                st = None
            if st is not None and not stat.S_ISREG(st.st_mode):
                raise refused(shown, _kind(st.st_mode)) from None
            raise
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise refused(shown, _kind(st.st_mode))
            if st.st_size > limit:
                raise RunFileError(f"{shown} holds {st.st_size} bytes, more than the {limit} bytes pflkit wrote there")
            return f.read(limit + 1)

    def rename(self, src: str, dst: str) -> None:
        dir_fd = self._open_dir()
        os.replace(self._name(src), self._name(dst), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)

    def unlink(self, name: str) -> None:
        try:
            os.unlink(self._name(name), dir_fd=self.fd)
        except OSError:
            pass

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
