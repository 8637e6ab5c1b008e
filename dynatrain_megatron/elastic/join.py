"""Join requests: a process launched after the job asks to join it, and must prove it
holds the job's secret (`elastic/job_secret.py`) without ever sending it.

The protocol runs through one store (`join_store`: a FileStore in
`--dynatrain-rendezvous-dir`, whose directory and file others may not write, or else
torchrun's agent TCPStore, which anyone who reaches its port can write). Nothing read from
it is trusted unless it carries a valid tag, from the request to the admission
(`loop/growth.py`: the joiner's `ready` is tagged, and the grown world meets under a
prefix derived from the secret).

1. The job (rank 0) publishes a fresh random **nonce** at start (`dynatrain/join/nonce`).
2. A joiner reads it, draws a fresh random request id, and claims a **slot** with
   `store.add(slots, 1)`. It writes its request into the slot: the id, its origin
   (host, pid, user) and `HMAC-SHA256(secret, [protocol, nonce, id, host, pid, user])`.
   Neither the secret nor anything it could be recovered from goes into the store.
3. At a step boundary (`Controller.poll`, already a collective) rank 0 reviews the
   slots written since the last poll: a malformed request, a missing tag (the joiner has
   no secret), a wrong tag (wrong secret, or an origin / id / nonce changed after
   signing), or an id already accepted (a replay) is **refused**; a valid request is
   **accepted**. Tags are compared in constant time. Each verdict is written back into
   the slot for the joiner, logged with the origin the request claims (never its tag), and
   broadcast to every rank with the controller's decision.
4. The joiner reads its verdict: "accepted, generation g, rank r" or "refused: reason".
   The job tags its verdicts too; a joiner that has the secret believes an "accepted"
   only when the tag checks out, so nobody else with store access can fake one.

An accepted joiner is recorded (`accepted_requests`); the job's hook then grows the world
with it at the same step boundary (`loop/growth.py`: the default process group is
re-formed with the joiner as rank r on standby, generation g). Training is never touched
by a review itself: it reads and writes only the store.
"""
from __future__ import annotations

import getpass
import json
import logging
import os
import re
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist

from ..vps.errors import DynatrainError
from .job_secret import ENV_VAR, JobSecret, load_secret
from ..safe_files import UnsafeFileError

log = logging.getLogger("dynatrain")

PROTOCOL = "dynatrain-join-v1"
PREFIX = "dynatrain/join"
NONCE_KEY = f"{PREFIX}/nonce"
SLOTS_KEY = f"{PREFIX}/slots"
MAX_REQUEST_BYTES = 2048  # a request is ~250 bytes; anything much larger is not one
MAX_REVIEWS_PER_POLL = 16  # bounds the time a step boundary spends on a flood of requests
_HEX = re.compile(r"[0-9a-f]+")
_PRINTABLE = re.compile(r"[\x21-\x7e]+")  # no spaces or control characters: log-safe


class JoinError(DynatrainError):
    """A join request that cannot be made or answered (no job in the store, timeout, ...)."""


class MalformedRequest(JoinError):
    """Bytes in a request slot that are not a well-formed request."""


def _request_key(slot: int) -> str:
    return f"{PREFIX}/request/{slot}"


def _verdict_key(slot: int) -> str:
    return f"{PREFIX}/verdict/{slot}"


def _accepted_count_key(nonce: str) -> str:
    # scoped by the nonce: a relaunched job on the same store starts with no acceptances
    return f"{PREFIX}/{nonce}/accepted"


