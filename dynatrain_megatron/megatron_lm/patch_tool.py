"""Find the Megatron-LM release of a checkout and apply (or revert) our patch for it
(`dynatrain megatron-lm patch [--revert] DIR`).

A release is recognised by the SHA-256 of the files our patch touches (a source export
such as `../shared/megatron-lm/core_v0.16.1` has no `megatron/core/package_info.py`, and a
checkout's own megatron-core version says little about its `megatron/training`). A
checkout whose files are exactly a supported release *after* our patch (the patch
reverses cleanly onto the release's fingerprint) is reported as already patched. Anything
else is refused, naming what was found (the megatron-core version where the checkout has
one, the files' hashes) and the supported releases.

The patch is applied here, in Python, with exact context (no fuzz, no offsets): the
fingerprint already guarantees the text it was made from, so needing `git` or `patch`
on the user's machine would add nothing. `git apply --check` on the snapshot is what the
tests run to show each patch is an ordinary one.

The checkout is treated as a tree others may have shaped (a `cp -as` or `cp -al` copy of a
shared one, a file made read-only on purpose):

* every directory on the way to a patched file is opened without following links
  (`O_NOFOLLOW | O_DIRECTORY`, one component at a time); a symbolic link anywhere on the
  path, or as the file, is refused: writing there would change the tree it points into;
* each file must be a regular file of this user's, writable by them, in a directory of
  this user's (or root's) that others cannot write to unless it is sticky;
* all-or-nothing: every file's new text is computed and written to a temporary file
  beside it (`O_CREAT | O_EXCL | O_NOFOLLOW`, the original's mode, fsync) before any file
  is replaced; only then is each renamed over its original. A file with other hard links
  (`cp -al`) is thereby replaced by a new one, and the other names keep the unpatched
  text. A failed write leaves the tree as it was; a failed rename puts back those already
  renamed.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Optional

from ..vps.errors import DynatrainError

PATCHES_DIR = Path(__file__).resolve().parents[2] / "patches"
MAX_SOURCE_BYTES = 16 * 1024 * 1024  # training.py is ~200 KB; anything this big is not it


class MegatronLMVersionError(DynatrainError):
    """The checkout is not a Megatron-LM release we have a patch for."""


class UnsafeCheckoutError(DynatrainError):
    """A file of the checkout cannot be patched without writing through a link, into
    another user's file, or over a file its owner made read-only."""


@dataclass(frozen=True, slots=True)
class Release:
    """A supported Megatron-LM release: its tag, the fingerprint of the files its patch
    touches (SHA-256 of their bytes, unpatched) and the megatron-core version its
    `megatron/core` is (the start-up check names a runtime that differs)."""

    name: str
    fingerprints: tuple[tuple[str, str], ...]
    core_version: str

    def __post_init__(self) -> None:
        if not self.fingerprints or any(len(h) != 64 for _, h in self.fingerprints):
            raise DynatrainError(f"release {self.name}: bad fingerprints {self.fingerprints}")
        if not re.fullmatch(r"\d+\.\d+\.\d+\w*", self.core_version):
            raise DynatrainError(f"release {self.name}: bad core version {self.core_version!r}")

    @property
    def patch_path(self) -> Path:
        return PATCHES_DIR / f"megatron-lm-{self.name}" / "dynatrain.patch"

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(f for f, _ in self.fingerprints)


# newest first: `latest_release()` and the CLI's help list them in this order
RELEASES: tuple[Release, ...] = (
    Release("core_v0.19.0", (
        ("megatron/training/training.py",
         "d968ef8216f63d6373372190ac895fc905234c116bba3e804d2951876e6ad98c"),
        ("pretrain_gpt.py", "7283c4aeb5a00c694bbf2930527a184fc0d5f607f548c74707c71cc240d05fae"),
    ), core_version="0.19.1"),
    Release("core_v0.16.1", (
        ("megatron/training/training.py",
         "457cd234a88659aa395a988366e60e61f2c9d16a51df7efc8cc09c1f22fd48b1"),
        ("pretrain_gpt.py", "5a5b8fe909610892146e4d2ef5b303bd9b73bb31dfc96d73f2d0afb8937d4b22"),
    ), core_version="0.16.1"),
)


def latest_release() -> Release:
    return RELEASES[0]


