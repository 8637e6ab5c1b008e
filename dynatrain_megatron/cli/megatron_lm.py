"""`dynatrain megatron-lm patch [--revert] DIR`: patch a Megatron-LM checkout for
`--dynatrain`, or give a patched one its release's files back (the release is recognised
from its files; a second run changes nothing; every file is written or none). A checkout
with its own `megatron/core` also gets megatron-core's dataset helper built, which
Megatron-LM would otherwise build with `make` at start-up and the CPU runtime does not."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..megatron_lm.checkout import ensure_dataset_helper
from ..megatron_lm.patch_tool import RELEASES, patch_checkout, revert_checkout
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
                       examples=["dynatrain megatron-lm patch ~/Megatron-LM",
                                 "dynatrain megatron-lm patch --revert ~/Megatron-LM"])
    patch.add_argument("dir", metavar="DIR",
                       help="the Megatron-LM checkout (the directory holding pretrain_gpt.py)")
    patch.add_argument("--revert", action="store_true",
                       help="give a patched checkout its release's files back")
    patch.set_defaults(func=run_patch)


def run_patch(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    if not root.is_dir():
        raise DynatrainError(f"{root}: not a directory (give the Megatron-LM checkout)")
    try:
        result = (revert_checkout if args.revert else patch_checkout)(root)
    except UnicodeDecodeError as e:
        raise DynatrainError(f"{root}: a file of the checkout is not UTF-8 text ({e.reason} "
                             f"at byte {e.start}): not a Megatron-LM release we know") from None
    except OSError as e:
        raise DynatrainError(f"{root}: cannot patch: {e.strerror or e}"
                             + (f" ({e.filename})" if e.filename else "")) from None
    name = result.state.release.name
    if not args.revert:
        # Megatron-LM builds it at start-up with `make`; the CPU runtime only checks it
        # imports (compat/megatron_lm.py), so a checkout with its own megatron/core gets it here
        helper = ensure_dataset_helper(root)
        if helper is not None:
            print(f"{root}: built megatron-core's dataset helper "
                  f"({helper.relative_to(root)})")
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
