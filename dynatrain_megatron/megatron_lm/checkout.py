"""A working copy of a Megatron-LM checkout, ready to run: copied, its dataset helper built,
patched (or not).

A checkout with its own `megatron/core` (core_v0.17 and later; the registry has no wheel
of them) ships the C++ source of megatron-core's dataset helper, not the compiled module
that the megatron-core wheel carries: Megatron-LM's `initialize` would run `make` in the
checkout at start-up, once per job and under the job's ranks, which the CPU runtime does not
do (`compat/megatron_lm.py`). So it is built here, once per helper source and Python, into a
cache, and copied into each working copy. Needs g++ and pybind11 (the `megatron-lm` extra).
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Optional

from ..vps.errors import DynatrainError
from .patch_tool import patch_checkout

log = logging.getLogger("dynatrain")

HELPER_DIR = Path("megatron") / "core" / "datasets"
HELPER_SOURCE = HELPER_DIR / "helpers.cpp"


def helper_name() -> str:
    """The file name of the compiled helper for this Python (`helpers_cpp.cpython-311-...so`)."""
    return "helpers_cpp" + sysconfig.get_config_var("EXT_SUFFIX")


def needs_dataset_helper(root: Path) -> bool:
    """True when `root` has megatron-core's helper source but not the module for this Python."""
    root = Path(root)
    return (root / HELPER_SOURCE).is_file() and not (root / HELPER_DIR / helper_name()).is_file()


def build_dataset_helper(source: Path, cache: Path) -> Path:
    """The helper compiled from `source` (`helpers.cpp`), built once into `cache` (keyed by
    the source's hash and this Python's extension suffix) and reused after."""
    try:
        import pybind11
    except ImportError:
        raise DynatrainError("building megatron-core's dataset helper needs pybind11: pip "
                             "install 'dynatrain_megatron[megatron-lm]'") from None
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise DynatrainError("building megatron-core's dataset helper needs a C++ compiler "
                             "(g++): none found")
    key = hashlib.sha256(Path(source).read_bytes()).hexdigest()[:16]
    out = Path(cache) / key / helper_name()
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    cmd = [cxx, "-O3", "-Wall", "-shared", "-std=c++17", "-fPIC",
           f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
           str(source), "-o", str(tmp)]
    log.info("building megatron-core's dataset helper: %s", " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise DynatrainError(f"building megatron-core's dataset helper failed ({cxx} exited "
                             f"{proc.returncode}): {proc.stderr.strip()[-600:]}")
    os.replace(tmp, out)  # another builder's identical module may already be there
    return out


def ensure_dataset_helper(root: Path, cache: Optional[Path] = None) -> Optional[Path]:
    """Put the compiled dataset helper into the checkout `root` where it has the source and
    not the module for this Python (`needs_dataset_helper`): built once into `cache`
    (`default_cache()`), copied in under a temporary name and renamed into place. Returns
    the module's path, or None when nothing was needed."""
    root = Path(root)
    if not needs_dataset_helper(root):
        return None
    where = root / HELPER_DIR
    if where.is_symlink() or not where.is_dir():
        raise DynatrainError(f"{where}: not a directory of the checkout (a link is not "
                             f"followed); cannot put megatron-core's dataset helper there")
    built = build_dataset_helper(root / HELPER_SOURCE,
                                 Path(cache) if cache is not None else default_cache())
    out = where / helper_name()
    tmp = where / f".{out.name}.{os.getpid()}"
    shutil.copyfile(built, tmp)
    os.chmod(tmp, 0o755)
    os.replace(tmp, out)
    return out


def working_copy(src: Path, dst: Path, *, patched: bool, cache: Optional[Path] = None) -> Path:
    """A copy of the checkout `src` at `dst` (which must not exist), with the dataset
    helper in place where the checkout builds its own, patched with our patch or not."""
    src, dst = Path(src), Path(dst)
    if not (src / "pretrain_gpt.py").is_file():
        raise DynatrainError(f"{src} is not a Megatron-LM checkout (no pretrain_gpt.py)")
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns(".git"))
    _make_writable(dst)  # a read-only source (a shared snapshot) gives a copy we may patch
    ensure_dataset_helper(dst, cache)
    if patched:
        patch_checkout(dst)
    return dst


def _make_writable(root: Path) -> None:
    import stat

    for d, dirs, files in os.walk(root):
        for name in [d, *(os.path.join(d, f) for f in files)]:
            st = os.lstat(name)
            if not stat.S_ISLNK(st.st_mode) and not st.st_mode & stat.S_IWUSR:
                os.chmod(name, stat.S_IMODE(st.st_mode) | stat.S_IWUSR)


def default_cache() -> Path:
    """Where built helpers are kept: $DYNATRAIN_CACHE, else ~/.cache/dynatrain."""
    base = os.environ.get("DYNATRAIN_CACHE") or Path.home() / ".cache" / "dynatrain"
    return Path(base) / "megatron-core-helpers" / f"py{sys.version_info[0]}{sys.version_info[1]}"
