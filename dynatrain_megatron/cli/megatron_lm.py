"""`dynatrain megatron-lm patch DIR`: patch a Megatron-LM checkout for `--dynatrain`
(the release is recognised from its files; a second run changes nothing)."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..megatron_lm.patch_tool import RELEASES, patch_checkout


def add_parser(sub) -> None:
    p = sub.add_parser("megatron-lm", help="Megatron-LM integration: patch a checkout")
    what = p.add_subparsers(dest="megatron_lm_command", required=True)
    patch = what.add_parser("patch", help="apply the dynatrain patch matching the checkout's "
                                          "release (" + ", ".join(r.name for r in RELEASES) + ")")
    patch.add_argument("dir", help="the Megatron-LM checkout (holds pretrain_gpt.py)")
    patch.set_defaults(func=run_patch)


def run_patch(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    state, written = patch_checkout(root)
    if state.patched:
        print(f"{root}: Megatron-LM {state.release.name}, already patched; nothing changed")
    else:
        print(f"{root}: Megatron-LM {state.release.name}, patched "
              f"({', '.join(written)}) with {state.release.patch_path}")
    return 0
