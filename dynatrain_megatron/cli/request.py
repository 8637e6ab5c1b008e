"""`dynatrain request --signal-file F [--layout tp4pp1dp1] [--world N] [--model M]
[--wait [--timeout S]] [--json]`: ask a running job to switch (atomic write-then-rename of
the signal file).

With `--model`, the layout is checked by the one validator first, and nothing is written
when it is refused. Without `--layout`, `--world N` asks the job to move to its layout
advisor's best layout of N devices.

With `--wait` the command waits for the job's answer, the record `<F>.<outcome>.<id>` named
after this request's id, and exits with what it says: 0 applied, 3 rejected, 4 failed or
not applied, 5 no answer (the job is gone, or `--timeout` passed; a request still unclaimed
then is withdrawn, so it cannot be applied later by surprise). `--json` prints the answer as
one JSON object (outcome, reason, id, request) instead of a sentence."""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from ..configs import load_model
from ..elastic import job_presence
from ..safe_files import ReadRules, UnsafeFileError, read_bytes
from ..elastic.signal_file import OUTCOMES, outcome_path, write_request
from ..vps.errors import DynatrainError
from ..vps.layout import Layout
from ..vps.validate import validate_layout
from .common import devices, subcommand


def add_parser(sub) -> None:
    p = subcommand(sub, "request", help="ask a running job to switch layout (writes its signal "
                                        "file)",
                   examples=["dynatrain request --signal-file /tmp/job/switch.json "
                             "--layout tp1pp2dp2",
                             "dynatrain request --signal-file /tmp/job/switch.json "
                             "--layout tp1pp2dp1 --world 2   # scale in to 2 ranks",
                             "dynatrain request --signal-file /tmp/job/switch.json "
                             "--world 4   # the job's advisor picks the layout of 4"])
    p.add_argument("--signal-file", required=True, metavar="FILE",
                   help="the job's --dynatrain-signal-file (its directory must exist)")
    p.add_argument("--layout", default=None, metavar="LAYOUT",
                   help="target layout, e.g. tp1pp2dp2; omitted: the job's advisor chooses "
                        "for --world")
    p.add_argument("--world", type=devices(), default=None, metavar="RANKS",
                   help="ranks of the new layout (default: the job's current number of ranks)")
    p.add_argument("--model", default=None, metavar="NAME|YAML",
                   help="a name in configs/models or a YAML path: validate the layout for it "
                        "(and --world) before writing")
    p.add_argument("--no-transformer-engine", action="store_true",
                   help="with --model: the job runs without Transformer Engine (then no CP)")
    p.add_argument("--wait", action="store_true",
                   help="wait for the job's answer; exit 0 only if the switch was applied "
                        "(3 rejected, 4 failed or not applied, 5 no answer: the job is gone)")
    p.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS",
                   help="with --wait: give up after this many seconds (default 900)")
    p.add_argument("--json", action="store_true", help="print the answer as one JSON object")
    p.set_defaults(func=run)


def _checked_path(text: str) -> str:
    """The signal file's path, refused when it cannot be a file we write by rename."""
    if not text:
        raise DynatrainError("--signal-file: empty path")
    if os.path.isdir(text):
        raise DynatrainError(f"--signal-file {text}: is a directory; give the job's "
                             f"--dynatrain-signal-file, e.g. {os.path.join(text, 'switch.json')}")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise DynatrainError(f"--signal-file {text}: directory {parent} does not exist")
    return text


def _write(path: str, layout, world):
    try:
        return write_request(path, layout, world)
    except OSError as e:
        raise DynatrainError(f"--signal-file {path}: cannot write: "
                             f"{e.strerror or e}") from None


_RECORD = ReadRules("outcome record", 1 << 20)
EXIT = {"applied": 0, "rejected": 3, "failed": 4, "not_applied": 4, "gone": 5}
POLL_S = 0.2


def run(args: argparse.Namespace) -> int:
    """Entry point of `dynatrain request`."""
    _checked_path(args.signal_file)
    if not args.timeout > 0:
        raise DynatrainError(f"--timeout must be positive, got {args.timeout}")
    if args.layout is None:
        if args.world is None or args.world < 1:
            raise DynatrainError("give --layout, or --world N (a positive device count) for "
                                 "the job to choose the layout")
        req = _write(args.signal_file, None, args.world)
        what = f"the advisor's best layout on {req.world} ranks"
    else:
        layout = Layout.parse(args.layout, args.world)  # malformed: fails here, with the reason
        if args.model:
            validate_layout(load_model(args.model), layout,
                            transformer_engine=not args.no_transformer_engine)
        req = _write(args.signal_file, args.layout, args.world)
        what = f"{req.layout}" + (f" on {req.world} ranks" if req.world else "")
    if not args.json:
        print(f"requested {what} via {args.signal_file} (request {req.id})", flush=True)
    if not args.wait:
        if args.json:
            print(json.dumps(dict(outcome="requested", id=req.id, request=_asdict(req))))
        return 0
    answer = wait_for_answer(Path(args.signal_file), req.id, args.timeout)
    answer["request"] = _asdict(req)
    print(json.dumps(answer) if args.json else f"{answer['outcome']}: {answer['reason']}")
    return EXIT[answer["outcome"]]


def _asdict(req) -> dict:
    return dict(layout=req.layout, world=req.world, origin=req.origin,
                requested_at=req.requested_at, id=req.id)


def _answer(signal: Path, request_id: str):
    for outcome in OUTCOMES:
        rec = _read_record(outcome_path(signal, outcome, request_id))
        if rec is not None:
            return dict(outcome=outcome, reason=str(rec.get("reason", "")), id=request_id)
    return None


def wait_for_answer(signal: Path, request_id: str, timeout: float) -> dict:
    """The job's record for request `request_id`: {"outcome", "reason", "id"}; outcome
    "gone" when none will come (the job is not there, or `timeout` passed)."""
    deadline = time.monotonic() + timeout
    while True:
        answer = _answer(signal, request_id)
        if answer is not None:
            return answer
        unclaimed = _is_ours(signal, request_id)
        why = job_presence.gone(signal)
        if why is None and time.monotonic() > deadline:
            why = f"no answer within {timeout:g} s"
        if why is not None:
            answer = _answer(signal, request_id)  # it may have come just now
            if answer is not None:
                return answer
            if unclaimed and _is_ours(signal, request_id):
                try:
                    os.unlink(signal)  # withdrawn: never applied later by surprise
                    why += "; the request was withdrawn"
                except OSError:
                    pass
            return dict(outcome="gone", reason=why, id=request_id)
        time.sleep(POLL_S)


def _read_record(path: Path):
    """An outcome record (a regular file of ours, read without following links), or None
    (absent, unsafe, or not whole yet)."""
    try:
        rec = json.loads(read_bytes(path, _RECORD).decode("utf-8"))
    except (OSError, UnsafeFileError, UnicodeDecodeError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def _is_ours(signal: Path, request_id: str) -> bool:
    """Whether the signal path still holds this request (not yet claimed by the job)."""
    rec = _read_record(signal)
    return rec is not None and rec.get("id") == request_id
