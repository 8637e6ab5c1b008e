"""The Megatron-LM patches and `dynatrain megatron-lm patch [--revert] DIR` on the real
snapshots of every supported release (`../shared/megatron-lm/<release>`): `git apply
--check` accepts each patch, the command writes exactly what `git apply` writes, a second
run changes nothing, `--revert` gives the release's bytes back, other versions are refused
by name. The tree is written all or nothing and never through a link. Then the start-up
checks of a checkout (its `megatron.core`, triton stand-ins, refused options). No
Megatron-LM process is started."""
import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dynatrain_megatron.cli import main
from dynatrain_megatron.compat import cpu as cpu_compat
from dynatrain_megatron.compat import megatron_lm as rt
from dynatrain_megatron.megatron_lm import patch_tool as mp
from megatron_lm_tree import ROOT, SHARED

FILES = ("megatron/training/training.py", "pretrain_gpt.py")
INFO = "megatron/core/package_info.py"
RELEASES = [r.name for r in mp.RELEASES]



def _snapshot(name: str) -> Path:
    path = SHARED / name
    if not (path / "pretrain_gpt.py").is_file():
        pytest.skip(f"no snapshot of {name} at {path}")
    return path


def _small_copy(src: Path, dst: Path) -> Path:
    """The files the patch tool reads, copied (writable) from a snapshot."""
    for rel in (*FILES, INFO):
        if (src / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, dst / rel)
    return dst


@pytest.fixture(params=RELEASES)
def tree(request, tmp_path):
    return _small_copy(_snapshot(request.param), tmp_path / "Megatron-LM")


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=cwd,
                          capture_output=True, text=True)


def _bytes(root: Path) -> dict[str, bytes]:
    return {f: (root / f).read_bytes() for f in FILES}


def test_each_release_is_found_patched_and_reverted_as_git_would(tree, tmp_path, capsys):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    release = mp.identify(tree).release
    ref = tmp_path / "by-git"
    shutil.copytree(tree, ref)
    assert _git(ref, "init", "-q").returncode == 0
    _git(ref, "add", "-A")
    assert _git(ref, "commit", "-qm", "snapshot").returncode == 0
    check = _git(ref, "apply", "--check", "-v", str(release.patch_path))
    assert check.returncode == 0, check.stderr
    assert _git(ref, "apply", str(release.patch_path)).returncode == 0

    before = _bytes(tree)
    assert main(["megatron-lm", "patch", str(tree)]) == 0
    assert f"{release.name}, patched" in capsys.readouterr().out
    after = _bytes(tree)
    assert after == _bytes(ref)  # byte for byte what git apply makes
    assert all(after[f] != before[f] for f in FILES)
    head = (tree / "pretrain_gpt.py").read_text().split("from megatron", 1)[0]
    assert "prepare_megatron_lm()" in head  # the runtime before any megatron import
    assert not [p for p in tree.rglob(".*dynatrain-*")]  # no temporary file left

    assert main(["megatron-lm", "patch", str(tree)]) == 0  # a second run writes nothing
    assert "already patched; nothing changed" in capsys.readouterr().out
    assert _bytes(tree) == after
    assert main(["megatron-lm", "patch", "--revert", str(tree)]) == 0
    assert f"{release.name}, reverted" in capsys.readouterr().out
    assert _bytes(tree) == before  # the release's own bytes (the fingerprint is checked)
    assert main(["megatron-lm", "patch", "--revert", str(tree)]) == 0
    assert "not patched; nothing changed" in capsys.readouterr().out


def test_unknown_versions_are_refused_by_name(tmp_path, capsys):
    tree = _small_copy(_snapshot("core_v0.16.1"), tmp_path / "t")
    # a local edit of a file the patch touches: neither the release nor the patched release
    text = (tree / "megatron/training/training.py").read_text()
    (tree / "megatron/training/training.py").write_text(text.replace("def train(", "def train (", 1))
    info = tree / INFO
    info.parent.mkdir(parents=True, exist_ok=True)
    info.write_text('MAJOR = 0\nMINOR = 18\nPATCH = 0\nPRE_RELEASE = "rc0"\n')
    before = _bytes(tree)
    assert main(["megatron-lm", "patch", str(tree)]) == 2
    err = capsys.readouterr().err
    assert "not supported" in err and "megatron-core 0.18.0rc0" in err
    assert f"supported releases: {', '.join(RELEASES)}" in err
    assert "core_v0.19.0" in RELEASES and "core_v0.16.1" in RELEASES
    assert _bytes(tree) == before  # refused: nothing written
    # not UTF-8: the same one-line refusal
    (tree / "pretrain_gpt.py").write_bytes(b"\xff\xfe" + before["pretrain_gpt.py"])
    assert main(["megatron-lm", "patch", str(tree)]) == 2
    assert "not supported" in capsys.readouterr().err
    with pytest.raises(mp.MegatronLMVersionError, match="not a Megatron-LM checkout"):
        mp.identify(tree / "megatron")