def _accepted_key(nonce: str, k: int) -> str:
    return f"{PREFIX}/{nonce}/accepted/{k}"


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a request says it comes from. Claimed by the joiner, so bound into the tag:
    with the secret, a valid tag vouches for it; without, it is only what is logged."""

    host: str
    pid: int
    user: str

    def __post_init__(self) -> None:
        for name, value, limit in (("host", self.host, 255), ("user", self.user, 64)):
            if not isinstance(value, str) or not _PRINTABLE.fullmatch(value) \
                    or len(value) > limit:
                raise MalformedRequest(f"origin {name} must be 1-{limit} printable characters "
                                       f"without spaces, got {_shown(value)}")
        if type(self.pid) is not int or self.pid <= 0:
            raise MalformedRequest(f"origin pid must be a positive int, got {_shown(self.pid)}")

    @classmethod
    def here(cls) -> "Origin":
        return cls(socket.gethostname(), os.getpid(), getpass.getuser())

    def __str__(self) -> str:
        return f"{self.user}@{self.host} pid {self.pid}"


@dataclass(frozen=True, slots=True)
class JoinRequest:
    """What a joiner writes into its slot. `mac` is empty when it has no secret."""

    request_id: str
    origin: Origin
    mac: str = field(default="", repr=False)  # kept out of reprs and logs

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or len(self.request_id) != 32 \
                or not _HEX.fullmatch(self.request_id):
            raise MalformedRequest(f"request id must be 32 lowercase hex digits, got "
                                   f"{_shown(self.request_id)}")
        if not isinstance(self.mac, str) or (self.mac and (len(self.mac) != 64
                                                            or not _HEX.fullmatch(self.mac))):
            raise MalformedRequest("request mac must be empty or 64 lowercase hex digits")

    @classmethod
    def signed(cls, nonce: str, origin: Origin, secret: Optional[JobSecret]) -> "JoinRequest":
        """A new request with a fresh id, tagged with `secret` (untagged without one)."""
        rid = secrets.token_hex(16)
        mac = secret.tag(request_message(nonce, rid, origin)) if secret is not None else ""
        return cls(rid, origin, mac)

    @classmethod
    def parse(cls, raw: bytes) -> "JoinRequest":
        """A request from a slot's bytes; MalformedRequest (its reason) otherwise."""
        if len(raw) > MAX_REQUEST_BYTES:
            raise MalformedRequest(f"{len(raw)} bytes, more than {MAX_REQUEST_BYTES}")
        data = _json_object(raw)
        expected = {"protocol", "id", "host", "pid", "user", "mac"}
        if set(data) != expected:
            raise MalformedRequest(f"fields {sorted(map(_shown, data))[:8]}, expected "
                                   f"{sorted(expected)}")
        if data["protocol"] != PROTOCOL:
            raise MalformedRequest(f"protocol {_shown(data['protocol'])}, expected {PROTOCOL}")
        return cls(data["id"], Origin(data["host"], data["pid"], data["user"]), data["mac"])

    def to_bytes(self) -> bytes:
        return json.dumps({"protocol": PROTOCOL, "id": self.request_id, "host": self.origin.host,
                           "pid": self.origin.pid, "user": self.origin.user,
                           "mac": self.mac}).encode()


