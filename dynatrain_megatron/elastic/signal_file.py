"""Switch requests through a signal file.

A request is a small JSON object `{"layout": "tp4pp1dp1", "world": 4, "origin": ...}`;
`{"layout": null, "world": 2}` asks for the job's choice of layout on 2 ranks (the
layout advisor's best, integration/auto_layout.py)
written atomically (write to a temporary file in the same directory, fsync, rename), so the
job never reads half a request. After it is handled the file is moved aside with its outcome
(`<file>.applied.<n>` / `<file>.rejected.<n>`, with the reason inside), which tells the
requester what happened and leaves an audit trail.

A file that is world-writable or owned by another user is refused: it could redirect a
multi-week run.
"""
from __future__ import annotations

import getpass
import json
import os
import socket
import stat
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from ..vps.errors import DynatrainError
from .private_file import write_private


class RequestError(DynatrainError):
    """A signal file that cannot be turned into a request (corrupt, unsafe, ...)."""


@dataclass(frozen=True, slots=True)
class SwitchRequest:
    layout: Optional[str]  # None: the job chooses (the advisor's best for `world`)
    world: Optional[int] = None
    origin: str = ""
    requested_at: float = 0.0

    def __post_init__(self) -> None:
        if self.layout is None and self.world is None:
            raise RequestError("request needs a 'layout', or a 'world' for the job to choose "
                               "the layout of")
        if self.layout is not None and (not isinstance(self.layout, str)
                                        or not self.layout.strip()):
            raise RequestError(f"request needs a non-empty 'layout' string, got {self.layout!r}")
        if self.world is not None and (not isinstance(self.world, int) or self.world < 1):
            raise RequestError(f"request 'world' must be a positive int, got {self.world!r}")


def write_request(path: str | Path, layout: Optional[str],
                  world: Optional[int] = None) -> SwitchRequest:
    """Atomically write a request (what `dynatrain request` does)."""
    path = Path(path)
    req = SwitchRequest(layout=layout, world=world,
                        origin=f"{getpass.getuser()}@{socket.gethostname()}:{os.getpid()}",
                        requested_at=time.time())
    write_private(path, json.dumps(asdict(req)).encode())
    return req


def read_request(path: str | Path) -> Optional[SwitchRequest]:
    """The pending request, None when there is none; RequestError when it is unusable."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    if st.st_mode & stat.S_IWOTH:
        raise RequestError(f"signal file {path} is world-writable: refused (it could redirect "
                           f"the job); write it with `dynatrain request`")
    if st.st_uid != os.getuid():
        raise RequestError(f"signal file {path} is owned by uid {st.st_uid}, not the job's "
                           f"uid {os.getuid()}: refused")
    text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"signal file {path} is not valid JSON ({e.msg} at char {e.pos}): "
                           f"{text[:80]!r}") from None
    if not isinstance(data, dict):
        raise RequestError(f"signal file {path} must hold a JSON object, got {type(data).__name__}")
    unknown = set(data) - {"layout", "world", "origin", "requested_at"}
    if unknown:
        raise RequestError(f"signal file {path} has unknown fields {sorted(unknown)}")
    if "layout" not in data and "world" not in data:
        raise RequestError(f"signal file {path} has no 'layout' (nor a 'world' to choose one "
                           f"for)")
    data.setdefault("layout", None)
    return SwitchRequest(**data)


def _next_name(path: Path, outcome: str) -> Path:
    n = 0
    while True:
        dst = path.with_name(f"{path.name}.{outcome}.{n}")
        if not dst.exists():
            return dst
        n += 1


def claim(path: str | Path) -> Optional[Path]:
    """Take the pending request out of the signal path at once, as `<path>.accepted.<n>`
    (an atomic rename), and return where it went; None when there is none. A request
    written while this one is checked or switched to is then a new file, read at the next
    poll: before, the outcome of the running switch was filed under the newer request,
    which was lost (seen when a request arrived during a background preparation)."""
    path = Path(path)
    dst = _next_name(path, "accepted")
    try:
        os.replace(path, dst)
    except FileNotFoundError:
        return None
    return dst


def archive(path: str | Path, outcome: str, reason: str = "",
            request_file: str | Path | None = None) -> Path:
    """File the handled request as `<path>.<outcome>.<n>` with the reason. The request is
    read from `request_file` (where `claim` put it), by default from `path` itself."""
    path = Path(path)
    src = Path(request_file) if request_file is not None else path
    dst = _next_name(path, outcome)
    try:
        body = src.read_text()
    except OSError:
        body = ""
    try:
        os.replace(src, dst)
    except FileNotFoundError:
        pass
    with open(dst, "w") as f:
        f.write(json.dumps({"outcome": outcome, "reason": reason, "request": body}))
    return dst
