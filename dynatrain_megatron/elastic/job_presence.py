"""Whether a job is polling a signal file: `<signal>.job`, written by the job's rank 0 when
it starts (its host, process id and start time; 0600, atomically) and removed when it ends.

`dynatrain request --wait` reads it to tell a request that waits for its turn from one
that nobody will ever answer: no file (no job uses this signal file, or it ended), or a
file of this host whose process is gone (the job died without removing it). A job on
another host that died is found only by the waiter's timeout.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import stat
import time
from pathlib import Path
from typing import Optional

from ..safe_files import ReadRules, UnsafeFileError, read_bytes, replace_file

log = logging.getLogger("dynatrain")

_RULES = ReadRules("job file", 4096)


def job_file(signal_path: str | Path) -> Path:
    return Path(f"{signal_path}.job")


def announce(signal_path: str | Path) -> Optional[Path]:
    """The job polls `signal_path` from now on (rank 0, at start). Never raises: a job
    that cannot say so is only unknown to `request --wait` (a warning)."""
    body = dict(host=socket.gethostname(), pid=os.getpid(), started=time.time())
    p = job_file(signal_path)
    try:
        return replace_file(p.parent, p.name, json.dumps(body).encode(), 0o600)
    except (OSError, UnsafeFileError) as e:
        log.warning("could not announce the job at %s: %s", signal_path, e)
        return None


def withdraw(signal_path: str | Path) -> None:
    """The job ends: nobody answers requests at `signal_path` any more (rank 0)."""
    p = job_file(signal_path)
    try:
        if stat.S_ISREG(os.lstat(p).st_mode):
            os.unlink(p)
    except OSError:
        pass


def gone(signal_path: str | Path) -> Optional[str]:
    """Why no job will answer a request at `signal_path` (None: one seems to be there)."""
    p = job_file(signal_path)
    try:
        info = json.loads(read_bytes(p, _RULES).decode("utf-8"))
    except FileNotFoundError:
        return f"no job polls {signal_path} ({p} is absent: it ended or never started)"
    except (OSError, UnsafeFileError, ValueError) as e:
        return f"{p} cannot be read: {e}"
    if not isinstance(info, dict) or not isinstance(info.get("pid"), int):
        return f"{p} does not describe a job"
    if info.get("host") == socket.gethostname():
        try:
            os.kill(info["pid"], 0)
        except ProcessLookupError:
            return (f"the job that polled {signal_path} (process {info['pid']} on this host) "
                    f"is gone")
        except PermissionError:
            pass  # alive, another user's process id: not ours to judge
    return None


__all__ = ["announce", "gone", "job_file", "withdraw"]
