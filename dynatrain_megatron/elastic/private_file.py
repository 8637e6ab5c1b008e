"""Files only the job's user may read, written atomically (signal files, the job secret),
and the checks that a directory or file the job trusts cannot be swapped by others."""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def write_private(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` with mode 0600, atomically: a reader never sees a partial
    file, nor a moment where it is readable by others (0600 before the first byte)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def directory_errors(directory: str | Path) -> list[str]:
    """Why a directory the job reads requests or meets in is unsafe: another user owns it,
    or others may write to it and it is not sticky (then anyone there could replace the
    job's files). In a sticky directory only a file's owner may move it, so the files'
    own checks suffice."""
    d = Path(directory)
    st = os.stat(d)
    errs = []
    if st.st_uid not in (os.getuid(), 0):
        errs.append(f"directory {d} is owned by uid {st.st_uid}, not the job's uid "
                    f"{os.getuid()} (nor root)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        errs.append(f"directory {d} is writable by others (mode {stat.filemode(st.st_mode)}) "
                    f"and not sticky: anyone there could replace the job's files")
    return errs


def file_errors(path: str | Path) -> list[str]:
    """Why an existing file the job trusts is unsafe (not a regular file, e.g. a link;
    another user's; writable by others); [] when it is safe or does not exist."""
    p = Path(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return []
    errs = []
    if not stat.S_ISREG(st.st_mode):
        errs.append(f"{p} is not a regular file ({stat.filemode(st.st_mode)})")
    if st.st_uid != os.getuid():
        errs.append(f"{p} is owned by uid {st.st_uid}, not the job's uid {os.getuid()}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        errs.append(f"{p} is writable by others ({stat.filemode(st.st_mode)})")
    return errs
