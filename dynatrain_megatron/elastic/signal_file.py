"""Switch requests through a signal file, read as hostile input.

A request is a small JSON object `{"layout": "tp4pp1dp1", "world": 4, "origin": ...,
"id": ...}`; `id` (optional, `[A-Za-z0-9_-]`, at most 64 characters) names the request's
outcome record, `<path>.<outcome>.<id>`, which `dynatrain request --wait` waits for.
Writers must put it in place with a rename (write a temporary file in the same directory,
fsync, rename), as `dynatrain request` does: the job claims whatever sits at the path at
its poll, so a file written in place may be read half-written (it is then rejected, never
half-obeyed).
A request may name only a world size, `{"layout": null, "world": 2}`: the job then
chooses the layout of 2 ranks itself (the layout advisor's best, `loop/auto_layout.py`).

The job handles the path as input from anyone who can write to its directory:

* the signal directory must be the job user's (or root's) and writable by nobody else,
  unless it is sticky (`/tmp`-like), where only the file's owner can move it;
* the request is claimed first, by renaming it within the directory to
  `<path>.accepted.<n>` (a rename moves a link or a FIFO itself, never its target); a
  request written from then on is a new file at the path, read at the next poll;
* the claimed name is opened with `O_NOFOLLOW | O_NONBLOCK` and checked on the open
  descriptor (`fstat`): a regular file with one name (a hard link could be another file's),
  owned by the job's user, writable by nobody else, at most `MAX_REQUEST_BYTES`; it is
  read from that descriptor only;
* the content must match a strict schema (known keys only, exact types, no duplicate keys,
  an ASCII layout string, bounded numbers);
* the outcome is filed in a fresh file `<path>.<outcome>.<id>` (the request's id; one
  without an id, or whose id's record exists already: `<path>.<outcome>.<n>`), mode 0600, holding the
  reason and the request (a bounded excerpt where it is not a valid request): written
  whole under a temporary name, then renamed to a name that was free (never written
  through an existing name; `safe_files.create_numbered`). A record that cannot be
  written (a full disk) is logged with the outcome and its reason, and the job goes on.
  A claimed regular file is then removed (the rest of a write still in progress goes to
  that removed file, never into the record); anything else claimed (a link, a FIFO, a
  directory) is kept beside its record as `<record>.original`.

`write_request` (what `dynatrain request` runs) never replaces a request the job has not
taken yet: a second request while one is pending is refused, naming the pending one.

Errors quote at most `EXCERPT_BYTES` of a bad request, so a huge file never reaches the
log or the audit trail whole.
"""
from __future__ import annotations

import getpass
import json
import logging
import math
import os
import re
import secrets
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from ..vps.errors import DynatrainError
from ..safe_files import (ReadRules, UnsafeFileError, create_new, create_numbered,
                         directory_errors, open_checked, read_fd)

log = logging.getLogger("dynatrain")


class RequestError(DynatrainError):
    """A signal file that cannot be turned into a request (corrupt, unsafe, ...)."""


MAX_REQUEST_BYTES = 64 * 1024
EXCERPT_BYTES = 120
MAX_LAYOUT_CHARS = 64
MAX_ORIGIN_CHARS = 256
MAX_WORLD = 1 << 20
_KEYS = ("layout", "world", "origin", "requested_at", "id")
MAX_ID_CHARS = 64
_ID = re.compile(r"[A-Za-z0-9_-]{1,%d}" % MAX_ID_CHARS, re.ASCII)
OUTCOMES = ("applied", "rejected", "failed", "not_applied")
# the job's user's regular file, one name, nobody else may write it (module docstring)
_RULES = ReadRules("signal file", MAX_REQUEST_BYTES, single_link=True)


def excerpt(data: bytes | str, limit: int = EXCERPT_BYTES) -> str:
    """A bounded, printable quote of (possibly hostile) content for logs and reasons."""
    more = len(data) > limit
    return repr(data[:limit]) + (f" ... ({len(data)} in all)" if more else "")