def test_a_patch_that_does_not_fit_writes_nothing(monkeypatch, tmp_path):
    tree = _small_copy(_snapshot("core_v0.16.1"), tmp_path / "t")
    # a damaged patch file: the second file's hunk no longer matches; the first file must
    # not be written either
    text = mp.release_named("core_v0.16.1").patch_path.read_text()
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


def test_a_failed_write_or_rename_leaves_the_tree_as_it_was(tree, monkeypatch):
    before = _bytes(tree)
    real_write, calls = os.write, []

    def full_disk(fd, data):  # the second file's write fails (a full disk, a size limit)
        calls.append(fd)
        if len(calls) > 1:
            raise OSError(errno.EFBIG, "File too large")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(mp.DynatrainError, match="File too large.*nothing was changed"):
        mp.patch_checkout(tree)
    monkeypatch.setattr(os, "write", real_write)
    assert _bytes(tree) == before and not list(tree.rglob(".*dynatrain-*"))
    assert not mp.identify(tree).patched  # still the release, so the tool can go on

    real_rename, renames = os.rename, []

    def second_fails(*a, **k):
        renames.append(a)
        if len(renames) == 2:
            raise OSError(errno.EIO, "Input/output error")
        return real_rename(*a, **k)

    monkeypatch.setattr(os, "rename", second_fails)
    with pytest.raises(mp.DynatrainError, match="put back as it was"):
        mp.patch_checkout(tree)
    monkeypatch.setattr(os, "rename", real_rename)
    assert _bytes(tree) == before and not list(tree.rglob(".*dynatrain-*"))
    assert mp.patch_checkout(tree).written == FILES


