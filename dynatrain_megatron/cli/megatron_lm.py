"""`dynatrain megatron-lm patch DIR`: patch a Megatron-LM checkout for `--dynatrain`
(the release is recognised from its files; a second run changes nothing)."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..megatron_lm.patch_tool import RELEASES, patch_checkout
from ..vps.errors import DynatrainError
from .common import subcommand


def add_parser(sub) -> None:
    p = subcommand(sub, "megatron-lm", help="Megatron-LM integration: patch a checkout",
                   examples=["dynatrain megatron-lm patch ~/Megatron-LM"])
    what = p.add_subparsers(dest="megatron_lm_command", required=True, metavar="ACTION")
    patch = subcommand(what, "patch",
                       help="apply the dynatrain patch matching the checkout's release ("
                            + ", ".join(r.name for r in RELEASES) + "); a second run changes "
                                                                    "nothing",
                       examples=["dynatrain megatron-lm patch ~/Megatron-LM"])
    patch.add_argument("dir", metavar="DIR",
                       help="the Megatron-LM checkout (the directory holding pretrain_gpt.py)")
    patch.set_defaults(func=run_patch)


def run_patch(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    if not root.is_dir():
        raise DynatrainError(f"{root}: not a directory (give the Megatron-LM checkout)")
    try:
        state, written = patch_checkout(root)
    except UnicodeDecodeError as e:
        raise DynatrainError(f"{root}: a file of the checkout is not UTF-8 text ({e.reason} "
                             f"at byte {e.start}): not a Megatron-LM release we know") from None
    except OSError as e:
        raise DynatrainError(f"{root}: cannot patch: {e.strerror or e}"
                             + (f" ({e.filename})" if e.filename else "")) from None
    if state.patched:
        print(f"{root}: Megatron-LM {state.release.name}, already patched; nothing changed")
    else:
        print(f"{root}: Megatron-LM {state.release.name}, patched "
              f"({', '.join(written)}) with {state.release.patch_path}")
    return 0