# the release the whole suite passes on, and so the one `make run` and the tests use unless
# told otherwise (the latest); the others pass the tests marked `every_release`
# (docs/releases.md)
DEFAULT_RELEASE = "core_v0.19.0"


def default_release() -> Release:
    """The release a run or a test uses when none is named: the one every test passes on."""
    return release_named(DEFAULT_RELEASE)


def release_named(name: str) -> Release:
    for r in RELEASES:
        if r.name == name:
            return r
    raise MegatronLMVersionError(f"no supported Megatron-LM release {name!r}; supported "
                                 f"releases: {', '.join(r.name for r in RELEASES)}")


# ---------------------------------------------------------------------------- unified diff
@dataclass(frozen=True, slots=True)
class Hunk:
    old_start: int  # 1-based, as in the header
    old: tuple[str, ...]
    new: tuple[str, ...]


def parse_patch(text: str) -> dict[str, list[Hunk]]:
    """The hunks of a unified diff, per target path (`b/` side)."""
    out: dict[str, list[Hunk]] = {}
    path: Optional[str] = None
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("+++ "):
            path = re.sub(r"^b/", "", line[4:].strip())
            out[path] = []
        m = re.match(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", line)
        if m:
            if path is None:
                raise DynatrainError(f"patch: hunk before any file header: {line!r}")
            n_old = int(m.group(2) or 1)
            n_new = int(m.group(4) or 1)
            old: list[str] = []
            new: list[str] = []
            i += 1
            while (len(old) < n_old or len(new) < n_new) and i < len(lines):
                body = lines[i]
                tag, rest = body[:1], body[1:]
                if tag in (" ", "\n", ""):
                    rest = rest if tag == " " else "\n"
                    old.append(rest)
                    new.append(rest)
                elif tag == "-":
                    old.append(rest)
                elif tag == "+":
                    new.append(rest)
                elif tag != "\\":
                    raise DynatrainError(f"patch: unexpected line in hunk of {path}: {body!r}")
                i += 1
            if (len(old), len(new)) != (n_old, n_new):
                raise DynatrainError(f"patch: truncated hunk of {path} at line {m.group(1)}")
            out[path].append(Hunk(int(m.group(1)), tuple(old), tuple(new)))
            continue
        i += 1
    return out


def apply_hunks(text: str, hunks: list[Hunk], *, reverse: bool = False) -> Optional[str]:
    """`text` with `hunks` applied at their exact lines, or None where any context
    differs. `reverse` undoes them (the new side is expected, the old side written)."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    pos = 0
    shift = 0  # reverse: lines are numbered on the new side
    for h in hunks:
        want, put = (h.new, h.old) if reverse else (h.old, h.new)
        start = h.old_start - 1 + (shift if reverse else 0)
        if not want:
            start += 1  # a pure insertion's header names the line before it
        if start < pos or lines[start:start + len(want)] != list(want):
            return None
        out.extend(lines[pos:start])
        out.extend(put)
        pos = start + len(want)
        shift += len(h.new) - len(h.old)
    out.extend(lines[pos:])
    return "".join(out)


def _apply_bytes(data: bytes, hunks: list[Hunk], *, reverse: bool = False) -> Optional[bytes]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None  # not the release's text (which is UTF-8)
    out = apply_hunks(text, hunks, reverse=reverse)
    return None if out is None else out.encode("utf-8")


# ---------------------------------------------------------------------------- the tree
@contextlib.contextmanager
def _directory(root: Path, rel_dir: str) -> Iterator[int]:
    """A descriptor of `root/rel_dir`, each component below `root` opened without
    following a link (a symlinked directory would take writes into another tree)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in [p for p in rel_dir.split("/") if p]:
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                raise
            except OSError as e:
                raise UnsafeCheckoutError(
                    f"{root / rel_dir}: cannot open {part!r} as a directory without following "
                    f"a link ({e.strerror}); patch a real copy of the checkout (cp -r)") from None
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class _File:
    data: bytes
    mode: int
    links: int


def _read(root: Path, rel: str, *, for_writing: bool = False) -> Optional[_File]:
    """The bytes of `root/rel` read through no link, or None when it does not exist.
    `for_writing` adds the checks a file we will replace must pass."""
    d, name = os.path.split(rel)
    try:
        with _directory(root, d) as dfd:
            return _read_in(root, rel, dfd, name, for_writing)
    except FileNotFoundError:
        return None


def _read_in(root: Path, rel: str, dfd: int, name: str, for_writing: bool) -> _File:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise UnsafeCheckoutError(f"{root / rel}: not opened ({e.strerror}): a symbolic "
                                  f"link is never patched; patch a real copy (cp -r)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeCheckoutError(f"{root / rel} is not a regular file "
                                      f"({stat.filemode(st.st_mode)})")
        if st.st_size > MAX_SOURCE_BYTES:
            raise UnsafeCheckoutError(f"{root / rel} is {st.st_size} bytes, over "
                                      f"{MAX_SOURCE_BYTES}: not a Megatron-LM source file")
        if for_writing:
            _check_writable(root / rel, st, os.fstat(dfd))
        chunks, left = [], st.st_size + 1
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        data = b"".join(chunks)
        if len(data) > st.st_size:
            raise UnsafeCheckoutError(f"{root / rel} grew while being read")
        return _File(data, stat.S_IMODE(st.st_mode), st.st_nlink)
    finally:
        os.close(fd)


def _check_writable(path: Path, st: os.stat_result, dst: os.stat_result) -> None:
    me = os.geteuid()
    if st.st_uid != me:
        raise UnsafeCheckoutError(f"{path} is owned by uid {st.st_uid}, not yours ({me}): "
                                  f"patch a copy of your own")
    if not st.st_mode & stat.S_IWUSR:
        raise UnsafeCheckoutError(f"{path} is read-only (mode {stat.filemode(st.st_mode)}): "
                                  f"its owner kept it from being changed; nothing was written")
    if dst.st_uid not in (me, 0):
        raise UnsafeCheckoutError(f"{path.parent} is owned by uid {dst.st_uid}, not yours "
                                  f"({me}) nor root's")
    if dst.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not dst.st_mode & stat.S_ISVTX:
        raise UnsafeCheckoutError(f"{path.parent} is writable by others and not sticky "
                                  f"(mode {stat.filemode(dst.st_mode)}): anyone there could "
                                  f"swap the file while it is patched")


def _write_all(root: Path, new: Mapping[str, bytes], modes: Mapping[str, int]) -> None:
    """Replace every file of `new` or none: each is written whole to a temporary name
    beside it first, then all are renamed over their originals."""
    staged: list[tuple[str, str]] = []  # (rel, temp name)
    try:
        for rel, data in new.items():
            d, name = os.path.split(rel)
            tmp = f".{name}.dynatrain-{secrets.token_hex(6)}"
            with _directory(root, d) as dfd:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                             modes[rel], dir_fd=dfd)
                staged.append((rel, tmp))
                try:
                    os.fchmod(fd, modes[rel])
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                    os.fsync(fd)
                finally:
                    os.close(fd)
    except BaseException as e:
        _unlink_staged(root, staged)
        if isinstance(e, OSError):
            raise DynatrainError(f"{root}: writing the patched files failed ({e.strerror}); "
                                 f"nothing was changed") from None
        raise
    originals: dict[str, bytes] = {}
    done: list[str] = []
    try:
        for rel, tmp in staged:
            d, name = os.path.split(rel)
            originals[rel] = _read(root, rel).data  # type: ignore[union-attr]
            with _directory(root, d) as dfd:
                os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            done.append(rel)
    except BaseException as e:
        _unlink_staged(root, [s for s in staged if s[0] not in done])
        if done:  # put back what was already replaced
            _write_all(root, {r: originals[r] for r in done}, modes)
        if isinstance(e, OSError):
            raise DynatrainError(f"{root}: replacing the files failed ({e.strerror}); the "
                                 f"tree was put back as it was") from None
        raise


