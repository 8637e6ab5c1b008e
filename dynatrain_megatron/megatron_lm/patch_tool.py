"""Find the Megatron-LM release of a checkout and apply our patch for it (`dynatrain
megatron-lm patch DIR`).

A release is recognised by the SHA-256 of the files our patch touches (a source export
such as `../shared/megatron-lm/core_v0.16.1` has no `megatron/core/package_info.py`, and a
checkout's own megatron-core version says little about its `megatron/training`). A
checkout whose files are exactly a supported release *after* our patch (the patch
reverses cleanly onto the release's fingerprint) is reported as already patched and left
alone. Anything else is refused, naming what was found and what is supported.

The patch is applied here, in Python, with exact context (no fuzz, no offsets): the
fingerprint already guarantees the text it was made from, so needing `git` or `patch`
on the user's machine would add nothing. `git apply --check` on the snapshot is what the
tests run to show the patch is an ordinary one.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from ..vps.errors import DynatrainError

PATCHES_DIR = Path(__file__).resolve().parents[2] / "patches"


class MegatronLMVersionError(DynatrainError):
    """The checkout is not a Megatron-LM release we have a patch for."""


@dataclass(frozen=True, slots=True)
class Release:
    """A supported Megatron-LM release: its name, patch and the fingerprint of the files
    the patch touches (SHA-256 of their bytes, unpatched)."""

    name: str
    fingerprints: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        if not self.fingerprints or any(len(h) != 64 for _, h in self.fingerprints):
            raise DynatrainError(f"release {self.name}: bad fingerprints {self.fingerprints}")

    @property
    def patch_path(self) -> Path:
        return PATCHES_DIR / f"megatron-lm-{self.name}" / "dynatrain.patch"

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(f for f, _ in self.fingerprints)


RELEASES: tuple[Release, ...] = (
    Release("core_v0.16.1", (
        ("megatron/training/training.py",
         "457cd234a88659aa395a988366e60e61f2c9d16a51df7efc8cc09c1f22fd48b1"),
        ("pretrain_gpt.py", "5a5b8fe909610892146e4d2ef5b303bd9b73bb31dfc96d73f2d0afb8937d4b22"),
    )),
)


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


# ---------------------------------------------------------------------------- releases
def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read(root: Path, rel: str) -> Optional[bytes]:
    p = root / rel
    return p.read_bytes() if p.is_file() else None


def describe_version(root: Path) -> str:
    """What the checkout says about itself, for an error message."""
    info = root / "megatron" / "core" / "package_info.py"
    found = []
    if info.is_file():
        nums = dict(re.findall(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE)\s*=\s*['\"]?([\w.]*)['\"]?",
                               info.read_text(), re.M))
        if {"MAJOR", "MINOR", "PATCH"} <= set(nums):
            found.append(f"megatron-core {nums['MAJOR']}.{nums['MINOR']}.{nums['PATCH']}"
                         f"{nums.get('PRE_RELEASE', '')}")
    for rel in sorted({f for r in RELEASES for f in r.files}):
        data = _read(root, rel)
        found.append(f"{rel} " + ("missing" if data is None else f"sha256 {_sha(data)[:12]}"))
    return ", ".join(found)


@dataclass(frozen=True, slots=True)
class PatchState:
    """A checkout's relation to a supported release."""

    release: Release
    patched: bool


def identify(root: Path, releases: tuple[Release, ...] = RELEASES) -> PatchState:
    """The release `root` is, patched or not; raises `MegatronLMVersionError` otherwise."""
    if not (root / "pretrain_gpt.py").is_file():
        raise MegatronLMVersionError(f"{root} is not a Megatron-LM checkout (no pretrain_gpt.py)")
    for rel in releases:
        current = {f: _read(root, f) for f in rel.files}
        if any(v is None for v in current.values()):
            continue
        if all(_sha(current[f]) == h for f, h in rel.fingerprints):
            return PatchState(rel, patched=False)
        hunks = _hunks(rel)
        if all(f in hunks for f in rel.files):
            originals = {f: apply_hunks(current[f].decode(), hunks[f], reverse=True)
                         for f in rel.files}
            if all(originals[f] is not None and _sha(originals[f].encode()) == h
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


def patch_checkout(root: Path) -> tuple[PatchState, list[str]]:
    """Apply the matching patch to the checkout at `root`. Returns its state before and the
    files written (none when it was already patched)."""
    root = Path(root)
    state = identify(root)
    if state.patched:
        return state, []
    hunks = _hunks(state.release)
    results = {}
    for rel_path, hs in hunks.items():
        text = (root / rel_path).read_text()
        new = apply_hunks(text, hs)
        if new is None:
            raise DynatrainError(f"{rel_path}: the patch for {state.release.name} does not apply "
                                 f"to the file it was made from (the patch file is damaged)")
        results[rel_path] = new
    for rel_path, new in results.items():  # written only once every file applied
        (root / rel_path).write_text(new)
    return state, sorted(results)
