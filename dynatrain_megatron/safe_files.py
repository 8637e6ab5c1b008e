"""Every file the job reads or writes, handled as if others could plant things where it looks.

Reading (the job secret, `join --secret-file`, the signal file, `--dynatrain-schedule`):
the path is opened with `O_NOFOLLOW | O_NONBLOCK` (a symbolic link is refused, a FIFO
never blocks), the open descriptor is checked with `fstat` (a regular file, its owner, its
permission bits, its number of names, as the `ReadRules` say) and at most `limit` bytes are
read from it; a bigger file is refused. Checking the descriptor, not the name, leaves no
moment for a swap between the check and the read.

Writing (logs, the summary, the records of handled requests, the secret, a request):
* the directory is checked first and written through its descriptor: not a symbolic link,
  the job user's or root's, and writable by nobody else unless it is sticky (`/tmp`-like:
  there only a file's owner may move or remove it);
* a new file is created with `O_CREAT | O_EXCL | O_NOFOLLOW` under a temporary name,
  written whole, fsynced and then renamed to its name: a reader never sees half a record,
  and a write that fails (a full disk, a size limit) leaves no file behind. `create_new`
  never replaces an existing name (`renameat2(RENAME_NOREPLACE)`, else a hard link);
  `replace_file` replaces it (the rename moves the name: a link planted there is replaced,
  never followed);
* a file appended to (`switches.jsonl`) must be the job user's regular file with one name
  that nobody else may write; a line is written whole or the file is cut back to where it
  was.

`OutputDir` is the job's log directory: its writes never raise; a failure is logged once
per file and training goes on (a log of ours is never worth the job).
"""
from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import secrets
import stat
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from .vps.errors import DynatrainError

log = logging.getLogger("dynatrain")

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_RENAME_NOREPLACE = 1  # linux/fs.h


class UnsafeFileError(DynatrainError):
    """A file or directory the job refuses to read or write (a link, a FIFO, another user's,
    too big, ...). The message names the path and the reason, on one line."""


@dataclass(frozen=True, slots=True)
class ReadRules:
    """What a file the job reads must be, besides a regular file that is not a link.

    `what`: the file's name in messages ("secret file"). `limit`: the most bytes read.
    `owner_only`: owned by the job's uid (else the job's uid or root). `private`: no
    permission bit for group or others (a secret). `single_link`: one name only (a hard
    link planted in a shared directory could be another file's name). Group- and
    world-writable files are always refused: whoever can write it steers the job."""

    what: str
    limit: int
    owner_only: bool = True
    private: bool = False
    single_link: bool = False

    def __post_init__(self) -> None:
        if not self.what or type(self.limit) is not int or self.limit < 1:
            raise ValueError(f"ReadRules needs a name and a positive byte limit: {self!r}")


