"""Which Megatron-LM release the tests run on, where its snapshot is, and working copies of it.

`DYNATRAIN_MEGATRON_LM` chooses: a release name (`core_v0.19.0`, `core_v0.16.1`: the
snapshot in `<project root>/../shared/megatron-lm/<name>`) or a checkout's directory;
unset, the default release (`patch_tool.default_release()`, the one the whole suite passes
on). `make test` runs the suite in full on it, then the tests marked `every_release` on the
other supported releases (docs/releases.md: the test matrix).

A working copy (`copy_tree`, one per session and kind) is made by
`megatron_lm.checkout.working_copy`: a checkout with its own `megatron/core` gets its
dataset helper built once (cached) and copied in.
"""
import os
from pathlib import Path

import pytest

from dynatrain_megatron.megatron_lm.patch_tool import default_release

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "megatron-lm"


def _snapshot(choice: str) -> Path:
    if "/" not in choice and not Path(choice).exists():
        return SHARED / choice  # a release name
    return Path(choice)


SNAPSHOT = _snapshot(os.environ.get("DYNATRAIN_MEGATRON_LM") or default_release().name)


def require_snapshot() -> Path:
    if not (SNAPSHOT / "pretrain_gpt.py").is_file():
        pytest.skip(f"no Megatron-LM snapshot at {SNAPSHOT} (set DYNATRAIN_MEGATRON_LM)")
    return SNAPSHOT


def release_name() -> str:
    """The release of the snapshot the tests run on (by fingerprint)."""
    from dynatrain_megatron.megatron_lm.patch_tool import identify

    return identify(require_snapshot()).release.name


def copy_tree(dst: Path, *, patched: bool) -> Path:
    """A working copy of the snapshot, patched with our patch or not: the session's own
    (made once, under `DYNATRAIN_TEST_TREES`, conftest.py) where the session keeps them,
    else a new one at `dst`. The jobs write nothing into their tree (checkpoints, data and
    logs go where their flags say), so every module's jobs may share one; and jobs of one
    tree with the same environment share a preloaded launcher (`megatron_lm_runs`)."""
    from dynatrain_megatron.megatron_lm.checkout import working_copy

    shared = os.environ.get("DYNATRAIN_TEST_TREES")
    if not shared:
        return working_copy(require_snapshot(), dst, patched=patched)
    tree = Path(shared) / f"{SNAPSHOT.name}-{'patched' if patched else 'unpatched'}"
    if not tree.is_dir():
        working_copy(require_snapshot(), tree, patched=patched)
    return tree
