"""`dynatrain megatron-lm patch [--revert] DIR`: patch a Megatron-LM checkout for
`--dynatrain`, or give a patched one its release's files back (the release is recognised
from its files; a second run changes nothing; every file is written or none)."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..megatron_lm.patch_tool import RELEASES, patch_checkout, revert_checkout


def add_parser(sub) -> None:
    p = sub.add_parser("megatron-lm", help="Megatron-LM integration: patch a checkout")
    what = p.add_subparsers(dest="megatron_lm_command", required=True)
    patch = what.add_parser("patch", help="apply the dynatrain patch matching the checkout's "
                                          "release (" + ", ".join(r.name for r in RELEASES) + ")")
    patch.add_argument("dir", help="the Megatron-LM checkout (holds pretrain_gpt.py)")
    patch.add_argument("--revert", action="store_true",
                       help="give a patched checkout its release's files back")
    patch.set_defaults(func=run_patch)


def run_patch(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    result = (revert_checkout if args.revert else patch_checkout)(root)
    name = result.state.release.name
    if not result.written:
        state = "already patched" if result.state.patched else "not patched"
        print(f"{root}: Megatron-LM {name}, {state}; nothing changed")
        return 0
    verb = "reverted" if args.revert else "patched"
    print(f"{root}: Megatron-LM {name}, {verb} ({', '.join(result.written)}) with "
          f"{result.state.release.patch_path}")
    for rel in result.unlinked:
        print(f"{root}: {rel} had other hard links; they keep the file's earlier text (a new "
              f"file was written in its place)")
    return 0