# ------------------------------------------------------------------ reading
def open_checked(path: str | Path, rules: ReadRules) -> tuple[int, os.stat_result]:
    """A read-only `O_NOFOLLOW | O_NONBLOCK` descriptor of `path`, checked with `fstat`
    against `rules`; the caller closes it. FileNotFoundError when nothing is there;
    UnsafeFileError otherwise."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        if os.path.islink(p):
            raise UnsafeFileError(f"{rules.what} {p} is a symbolic link, not a regular "
                                  f"file: refused") from None
        raise UnsafeFileError(f"{rules.what} {p} cannot be opened ({e.strerror}): "
                              f"refused") from None
    try:
        st = os.fstat(fd)
        errs = _file_errors(st, rules.owner_only, rules.private, rules.single_link)
        if errs:
            raise UnsafeFileError(f"{rules.what} {p} " + "; ".join(errs) + ": refused")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_fd(fd: int, limit: int) -> bytes:
    """At most `limit` + 1 bytes of `fd` (one more than allowed shows that there is more)."""
    chunks, n = [], 0
    while n <= limit:
        b = os.read(fd, min(1 << 16, limit + 1 - n))
        if not b:
            break
        chunks.append(b)
        n += len(b)
    return b"".join(chunks)


def read_bytes(path: str | Path, rules: ReadRules) -> bytes:
    """The content of `path`, opened and checked by `open_checked`; UnsafeFileError when it
    holds more than `rules.limit` bytes. FileNotFoundError when nothing is there."""
    fd, _ = open_checked(path, rules)
    try:
        data = read_fd(fd, rules.limit)
    except OSError as e:
        raise UnsafeFileError(f"{rules.what} {path} cannot be read ({e.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > rules.limit:
        raise UnsafeFileError(f"{rules.what} {path} is over the limit of {rules.limit} bytes: "
                              f"refused")
    return data


YAML_LIMIT = 16 << 20  # a model, scenario or calibration file is a few kilobytes


def read_yaml(path: str | Path, what: str, error: type[Exception]) -> Any:
    """The parsed content of the YAML (or JSON) file `path`, read as `read_bytes` reads (no
    link followed, a regular file of the job user's or root's that nobody else may write, at
    most `YAML_LIMIT` bytes). Every failure raises `error` with one line naming `what` and
    the path: missing, unsafe, not UTF-8, not YAML (its parser's first line)."""
    import yaml

    try:
        data = read_bytes(path, ReadRules(what, YAML_LIMIT, owner_only=False))
    except FileNotFoundError:
        raise error(f"{what} {str(path)!r} not found") from None
    except UnsafeFileError as e:
        raise error(str(e)) from None
    try:
        return yaml.safe_load(data.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise error(f"{what} {str(path)!r} is not readable YAML: {first}") from None


def _file_errors(st: os.stat_result, owner_only: bool, private: bool,
                 single_link: bool) -> list[str]:
    if not stat.S_ISREG(st.st_mode):
        return [f"is not a regular file ({stat.filemode(st.st_mode)})"]
    errs = []
    uid = os.getuid()
    if st.st_uid != uid and (owner_only or st.st_uid != 0):
        errs.append(f"is owned by uid {st.st_uid}, not the job's uid {uid}"
                    + ("" if owner_only else " (nor root)"))
    if private and st.st_mode & 0o077:
        errs.append(f"has mode {stat.S_IMODE(st.st_mode):04o}: group or others may read or "
                    f"write it")
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        errs.append(f"is writable by others (group- or world-writable: "
                    f"{stat.filemode(st.st_mode)})")
    if single_link and st.st_nlink != 1:
        errs.append(f"has {st.st_nlink} hard links (it may be another file's name)")
    return errs


# ------------------------------------------------------------------ directories
def directory_errors(directory: str | Path) -> list[str]:
    """Why the job must not create files in `directory` (or trust what others put there):
    it is a symbolic link, another user's (not root's), or others may write to it and it
    is not sticky. [] when it is safe."""
    d = Path(directory)
    try:
        st = os.lstat(d)
    except OSError as e:
        return [f"directory {d} cannot be examined ({e.strerror})"]
    return _directory_errors(d, st)


def _directory_errors(d: Path, st: os.stat_result) -> list[str]:
    if stat.S_ISLNK(st.st_mode):
        return [f"directory {d} is a symbolic link"]
    if not stat.S_ISDIR(st.st_mode):
        return [f"{d} is not a directory ({stat.filemode(st.st_mode)})"]
    errs = []
    if st.st_uid not in (os.getuid(), 0):
        errs.append(f"directory {d} is owned by uid {st.st_uid}, not the job's uid "
                    f"{os.getuid()} (nor root)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        errs.append(f"directory {d} is writable by others (mode {stat.filemode(st.st_mode)}) "
                    f"and not sticky: anyone there could replace the job's files")
    return errs


@contextmanager
def checked_directory(directory: str | Path, create: bool = True,
                      mode: int = 0o755) -> Iterator[int]:
    """A descriptor of `directory` (made with `mode` when missing and `create`), checked by
    `directory_errors` on the open descriptor; files are then made relative to it, so the
    directory cannot be swapped after the check. UnsafeFileError when it is unsafe."""
    d = Path(directory)
    if create and not os.path.lexists(d):
        try:
            os.makedirs(d, mode=mode, exist_ok=True)
        except OSError as e:
            raise UnsafeFileError(f"directory {d} cannot be created ({e.strerror})") from None
    try:
        fd = os.open(d, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
    except OSError as e:
        errs = directory_errors(d) or [f"directory {d} cannot be opened ({e.strerror})"]
        raise UnsafeFileError("; ".join(errs)) from None
    try:
        errs = _directory_errors(d, os.fstat(fd))
        if errs:
            raise UnsafeFileError("; ".join(errs))
        yield fd
    finally:
        os.close(fd)


# ------------------------------------------------------------------ writing
def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _temp_with(dir_fd: int, name: str, data: bytes, mode: int) -> str:
    """A fresh temporary file beside `name` holding `data`, fsynced (its name)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    for _ in range(100):
        tmp = f".{name}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
            break
        except FileExistsError:
            continue
    else:
        raise UnsafeFileError(f"no free temporary name beside {name}")
    try:
        os.fchmod(fd, mode)  # the mode asked for, whatever the umask
        _write_all(fd, data)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quietly(tmp, dir_fd)
        raise
    os.close(fd)
    return tmp


def _unlink_quietly(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


_libc: Optional[ctypes.CDLL] = None


def _rename_noreplace(src: str, dst: str, dir_fd: int) -> None:
    """Rename `src` to `dst` within `dir_fd`, FileExistsError when `dst` exists (whatever
    it is). Linux's renameat2; where the file system lacks it, a hard link then the
    removal of `src` (the file has two names for that moment)."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        fn = _libc.renameat2
    except (OSError, AttributeError):
        fn = None
    if fn is not None:
        fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                       ctypes.c_uint)
        if fn(dir_fd, os.fsencode(src), dir_fd, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(err, os.strerror(err), dst)
        if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), dst)
    os.link(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    _unlink_quietly(src, dir_fd)


def create_new(directory: str | Path, name: str, data: bytes, mode: int = 0o600) -> bool:
    """Put a new file `directory/name` holding `data` in place whole, never replacing
    anything: False (nothing written) when the name is taken. The directory is checked
    (`checked_directory`); UnsafeFileError / OSError when it is unsafe or the write fails
    (then no file is left behind)."""
    return create_first_free(directory, [name], data, mode) is not None


def create_numbered(directory: str | Path, stem: str, data: bytes, mode: int = 0o600,
                    limit: int = 1 << 20) -> Path:
    """`directory/<stem>.<n>` for the first free n, made as `create_new` makes a file."""
    names = (f"{stem}.{n}" for n in range(limit))
    dst = create_first_free(directory, names, data, mode)
    if dst is None:
        raise UnsafeFileError(f"no free name {stem}.<n> in {directory}")
    return dst


def create_first_free(directory: str | Path, names: Iterable[str], data: bytes,
                      mode: int = 0o600) -> Optional[Path]:
    """A new file holding `data` under the first of `names` (in `directory`) that is free,
    made as `create_new` makes one: written once under a temporary name, then renamed
    without replacing anything. None when every name is taken."""
    with checked_directory(directory, mode=0o700) as dfd:  # made for private files
        tmp = None
        try:
            for name in names:
                _check_name(name)
                if tmp is None:
                    tmp = _temp_with(dfd, name, data, mode)
                try:
                    _rename_noreplace(tmp, name, dfd)
                except FileExistsError:
                    continue
                tmp = None
                return Path(directory) / name
            return None
        finally:
            if tmp is not None:
                _unlink_quietly(tmp, dfd)


def replace_file(directory: str | Path, name: str, data: bytes, mode: int = 0o644) -> Path:
    """Put `data` at `directory/name` whole, replacing what is there (a link planted at
    the name is replaced, never written through). Checked directory; on failure the old
    file stays as it was and no temporary is left."""
    _check_name(name)
    with checked_directory(directory) as dfd:
        tmp = _temp_with(dfd, name, data, mode)
        try:
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            _unlink_quietly(tmp, dfd)
            raise
    return Path(directory) / name


def append_line(directory: str | Path, name: str, line: str, mode: int = 0o644) -> None:
    """Append `line` (a newline is added) to `directory/name`, created when missing. An
    existing file must be the job user's regular file with one name that nobody else may
    write; a line that cannot be written whole is cut off again (the file keeps whole lines)."""
    _check_name(name)
    data = (line.rstrip("\n") + "\n").encode()
    with checked_directory(directory) as dfd:
        base = os.O_WRONLY | os.O_APPEND | _NOFOLLOW | _NONBLOCK | _CLOEXEC
        try:
            fd = os.open(name, base | os.O_CREAT | os.O_EXCL, mode, dir_fd=dfd)
            os.fchmod(fd, mode)
        except FileExistsError:
            try:
                fd = os.open(name, base, dir_fd=dfd)
            except OSError as e:
                what = ("a symbolic link" if e.errno == errno.ELOOP else
                        f"not writable ({e.strerror})")
                raise UnsafeFileError(f"{Path(directory) / name} is {what}: not appended "
                                      f"to") from None
        try:
            st = os.fstat(fd)
            errs = _file_errors(st, owner_only=True, private=False, single_link=True)
            if errs:
                raise UnsafeFileError(f"{Path(directory) / name} " + "; ".join(errs)
                                      + ": not appended to")
            try:
                _write_all(fd, data)
            except OSError:
                try:
                    os.ftruncate(fd, st.st_size)
                except OSError:
                    pass
                raise
        finally:
            os.close(fd)


def _check_name(name: str) -> None:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"a file name within the directory, got {name!r}")


# ------------------------------------------------------------------ the job's log directory
_WHOLE_DIR = "/"  # in OutputDir._failed: the directory itself was refused (never a file name)


class OutputDir:
    """The job's log directory (`--dynatrain-log-dir`), written on one rank: JSON lines and
    JSON records. A write never raises: a failure (an unsafe directory or file, a full disk,
    a size limit) is logged once per file, the next ones at debug level, and the job goes on.
    Each method returns whether the write took place."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._failed: set[str] = set()

    def check(self) -> Optional[str]:
        """Make the directory if missing and check it now, at start-up, rather than at the
        first switch: None when it is usable, else the reason, logged once (the writes then
        fail quietly; training goes on)."""
        try:
            with checked_directory(self.path, create=True):
                return None
        except Exception as e:  # noqa: BLE001 - a log of ours is never worth the job
            reason = f"{type(e).__name__}: {e}"
        self._failed.add(_WHOLE_DIR)
        log.error("dynatrain: the log directory %s cannot be used (%s); switch records will "
                  "not be written there, training goes on", self.path, reason)
        return reason

    def append_json_line(self, name: str, entry: dict) -> bool:
        """One JSON line appended to `name` (`append_line`)."""
        return self._attempt(name, lambda: append_line(self.path, name, json.dumps(entry)))

    def write_json(self, name: str, obj: object, indent: Optional[int] = 1) -> bool:
        """`name` replaced whole by `obj` as JSON (`replace_file`)."""
        return self._attempt(name, lambda: replace_file(
            self.path, name, json.dumps(obj, indent=indent).encode()))

    def _attempt(self, name: str, write) -> bool:
        try:
            write()
            return True
        except Exception as e:  # noqa: BLE001 - a write of ours must never end training
            reason = f"{type(e).__name__}: {e}"
            if name in self._failed or _WHOLE_DIR in self._failed:
                log.debug("dynatrain: %s in %s not written again: %s", name, self.path, reason)
            else:
                self._failed.add(name)
                log.error("dynatrain: could not write %s in %s (%s); training goes on "
                          "without it (later failures of this file are not logged)", name,
                          self.path, reason)
            return False