def request_message(nonce: str, request_id: str, origin: Origin) -> bytes:
    """The bytes a request's tag covers. A JSON list: unambiguous, whatever the fields hold."""
    return json.dumps([PROTOCOL, nonce, request_id, origin.host, origin.pid, origin.user],
                      separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class JoinVerdict:
    """The job's answer to one slot; broadcast to every rank with the controller's decision.
    `generation` / `rank`: where an accepted joiner will stand in the next re-formed world
    (a standby rank after the job's current processes, in acceptance order)."""

    slot: int
    request_id: Optional[str]  # None when the slot held no readable id
    origin: str  # as claimed by the request, for the log; "unknown" when unreadable
    accepted: bool
    reason: str = ""
    generation: Optional[int] = None
    rank: Optional[int] = None

    def __post_init__(self) -> None:
        if self.accepted and (self.generation is None or self.rank is None):
            raise JoinError(f"an accepted verdict needs a generation and a rank: {self!r}")

    def __str__(self) -> str:
        if self.accepted:
            return f"accepted, generation {self.generation}, rank {self.rank}"
        return f"refused: {self.reason}"

    def message(self, nonce: str) -> bytes:
        """The bytes the job's tag on this verdict covers."""
        return json.dumps([PROTOCOL + "-verdict", nonce, self.slot, self.request_id,
                           self.accepted, self.generation, self.rank],
                          separators=(",", ":")).encode()

    def to_bytes(self, mac: str) -> bytes:
        return json.dumps({"slot": self.slot, "id": self.request_id, "origin": self.origin,
                           "accepted": self.accepted, "reason": self.reason,
                           "generation": self.generation, "rank": self.rank,
                           "mac": mac}).encode()

    @classmethod
    def parse(cls, raw: bytes) -> tuple["JoinVerdict", str]:
        """(verdict, the job's tag on it) from a slot's verdict bytes."""
        try:
            d = _json_object(raw)
            return cls(int(d["slot"]), d["id"], str(d["origin"]), bool(d["accepted"]),
                       str(d["reason"]), d["generation"], d["rank"]), str(d["mac"])
        except (KeyError, TypeError, ValueError, MalformedRequest) as e:
            raise JoinError(f"unreadable verdict in the store ({type(e).__name__})") from None


class JoinReviewer:
    """Rank 0's side: publishes the nonce and reviews requests at each controller poll.

    `world_size`: the job's processes now (accepted joiners are numbered after them);
    `generation`: the world generation they would join."""

    def __init__(self, store: dist.Store, secret: JobSecret, world_size: int,
                 generation: int = 1) -> None:
        self.store = store
        self.secret = secret
        self.world_size = world_size
        self.generation = generation
        self.nonce = secrets.token_hex(16)
        self._next_slot = self._slot_count() + 1  # requests made for an earlier job are stale
        self._waiting: list[int] = []  # slots claimed but not written yet
        self._accepted_ids: set[str] = set()
        self.accepted: list[JoinVerdict] = []
        store.set(NONCE_KEY, self.nonce)
        log.info("join requests are reviewed at each poll (rendezvous store, nonce published)")

    def _slot_count(self) -> int:
        if not self.store.check([SLOTS_KEY]):
            return 0
        try:
            return int(self.store.get(SLOTS_KEY))
        except ValueError:
            return 0

    def review(self) -> tuple[JoinVerdict, ...]:
        """Review the requests written since the last call (at most MAX_REVIEWS_PER_POLL).
        Never raises: a failing store is logged and leaves training alone."""
        try:
            return self._review()
        except Exception as e:  # noqa: BLE001 - the store is outside the job's control
            log.error("join requests not reviewed this time: %s: %s", type(e).__name__, e)
            return ()

    def _review(self) -> tuple[JoinVerdict, ...]:
        count = self._slot_count()
        while self._next_slot <= count and len(self._waiting) < 4 * MAX_REVIEWS_PER_POLL:
            self._waiting.append(self._next_slot)
            self._next_slot += 1
        out = []
        for slot in list(self._waiting[:MAX_REVIEWS_PER_POLL]):
            key = _request_key(slot)
            if not self.store.check([key]):
                continue  # claimed, not written yet: next poll
            self._waiting.remove(slot)
            v = self.judge(slot, self.store.get(key))
            self.store.set(_verdict_key(slot), v.to_bytes(self.secret.tag(v.message(self.nonce))))
            if v.accepted:
                k = self.store.add(_accepted_count_key(self.nonce), 1)
                self.store.set(_accepted_key(self.nonce, k), v.to_bytes(""))
                log.info("join request %s (slot %d) from %s: %s (the world grows at this "
                         "step boundary)", v.request_id, slot, v.origin, v)
            else:
                log.warning("join request %s (slot %d) claiming origin %s: %s; the job is "
                            "untouched", v.request_id or "?", slot, v.origin, v)
            out.append(v)
        return tuple(out)

    def judge(self, slot: int, raw: bytes) -> JoinVerdict:
        """The verdict on one request's bytes (pure: no store access)."""
        try:
            req = JoinRequest.parse(raw)
        except MalformedRequest as e:
            rid, origin = _loose_fields(raw)
            return JoinVerdict(slot, rid, origin, False, f"malformed request ({e})")
        origin = str(req.origin)
        if not req.mac:
            return JoinVerdict(slot, req.request_id, origin, False,
                               "no tag: the joiner does not hold the job's secret")
        if not self.secret.verify(request_message(self.nonce, req.request_id, req.origin),
                                  req.mac):
            return JoinVerdict(slot, req.request_id, origin, False,
                               "tag does not match: wrong secret, or the request was altered "
                               "or made for another launch of the job")
        if req.request_id in self._accepted_ids:
            return JoinVerdict(slot, req.request_id, origin, False,
                               "request id already used: a replayed request")
        self._accepted_ids.add(req.request_id)
        v = JoinVerdict(slot, req.request_id, origin, True, generation=self.generation,
                        rank=self.world_size + len(self.accepted))
        self.accepted.append(v)
        return v


def open_reviewer(rendezvous_dir: Optional[str], secret_file: Optional[str] = None
                  ) -> Optional[JoinReviewer]:
    """The reviewer for this job, on rank 0 only, when it has a store (torchrun's agent
    store or a rendezvous directory) and a secret (`job_secret.load_secret`: the file, else
    the environment, else the rendezvous directory's); None elsewhere (nothing reviewed)."""
    if dist.get_rank() != 0:
        return None
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if not (rendezvous_dir or agent):
        return None
    secret = load_secret(secret_file, rendezvous_dir=rendezvous_dir)
    if secret is None:
        log.warning("join requests are not reviewed: the job has no secret "
                    "(--dynatrain-secret-file or $%s)", ENV_VAR)
        return None
    try:
        store = join_store(rendezvous_dir)
    except JoinError as e:
        log.error("join requests are not reviewed: %s", e)
        return None
    if not rendezvous_dir:
        log.info("joiners reach this job with `dynatrain join --store %s:%s`",
                 os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    return JoinReviewer(store, secret, dist.get_world_size())


def join_store(rendezvous_dir: Optional[str]) -> dist.Store:
    """The one store that join requests, verdicts, the ready step and the growth of the
    world go through, for the job's ranks and the joiner alike: the FileStore in
    `rendezvous_dir` when one is named (even under torchrun: a joiner started by its own
    torchrun has another agent store), else torchrun's agent TCPStore.

    A rendezvous directory another user owns or others may write to (not sticky), or a
    store file that is not the job user's regular file or that others may write, is
    refused (JoinError): whoever could replace the file could take over admission."""
    from .rejoin import rendezvous_store, store_file

    if not rendezvous_dir:
        return rendezvous_store(None)
    try:
        path = store_file(rendezvous_dir)
    except (UnsafeFileError, FileNotFoundError) as e:
        raise JoinError(f"rendezvous store refused: {e}") from None
    return dist.FileStore(path, -1)


def current_nonce(store: dist.Store) -> str:
    """The nonce of the job reviewing requests in `store` (JoinError when none)."""
    return wait_for(store, NONCE_KEY, 0.0, "no job reviews join requests in this store "
                     "(no nonce published)").decode("ascii", "replace")


def post_request(store: dist.Store, secret: Optional[JobSecret], origin: Optional[Origin] = None,
                 timeout: float = 60.0) -> tuple[int, JoinRequest]:
    """The joiner's side, step 2: wait for the job's nonce, claim a slot, write the request.
    Returns (slot, request)."""
    nonce = wait_for(store, NONCE_KEY, timeout,
                      "no job reviews join requests in this store (no nonce published)")
    req = JoinRequest.signed(nonce.decode(), origin or Origin.here(), secret)
    slot = int(store.add(SLOTS_KEY, 1))
    store.set(_request_key(slot), req.to_bytes())
    return slot, req


def wait_verdict(store: dist.Store, slot: int, secret: Optional[JobSecret],
                 timeout: float = 300.0) -> JoinVerdict:
    """The joiner's side, step 4: the job's verdict on `slot`. An "accepted" is believed only
    when the job's tag on it checks out with `secret` (a refusal is believed either way: it
    is the safe outcome, and a joiner with a wrong secret cannot check it)."""
    deadline = time.monotonic() + timeout
    nonce = store.get(NONCE_KEY).decode()
    while True:
        raw = wait_for(store, _verdict_key(slot), deadline - time.monotonic(),
                        f"no verdict on join request slot {slot} within {timeout:.0f} s (the "
                        f"job reviews requests at its polls; is it training?)")
        v, mac = JoinVerdict.parse(raw)
        if not v.accepted or (secret is not None and secret.verify(v.message(nonce), mac)):
            return v
        if time.monotonic() >= deadline:
            raise JoinError(f"the 'accepted' verdict on slot {slot} is not tagged with the "
                            f"job's secret: not believed")
        time.sleep(0.2)  # a forged verdict: wait for the job's own


def accepted_requests(store: dist.Store) -> tuple[JoinVerdict, ...]:
    """Every joiner the current job accepted, in acceptance order (read from the store, so
    any process that re-forms the world can include them, not only rank 0)."""
    if not store.check([NONCE_KEY]):
        return ()
    nonce = store.get(NONCE_KEY).decode()
    ck = _accepted_count_key(nonce)
    n = int(store.get(ck)) if store.check([ck]) else 0
    out = []
    for k in range(1, n + 1):
        key = _accepted_key(nonce, k)
        if store.check([key]):
            out.append(JoinVerdict.parse(store.get(key))[0])
    return tuple(out)


def wait_for(store: dist.Store, key: str, timeout: float, what: str) -> bytes:
    """The value of `key` in `store` once it is set; `JoinError(what)` after `timeout` s."""
    deadline = time.monotonic() + max(0.0, timeout)
    while not store.check([key]):
        if time.monotonic() >= deadline:
            raise JoinError(what)
        time.sleep(0.1)
    return store.get(key)


def _json_object(raw: bytes) -> dict:
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise MalformedRequest("not UTF-8 JSON") from None
    if not isinstance(data, dict):
        raise MalformedRequest(f"a JSON {type(data).__name__}, not an object")
    return data


def _shown(value: Any, limit: int = 40) -> str:
    """A value from the store, safe to put in a log line: escaped, cut short."""
    text = ascii(value)
    return text if len(text) <= limit else text[:limit] + "...'"


def _loose_fields(raw: bytes) -> tuple[Optional[str], str]:
    """The id and origin a malformed request claims, as far as they can be read (escaped for
    the log; never its tag)."""
    try:
        data = _json_object(raw[:MAX_REQUEST_BYTES])
    except MalformedRequest:
        return None, "unknown"
    rid = data.get("id")
    rid = rid if isinstance(rid, str) and len(rid) == 32 and _HEX.fullmatch(rid) else None
    parts = [_shown(data.get(k), 60) for k in ("user", "host", "pid") if k in data]
    return rid, ("claimed " + " ".join(parts)) if parts else "unknown"