def _unlink_staged(root: Path, staged: list[tuple[str, str]]) -> None:
    for rel, tmp in staged:
        with contextlib.suppress(OSError), _directory(root, os.path.dirname(rel)) as dfd:
            os.unlink(tmp, dir_fd=dfd)


# ---------------------------------------------------------------------------- releases
def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def core_version_of(root: Path) -> Optional[str]:
    """The version `root/megatron/core/package_info.py` states, or None (read to name a
    version, never to patch: a linked megatron-core, e.g. an installed one, is fine)."""
    info = Path(root) / "megatron" / "core" / "package_info.py"
    try:
        with open(info, "rb") as f:
            data = f.read(64 * 1024)
    except OSError:
        return None
    nums = dict(re.findall(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE)\s*=\s*['\"]?([\w.]*)['\"]?",
                           data.decode("utf-8", "replace"), re.M))
    if not {"MAJOR", "MINOR", "PATCH"} <= set(nums):
        return None
    return f"{nums['MAJOR']}.{nums['MINOR']}.{nums['PATCH']}{nums.get('PRE_RELEASE', '')}"


def describe_version(root: Path) -> str:
    """What the checkout says about itself, for an error message."""
    found = []
    version = core_version_of(root)
    if version is not None:
        found.append(f"megatron-core {version}")
    for rel in sorted({f for r in RELEASES for f in r.files}):
        f = _read(root, rel)
        found.append(f"{rel} " + ("missing" if f is None else f"sha256 {_sha(f.data)[:12]}"))
    return ", ".join(found)