@dataclass(frozen=True, slots=True)
class SwitchRequest:
    """One request, checked field by field (exact types: a bool is not a world size)."""

    layout: Optional[str]  # None: the job chooses (the advisor's best for `world`)
    world: Optional[int] = None
    origin: str = ""
    requested_at: float = 0.0
    id: Optional[str] = None  # names the outcome record (`dynatrain request --wait`)

    def __post_init__(self) -> None:
        lay = self.layout
        if lay is None and self.world is None:
            raise RequestError("request needs a 'layout', or a 'world' for the job to choose "
                               "the layout of")
        if lay is not None and (type(lay) is not str or not lay.strip()):
            raise RequestError(f"request needs a non-empty 'layout' string, got "
                               f"{excerpt(repr(lay))}")
        if lay is not None and (len(lay) > MAX_LAYOUT_CHARS or not lay.isascii()
                                or not lay.isprintable()):
            raise RequestError(f"request 'layout' must be at most {MAX_LAYOUT_CHARS} printable "
                               f"ASCII characters, got {excerpt(lay)}")
        w = self.world
        if w is not None and (type(w) is not int or not 1 <= w <= MAX_WORLD):
            raise RequestError(f"request 'world' must be a positive int up to {MAX_WORLD}, got "
                               f"{excerpt(repr(w))} ({type(w).__name__})")
        if type(self.origin) is not str or len(self.origin) > MAX_ORIGIN_CHARS:
            raise RequestError(f"request 'origin' must be a string of at most "
                               f"{MAX_ORIGIN_CHARS} characters, got {excerpt(repr(self.origin))}")
        t = self.requested_at
        if type(t) not in (int, float) or not math.isfinite(t):
            raise RequestError(f"request 'requested_at' must be a finite number, got "
                               f"{excerpt(repr(t))}")
        if self.id is not None and (type(self.id) is not str or not _ID.fullmatch(self.id)):
            raise RequestError(f"request 'id' must be 1 to {MAX_ID_CHARS} characters of "
                               f"[A-Za-z0-9_-], got {excerpt(repr(self.id))}")

    @classmethod
    def from_json(cls, data: bytes, where: str = "request") -> "SwitchRequest":
        """Parse and check the bytes of a signal file (any failure: RequestError)."""
        if len(data) > MAX_REQUEST_BYTES:
            raise RequestError(f"{where} is {len(data)} bytes, over the limit of "
                               f"{MAX_REQUEST_BYTES}: {excerpt(data)}")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"{where} is not UTF-8 ({e.reason} at byte {e.start}): "
                               f"{excerpt(data)}") from None
        try:
            obj = json.loads(text, object_pairs_hook=_no_duplicates,
                             parse_constant=_no_constant, parse_int=_bounded_int)
        except json.JSONDecodeError as e:
            raise RequestError(f"{where} is not valid JSON ({e.msg} at char {e.pos}): "
                               f"{excerpt(text)}") from None
        except RecursionError:
            raise RequestError(f"{where} is nested too deeply: {excerpt(text)}") from None
        except ValueError as e:  # raised by the hooks below
            raise RequestError(f"{where}: {e}") from None
        if not isinstance(obj, dict):
            raise RequestError(f"{where} must hold a JSON object, got {type(obj).__name__}: "
                               f"{excerpt(text)}")
        unknown = [k for k in obj if k not in _KEYS]
        if unknown:
            raise RequestError(f"{where} has unknown fields "
                               f"{excerpt(', '.join(map(repr, unknown)))} (known: {_KEYS})")
        if "layout" not in obj and "world" not in obj:
            raise RequestError(f"{where} has no 'layout' (nor a 'world' to choose one for)")
        return cls(**{"layout": None, **obj})


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {excerpt(k)} given twice")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a request may hold")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > 18:
        raise ValueError(f"integer with {len(text)} digits: {excerpt(text)}")
    return int(text)


# ------------------------------------------------------------------ writing
def write_request(path: str | Path, layout: Optional[str],
                  world: Optional[int] = None) -> SwitchRequest:
    """Put a request in place whole (what `dynatrain request` does): a temporary file in
    the same (checked) directory, mode 0600, renamed to `path` only if nothing is there.
    RequestError when a request the job has not taken yet is pending at `path` (it would
    be lost: the job reads one request per poll)."""
    path = Path(path)
    req = SwitchRequest(layout=layout, world=world,
                        origin=f"{getpass.getuser()}@{socket.gethostname()}:{os.getpid()}"[
                            :MAX_ORIGIN_CHARS],
                        requested_at=time.time(),
                        id=f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}"
                           f"-{secrets.token_hex(4)}")
    try:
        placed = create_new(path.parent, path.name, json.dumps(asdict(req)).encode(), 0o600)
    except (UnsafeFileError, OSError) as e:  # an unsafe directory, no permission, no space
        raise RequestError(f"signal file {path} not written: {e}") from None
    if not placed:
        raise RequestError(f"a request is already pending at {path} ({_pending(path)}): not "
                           f"replaced; the job takes it at its next poll (request again "
                           f"after that, or remove the file to withdraw it)")
    return req


def _pending(path: Path) -> str:
    """The request waiting at `path`, in words, for the refusal of another one."""
    try:
        req = read_request(path)
    except (RequestError, OSError) as e:
        return f"unreadable: {excerpt(str(e), 200)}"
    if req is None:
        return "taken meanwhile"
    when = time.strftime("%H:%M:%S", time.localtime(req.requested_at))
    return (f"layout {req.layout or 'chosen by the job'}"
            + (f" on {req.world} ranks" if req.world else "")
            + f", from {req.origin or '?'} at {when}")


