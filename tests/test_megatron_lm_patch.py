"""The Megatron-LM patch and `dynatrain megatron-lm patch DIR` on the real snapshot
(`../shared/megatron-lm/core_v0.16.1`, or $DYNATRAIN_MEGATRON_LM): `git apply --check`
accepts the patch, the command writes exactly what `git apply` writes, a second run
changes nothing, other versions are refused by name. No process is started."""
import shutil
import subprocess
from pathlib import Path

import pytest

from dynatrain_megatron.cli import main
from dynatrain_megatron.megatron_lm import patch_tool as mp
from megatron_lm_tree import SNAPSHOT, require_snapshot

FILES = ("megatron/training/training.py", "pretrain_gpt.py")


@pytest.fixture
def tree(tmp_path):
    require_snapshot()
    dst = tmp_path / "Megatron-LM"
    shutil.copytree(SNAPSHOT, dst)
    return dst


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=cwd,
                          capture_output=True, text=True)


def _bytes(root: Path) -> dict[str, bytes]:
    return {f: (root / f).read_bytes() for f in FILES}


def test_git_apply_check_and_the_command_agree(tree, tmp_path, capsys):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    ref = tmp_path / "by-git"
    shutil.copytree(tree, ref)
    assert _git(ref, "init", "-q").returncode == 0
    _git(ref, "add", "-A")
    assert _git(ref, "commit", "-qm", "snapshot").returncode == 0
    patch = mp.RELEASES[0].patch_path
    check = _git(ref, "apply", "--check", "-v", str(patch))
    assert check.returncode == 0, check.stderr
    assert _git(ref, "apply", str(patch)).returncode == 0

    before = _bytes(tree)
    assert main(["megatron-lm", "patch", str(tree)]) == 0
    assert "core_v0.16.1, patched" in capsys.readouterr().out
    after = _bytes(tree)
    assert after == _bytes(ref)  # byte for byte what git apply makes
    assert all(after[f] != before[f] for f in FILES)
    # the patched script prepares the runtime before any megatron import
    head = (tree / "pretrain_gpt.py").read_text().split("from megatron", 1)[0]
    assert "prepare_megatron_lm()" in head

    # a second run: already patched, nothing written
    assert main(["megatron-lm", "patch", str(tree)]) == 0
    assert "already patched; nothing changed" in capsys.readouterr().out
    assert _bytes(tree) == after


def test_unknown_versions_are_refused_by_name(tree, capsys):
    # a local edit of a file the patch touches: neither the release nor the patched release
    text = (tree / "megatron/training/training.py").read_text()
    (tree / "megatron/training/training.py").write_text(text.replace("def train(", "def train (", 1))
    info = tree / "megatron" / "core" / "package_info.py"
    info.parent.mkdir(parents=True)
    info.write_text('MAJOR = 0\nMINOR = 18\nPATCH = 0\nPRE_RELEASE = "rc0"\n')
    before = _bytes(tree)
    assert main(["megatron-lm", "patch", str(tree)]) == 2
    err = capsys.readouterr().err
    assert "not supported" in err and "megatron-core 0.18.0rc0" in err
    assert "supported releases: core_v0.16.1" in err
    assert _bytes(tree) == before  # refused: nothing written
    with pytest.raises(mp.MegatronLMVersionError, match="not a Megatron-LM checkout"):
        mp.identify(tree / "megatron")


def test_a_patch_that_does_not_fit_writes_nothing(tree, monkeypatch, tmp_path):
    # a damaged patch file: the second file's hunk no longer matches; the first file must
    # not be written either
    text = mp.RELEASES[0].patch_path.read_text()
    bad = tmp_path / "patches" / "megatron-lm-core_v0.16.1"
    bad.mkdir(parents=True)
    damaged = text.replace("         store=store,\n", "         store=None,\n")
    assert damaged != text
    (bad / "dynatrain.patch").write_text(damaged)
    monkeypatch.setattr(mp, "PATCHES_DIR", tmp_path / "patches")
    before = _bytes(tree)
    with pytest.raises(mp.DynatrainError, match="does not apply"):
        mp.patch_checkout(tree)
    assert _bytes(tree) == before


def test_reverse_of_apply_is_identity():
    hunks = [mp.Hunk(2, ("b\n", "c\n"), ("b\n", "x\n", "c\n")), mp.Hunk(5, ("e\n",), ("E\n",))]
    text = "a\nb\nc\nd\ne\nf\n"
    new = mp.apply_hunks(text, hunks)
    assert new == "a\nb\nx\nc\nd\nE\nf\n"
    assert mp.apply_hunks(new, hunks, reverse=True) == text
    assert mp.apply_hunks(text, hunks, reverse=True) is None  # context differs


def test_missing_extra_is_named(monkeypatch):
    from dynatrain_megatron.compat import megatron_lm as rt

    real = rt.importlib.util.find_spec
    monkeypatch.setattr(rt.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("six", "regex") else real(name, *a))
    monkeypatch.setitem(rt._state, "prepared", False)
    with pytest.raises(rt.MissingExtraError, match=r"not installed: six, regex.*\[megatron-lm\]"):
        rt.prepare_megatron_lm()