@dataclass(frozen=True, slots=True)
class PatchState:
    """A checkout's relation to a supported release."""

    release: Release
    patched: bool


def identify(root: Path, releases: tuple[Release, ...] = RELEASES) -> PatchState:
    """The release `root` is, patched or not; raises `MegatronLMVersionError` otherwise."""
    root = Path(root)
    if _read(root, "pretrain_gpt.py") is None:
        raise MegatronLMVersionError(f"{root} is not a Megatron-LM checkout (no pretrain_gpt.py)")
    for rel in releases:
        current = {f: _read(root, f) for f in rel.files}
        if any(v is None for v in current.values()):
            continue
        if all(_sha(current[f].data) == h for f, h in rel.fingerprints):
            return PatchState(rel, patched=False)
        hunks = _hunks(rel) if rel.patch_path.is_file() else {}
        if all(f in hunks for f in rel.files):
            originals = {f: _apply_bytes(current[f].data, hunks[f], reverse=True)
                         for f in rel.files}
            if all(originals[f] is not None and _sha(originals[f]) == h
                   for f, h in rel.fingerprints):
                return PatchState(rel, patched=True)
    supported = ", ".join(r.name for r in releases)
    raise MegatronLMVersionError(
        f"{root}: this Megatron-LM version is not supported (found: {describe_version(root)}); "
        f"supported releases: {supported}")


def _hunks(rel: Release) -> Mapping[str, list[Hunk]]:
    if not rel.patch_path.is_file():
        raise DynatrainError(f"the patch for {rel.name} is missing: {rel.patch_path}")
    return parse_patch(rel.patch_path.read_text())


@dataclass(frozen=True, slots=True)
class PatchResult:
    """What `patch_checkout` / `revert_checkout` found and did."""

    state: PatchState  # before
    written: tuple[str, ...]  # files replaced (none when there was nothing to do)
    unlinked: tuple[str, ...] = ()  # files that had other hard links (those keep the old text)


def _rewrite(root: Path, reverse: bool) -> PatchResult:
    root = Path(root)
    state = identify(root)
    if state.patched != reverse:
        return PatchResult(state, ())
    hunks = _hunks(state.release)
    new: dict[str, bytes] = {}
    modes: dict[str, int] = {}
    unlinked = []
    for rel_path, hs in hunks.items():
        f = _read(root, rel_path, for_writing=True)
        out = None if f is None else _apply_bytes(f.data, hs, reverse=reverse)
        if out is None:
            raise DynatrainError(f"{rel_path}: the patch for {state.release.name} does not "
                                 f"{'reverse onto' if reverse else 'apply to'} the file it was "
                                 f"made for (the patch file is damaged); nothing was written")
        new[rel_path], modes[rel_path] = out, f.mode
        if f.links > 1:
            unlinked.append(rel_path)
    if reverse:
        want = dict(state.release.fingerprints)
        bad = [r for r, data in new.items() if r in want and _sha(data) != want[r]]
        if bad:
            raise DynatrainError(f"reverting {', '.join(bad)} would not give the release's "
                                 f"files back; nothing was written")
    _write_all(root, new, modes)
    return PatchResult(state, tuple(sorted(new)), tuple(unlinked))


def patch_checkout(root: Path) -> PatchResult:
    """Apply the matching patch to the checkout at `root`, every file or none."""
    return _rewrite(root, reverse=False)


def revert_checkout(root: Path) -> PatchResult:
    """Give a patched checkout its release's files back (checked against the fingerprint),
    every file or none; an unpatched one is left alone."""
    return _rewrite(root, reverse=True)
