"""Files only the job's user may read, written atomically (signal files, the job secret)."""
from __future__ import annotations

import os
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
