"""Where the tests find the real Megatron-LM (`<project root>/../shared/megatron-lm/
core_v0.16.1`, or $DYNATRAIN_MEGATRON_LM), and a patched copy of it."""
import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = Path(os.environ.get("DYNATRAIN_MEGATRON_LM")
                or ROOT.parent / "shared" / "megatron-lm" / "core_v0.16.1")


def require_snapshot() -> Path:
    if not (SNAPSHOT / "pretrain_gpt.py").is_file():
        pytest.skip(f"no Megatron-LM snapshot at {SNAPSHOT} (set DYNATRAIN_MEGATRON_LM)")
    return SNAPSHOT


def copy_tree(dst: Path, *, patched: bool) -> Path:
    """A copy of the snapshot at `dst`, patched with `dynatrain megatron-lm patch` or not."""
    from dynatrain_megatron.megatron_lm.patch_tool import patch_checkout

    shutil.copytree(require_snapshot(), dst)
    if patched:
        patch_checkout(dst)
    return dst