def test_a_file_size_limit_leaves_the_tree_as_it_was(tmp_path):
    # the reproduction: `prlimit --fsize` below training.py's size
    if shutil.which("prlimit") is None:
        pytest.skip("prlimit is not installed")
    tree = _small_copy(_snapshot("core_v0.16.1"), tmp_path / "t")
    before = _bytes(tree)
    limit = len(before["megatron/training/training.py"]) // 2
    proc = subprocess.run(["prlimit", f"--fsize={limit}", sys.executable, "-m",
                           "dynatrain_megatron.cli", "megatron-lm", "patch", str(tree)],
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "nothing was changed" in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1  # one line, no traceback
    assert _bytes(tree) == before and not list(tree.rglob(".*dynatrain-*"))
    assert main(["megatron-lm", "patch", str(tree)]) == 0  # the tool still knows the tree


def test_a_read_only_file_is_refused_before_anything_is_written(tree):
    before = _bytes(tree)
    os.chmod(tree / "pretrain_gpt.py", 0o444)
    with pytest.raises(mp.UnsafeCheckoutError, match="pretrain_gpt.py is read-only"):
        mp.patch_checkout(tree)
    assert _bytes(tree) == before


def test_links_never_carry_a_write_into_another_tree(tmp_path, capsys):
    original = _small_copy(_snapshot("core_v0.16.1"), tmp_path / "original")
    before = _bytes(original)
    # cp -as: every file a symbolic link to the original's
    symlinked = tmp_path / "symlinked"
    assert subprocess.run(["cp", "-as", str(original), str(symlinked)]).returncode == 0
    assert main(["megatron-lm", "patch", str(symlinked)]) == 2
    assert "symbolic link" in capsys.readouterr().err
    # a directory on the way is a link into the original
    dir_link = tmp_path / "dir-link"
    dir_link.mkdir()
    shutil.copyfile(original / "pretrain_gpt.py", dir_link / "pretrain_gpt.py")
    (dir_link / "megatron").symlink_to(original / "megatron")
    assert main(["megatron-lm", "patch", str(dir_link)]) == 2
    assert "without following a link" in capsys.readouterr().err
    assert _bytes(original) == before
    # cp -al: hard links; the copy is patched with new files, the original keeps its bytes
    hard = tmp_path / "hard"
    assert subprocess.run(["cp", "-al", str(original), str(hard)]).returncode == 0
    assert main(["megatron-lm", "patch", str(hard)]) == 0
    out = capsys.readouterr().out
    assert "patched" in out and "had other hard links" in out
    assert _bytes(original) == before and mp.identify(hard).patched
    assert not mp.identify(original).patched


# ---------------------------------------------------------------- start-up checks
# one interpreter checks each sys.path in turn (megatron is never imported in it, so the
# import system looks the `megatron` portions up afresh each time)
CHECKS = """
import importlib, json, sys
from dynatrain_megatron.compat import megatron_lm as m, cpu
base = list(sys.path)
for paths in json.loads(sys.argv[1]):
    sys.path[:] = paths + base
    importlib.invalidate_caches()
    try:
        m.check_checkout()
        print('OK', json.dumps(cpu.triton_stand_ins(dry_run=True)))
    except m.CheckoutMismatchError as e:
        print('REFUSED', json.dumps(str(e)))
"""


def _checks(*paths: list[Path]) -> list[str]:
    import json

    proc = subprocess.run([sys.executable, "-c", CHECKS,
                           json.dumps([[str(p) for p in ps] for ps in paths])],
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def test_a_checkout_and_a_shadowing_core_are_named_at_start_up(tmp_path):
    new = _snapshot("core_v0.19.0")
    old = _snapshot("core_v0.16.1")
    # another megatron-core ahead of the 0.19.0 checkout's own
    shadow = tmp_path / "shadow"
    (shadow / "megatron" / "core").mkdir(parents=True)
    (shadow / "megatron" / "core" / "__init__.py").write_text("")
    (shadow / INFO).write_text("MAJOR = 0\nMINOR = 16\nPATCH = 1\n")
    # the 0.19.0 checkout's megatron-core ahead of the wheel, under the 0.16.1 export
    core_only = tmp_path / "core-only" / "megatron"
    core_only.mkdir(parents=True)
    (core_only / "core").symlink_to(new / "megatron" / "core")
    ok19, ok16, shadowed, mixed = _checks([new], [old], [shadow, new], [old, core_only.parent])
    # the 0.19.0 checkout first: its own megatron/core; paged_stash's unguarded triton import
    # gets a stand-in, batch_invariant_kernels (guarded in 0.19) does not
    assert ok19 == 'OK ["megatron.core.transformer.moe.ops.paged_stash"]'
    # the 0.16.1 export (no megatron/core) with the installed megatron-core 0.16.1
    assert ok16 == 'OK ["megatron.core.transformer.custom_layers.batch_invariant_kernels"]'
    assert shadowed.startswith("REFUSED")  # named, with both versions
    assert str(shadow / "megatron" / "core") in shadowed and f"checkout {new}" in shadowed
    assert "megatron-core 0.19.1" in shadowed and "megatron-core 0.16.1" in shadowed
    assert mixed.startswith("REFUSED")
    assert "core_v0.16.1, which runs with megatron-core 0.16.1" in mixed
    assert "megatron-core 0.19.1" in mixed


def test_triton_stand_ins_follow_the_source_not_a_version():
    guarded = "try:\n    import triton\nexcept ImportError:\n    triton = None\n"
    assert not cpu_compat._unguarded_triton_import(guarded)
    assert cpu_compat._unguarded_triton_import("import os\nimport triton.language as tl\n")
    assert cpu_compat._unguarded_triton_import("from triton import jit\n")
    mod = cpu_compat._stand_in_module("x.kernels", "import triton\nBLOCK = 1024\nNAMES = ('a',)\n"
                                      "@triton.jit\ndef kernel(x):\n    pass\nclass K:\n    pass\n")
    assert mod.BLOCK == 1024 and mod.NAMES == ("a",)
    with pytest.raises(mp.DynatrainError, match="x.kernels.kernel needs triton"):
        mod.kernel(1)
    with pytest.raises(mp.DynatrainError, match="x.kernels.K needs triton"):
        mod.K()
    with pytest.raises(AttributeError, match="stand-in"):
        mod.other


def test_stand_ins_take_the_release_signature_and_typing_override_exists():
    skipped = rt._skipped_like(lambda tp_size=None: 1 / 0)
    assert skipped() is None and skipped(tp_size=2) is None  # 0.19's call
    with pytest.raises(TypeError):
        skipped(pp_size=2)  # not what the release's own takes
    import typing

    cpu_compat.typing_override()
    assert callable(typing.override)

    @typing.override
    def f():
        return 1

    assert f() == 1


def test_options_of_newer_releases_are_refused_with_reasons():
    assert rt.release_refusals(SimpleNamespace()) == []  # 0.16.1: none of them exists
    plain = SimpleNamespace(gtp_weight_remat_size=1, expert_gtp_weight_remat_size=1,
                            step_batch_size_schedule=None, moe_paged_stash=False,
                            moe_expert_rank_capacity_factor=None, optimizer_cuda_graph=False,
                            use_layer_wise_param_layout=True,  # 0.19's default
                            use_layer_wise_distributed_optimizer=False)
    assert rt.release_refusals(plain) == []
    every = SimpleNamespace(**dict(vars(plain), gtp_weight_remat_size=2,
                                   expert_gtp_weight_remat_size=2,
                                   step_batch_size_schedule="1:8,10:16", moe_paged_stash=True,
                                   moe_expert_rank_capacity_factor=1.5,
                                   optimizer_cuda_graph=True,
                                   use_layer_wise_distributed_optimizer=True))
    out = rt.release_refusals(every)
    for flag in ("--tensor-parallel-num-weight-shards", "--expert-tensor-parallel-num-weight",
                 "--step-batch-size-schedule", "--moe-paged-stash",
                 "--moe-expert-rank-capacity-factor", "--optimizer-cuda-graph",
                 "--use-layer-wise-param-layout"):
        assert sum(flag in why for why in out) == 1, flag
    assert all("(" in why for why in out)  # each with its reason
    # a switch's layout carries the weight-shard counts along (TP x GTP, GTP 1)
    derived = rt.derived_layout_args(every, {"tensor_model_parallel_size": 4,
                                             "expert_tensor_parallel_size": 2})
    assert derived == {}  # `every` has no such option: nothing to derive
    args = SimpleNamespace(tensor_parallel_num_weight_shards=2,
                           expert_tensor_parallel_num_weight_shards=2)
    assert rt.derived_layout_args(args, {"tensor_model_parallel_size": 1,
                                         "expert_tensor_parallel_size": 4}) == {
        "tensor_parallel_num_weight_shards": 1, "gtp_weight_remat_size": 1,
        "expert_tensor_parallel_num_weight_shards": 4, "expert_gtp_weight_remat_size": 1}


def test_reverse_of_apply_is_identity():
    hunks = [mp.Hunk(2, ("b\n", "c\n"), ("b\n", "x\n", "c\n")), mp.Hunk(5, ("e\n",), ("E\n",))]
    text = "a\nb\nc\nd\ne\nf\n"
    new = mp.apply_hunks(text, hunks)
    assert new == "a\nb\nx\nc\nd\nE\nf\n"
    assert mp.apply_hunks(new, hunks, reverse=True) == text
    assert mp.apply_hunks(text, hunks, reverse=True) is None  # context differs


def test_missing_extra_is_named(monkeypatch):
    real = rt.importlib.util.find_spec
    monkeypatch.setattr(rt.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("six", "regex") else real(name, *a))
    monkeypatch.setitem(rt._state, "prepared", False)
    with pytest.raises(rt.MissingExtraError, match=r"not installed: six, regex.*\[megatron-lm\]"):
        rt.prepare_megatron_lm()


def test_patch_builds_the_dataset_helper_of_a_checkout_with_its_own_core(tmp_path, capsys):
    # a checkout with its own megatron/core ships helpers.cpp, not the module; Megatron-LM
    # would `make` it at start-up, the CPU runtime only checks that it imports
    import importlib.util

    from dynatrain_megatron.megatron_lm.checkout import HELPER_SOURCE, helper_name

    src = _snapshot("core_v0.19.0")
    tree = _small_copy(src, tmp_path / "Megatron-LM")
    (tree / HELPER_SOURCE).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / HELPER_SOURCE, tree / HELPER_SOURCE)
    assert main(["megatron-lm", "patch", str(tree)]) == 0
    module = tree / HELPER_SOURCE.parent / helper_name()
    assert f"built megatron-core's dataset helper ({module.relative_to(tree)})" \
        in capsys.readouterr().out
    spec = importlib.util.spec_from_file_location("helpers_cpp", module)
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    assert callable(helpers.build_sample_idx_int64)
    assert main(["megatron-lm", "patch", str(tree)]) == 0  # there already: nothing built
    assert "built" not in capsys.readouterr().out
    assert main(["megatron-lm", "patch", "--revert", str(tree)]) == 0
    assert module.is_file() and not [p for p in tree.rglob(".helpers_cpp*")]