# ------------------------------------------------------------------ reading
def _open_checked(path: Path) -> tuple[int, os.stat_result]:
    """A checked read-only descriptor of `path` (`safe_files.open_checked` with the rules
    of a signal file); FileNotFoundError when absent, RequestError when unsafe."""
    try:
        return open_checked(path, _RULES)
    except UnsafeFileError as e:
        raise RequestError(str(e)) from None


def read_request(path: str | Path) -> Optional[SwitchRequest]:
    """The request at `path`, None when there is none; RequestError when it is unsafe or
    unusable (the directory, the file or its content; see the module docstring)."""
    path = Path(path)
    if not os.path.lexists(path):
        return None
    errs = directory_errors(path.parent)
    if errs:
        raise RequestError(f"signal file {path} refused: " + "; ".join(errs))
    try:
        fd, _ = _open_checked(path)
    except FileNotFoundError:
        return None
    try:
        data = read_fd(fd, MAX_REQUEST_BYTES)
    finally:
        os.close(fd)
    return SwitchRequest.from_json(data, where=f"signal file {path}")


# ------------------------------------------------------------------ claiming and filing
def _numbered(path: Path, outcome: str, n: int) -> Path:
    return path.with_name(f"{path.name}.{outcome}.{n}")


def claim(path: str | Path) -> Optional[Path]:
    """Take whatever sits at the signal path out of it at once, renamed within the
    directory to `<path>.accepted.<n>` (a link or FIFO is moved, never followed), and
    return where it went; None when there is none. RequestError when it cannot be moved
    (a file of another user in a sticky directory)."""
    path = Path(path)
    for n in range(1 << 20):
        dst = _numbered(path, "accepted", n)
        if os.path.lexists(dst):
            continue
        try:
            os.rename(path, dst)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise RequestError(f"signal file {path} cannot be claimed ({e.strerror}): "
                               f"refused") from None
        return dst
    raise RequestError(f"no free name to claim {path}")


def request_id_in(data: bytes) -> Optional[str]:
    """The id of a request's bytes when they hold a well-formed one (even if the rest of
    the request is refused), else None: its outcome record is then named after it."""
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    rid = obj.get("id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) and _ID.fullmatch(rid) else None


def outcome_path(path: str | Path, outcome: str, request_id: str) -> Path:
    """Where the outcome record of the request with `request_id` is filed."""
    return Path(path).with_name(f"{Path(path).name}.{outcome}.{request_id}")


def _create_record(path: Path, outcome: str, data: bytes,
                   request_id: Optional[str] = None) -> Path:
    """A fresh `<path>.<outcome>.<id>` (the id taken: `.<n>`; mode 0600) holding `data`,
    put in place whole."""
    if request_id is not None:
        dst = outcome_path(path, outcome, request_id)
        if create_new(path.parent, dst.name, data, 0o600):
            return dst
    return create_numbered(path.parent, f"{path.name}.{outcome}", data, 0o600)


def archive(path: str | Path, outcome: str, reason: str = "",
            request_file: str | Path | None = None) -> Optional[Path]:
    """File the handled request as a new `<path>.<outcome>.<id>` holding the outcome, the
    reason and the request. The request is read (safely, bounded) from `request_file`
    (where `claim` put it), by default from `path` itself; see the module docstring for
    what becomes of it. Never raises: a record that cannot be written is logged with the
    outcome and its reason (None is returned) and the request is left where it was."""
    path = Path(path)
    src = Path(request_file) if request_file is not None else path
    body, regular, rid = "", False, None
    try:
        fd, _ = _open_checked(src)
        try:
            data = read_fd(fd, MAX_REQUEST_BYTES)
        finally:
            os.close(fd)
        regular = True
        body = (data.decode("utf-8", errors="replace") if len(data) <= MAX_REQUEST_BYTES
                else excerpt(data, 4096))
        rid = request_id_in(data) if len(data) <= MAX_REQUEST_BYTES else None
    except (OSError, RequestError):
        pass
    record = {"outcome": outcome, "reason": reason[:4 * MAX_REQUEST_BYTES], "request": body,
              "id": rid, "filed_at": time.time()}
    try:
        dst = _create_record(path, outcome, json.dumps(record).encode(), rid)
    except Exception as e:  # noqa: BLE001 - filing must never end training nor hide why
        log.error("could not file the request %s as %s (%s: %s); it was %s because: %s",
                  src, outcome, type(e).__name__, e, outcome, excerpt(reason, 400))
        return None
    try:
        if regular:
            os.unlink(src)
        elif os.path.lexists(src):
            os.rename(src, dst.with_name(dst.name + ".original"))
    except OSError:
        pass  # left where it was claimed; the record says what happened
    return dst
