"""`dynatrain join --rendezvous-dir DIR [--secret-file F]`: ask a running job to let this
process join it (elastic/join.py), wait for the verdict, print it.

Exit status: 0 accepted, 1 refused, 2 no verdict (no job in the store, timeout) or an
unusable secret. Without a secret (no --secret-file, no $DYNATRAIN_JOB_SECRET, no
`job_secret` file in the rendezvous directory) the request is still sent, untagged: the
job refuses it and logs where it came from.
"""
from __future__ import annotations

import argparse
import datetime
import os

from ..vps.errors import DynatrainError
from .common import finite_float, subcommand


def add_parser(sub) -> None:
    p = subcommand(sub, "join", help="ask a running job to let this process join it (only "
                                     "asks; exit 0 accepted, 1 refused)",
                   examples=["dynatrain join --rendezvous-dir /tmp/job/rdv --secret-file "
                             "/tmp/job/secret",
                             "dynatrain join --store node0:29500 --timeout 60"])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--rendezvous-dir", metavar="DIR",
                       help="the job's --dynatrain-rendezvous-dir")
    where.add_argument("--store", metavar="HOST:PORT",
                       help="the job's TCP store (torchrun's agent store) instead")
    p.add_argument("--secret-file", default=None, metavar="FILE",
                   help="the job's secret (mode 0600); default $DYNATRAIN_JOB_SECRET, else "
                        "job_secret in the rendezvous directory")
    p.add_argument("--timeout", type=finite_float(0.0), default=300.0, metavar="SECONDS",
                   help="seconds to wait for the job's nonce and then for its verdict (300)")
    p.set_defaults(func=run)


def parse_store(text: str) -> tuple[str, int]:
    """`HOST:PORT` -> (host, port), a TCP port in 1..65535."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise DynatrainError(f"--store {text!r}: expected HOST:PORT, e.g. node0:29500")
    try:
        num = int(port)
    except ValueError:
        raise DynatrainError(f"--store {text!r}: port {port!r} is not a number") from None
    if not 1 <= num <= 65535:
        raise DynatrainError(f"--store {text!r}: port {num} is outside 1..65535")
    return host, num


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from ..elastic.join import JoinError, post_request, wait_verdict
    from ..elastic.job_secret import load_secret

    secret = load_secret(args.secret_file, rendezvous_dir=args.rendezvous_dir)
    if args.store:
        host, port = parse_store(args.store)
        try:
            store = dist.TCPStore(host, port, is_master=False,
                                  timeout=datetime.timedelta(seconds=args.timeout))
        except (RuntimeError, OSError) as e:  # torch's DistStoreError is a RuntimeError
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DynatrainError(f"--store {args.store}: cannot reach the job's store: "
                                 f"{first}") from None
    else:
        if not os.path.isdir(args.rendezvous_dir):  # else FileStore fails only after 300 s
            raise JoinError(f"rendezvous directory {args.rendezvous_dir} does not exist (the "
                            f"job creates it: is --dynatrain-rendezvous-dir the same?)")
        from ..elastic.join import join_store

        store = join_store(args.rendezvous_dir)  # the job's FileStore, checked as the job does
    if secret is None:
        print("no job secret found: the request goes untagged and will be refused")
    slot, req = post_request(store, secret, timeout=args.timeout)
    print(f"join request {req.request_id} from {req.origin} posted (slot {slot}); waiting for "
          f"the job's verdict")
    verdict = wait_verdict(store, slot, secret, timeout=args.timeout)
    print(verdict)
    return 0 if verdict.accepted else 1
