"""Scripted switches (`--dynatrain-schedule FILE`), checked whole at start-up.

The file is YAML: a list of `{iteration: N, layout: "tp2pp2"}` (or a mapping with one key,
`switches`, holding that list). Every defect is an error before the first step, with
every offending entry named: unknown keys, a key given twice in one mapping (YAML would
keep the last silently), an iteration that is not an int (3.7, "abc", true), iterations
out of `1..train_iters`, not increasing, or repeated, a layout that is not a short ASCII
string. The file is read as any file the job reads (`safe_files.read_bytes`): no link,
no FIFO, the job user's or root's, nobody else may write it, at most `MAX_FILE_BYTES`. The layouts themselves are checked by the one validator against
the job's world when the controller starts (`Controller.check_schedule`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import yaml

from ..vps.errors import DynatrainError
from ..safe_files import ReadRules, UnsafeFileError, read_bytes

_KEYS = ("iteration", "layout")
MAX_LAYOUT_CHARS = 64
MAX_FILE_BYTES = 1 << 20
_RULES = ReadRules("schedule", MAX_FILE_BYTES, owner_only=False)


class ScheduleError(DynatrainError):
    """A schedule file that cannot run as written."""


def load_schedule(path: str | Path, train_iters: Optional[int] = None) -> list[tuple[int, str]]:
    """The (iteration, layout) entries of the schedule at `path`, in order; ScheduleError
    listing every defect otherwise."""
    where = f"schedule {path}"
    try:
        text = read_bytes(path, _RULES).decode("utf-8")
    except FileNotFoundError:
        raise ScheduleError(f"{where}: no such file") from None
    except UnsafeFileError as e:
        raise ScheduleError(str(e)) from None
    except UnicodeDecodeError as e:
        raise ScheduleError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
    loader = _StrictLoader(text)
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as e:
        raise ScheduleError(f"{where}: not valid YAML ({str(e)[:300]})") from None
    finally:
        loader.dispose()
    if loader.duplicates:
        raise ScheduleError(f"{where}: " + "; ".join(loader.duplicates))
    if isinstance(data, dict):
        if set(data) != {"switches"}:
            raise ScheduleError(f"{where}: a mapping must have exactly one key, 'switches', "
                                f"got {sorted(map(str, data))}")
        data = data["switches"]
    if not isinstance(data, list) or not data:
        raise ScheduleError(f"{where}: expected a non-empty list of {{iteration, layout}} "
                            f"entries, got {type(data).__name__}")
    errs: list[str] = []
    out: list[tuple[int, str]] = []
    for i, e in enumerate(data):
        errs += _entry_errors(i, e, train_iters)
        if not errs:
            out.append((e["iteration"], e["layout"]))
    for (a, _), (b, _) in zip(out, out[1:]):
        if b <= a:
            errs.append(f"iteration {b} follows iteration {a}: entries must be in increasing "
                        f"order of iteration, each iteration once")
    if errs:
        raise ScheduleError(f"{where}: " + "; ".join(errs))
    return out


def _entry_errors(i: int, e: object, train_iters: Optional[int]) -> list[str]:
    if not isinstance(e, dict):
        return [f"entry {i} must be a mapping {{iteration, layout}}, got {type(e).__name__}"]
    errs = []
    unknown = [str(k)[:40] for k in e if k not in _KEYS]
    if unknown:
        errs.append(f"entry {i} has unknown keys {unknown} (known: {list(_KEYS)})")
    missing = [k for k in _KEYS if k not in e]
    if missing:
        errs.append(f"entry {i} lacks {missing}")
    it, lay = e.get("iteration"), e.get("layout")
    if "iteration" in e:
        if type(it) is not int:
            errs.append(f"entry {i}: iteration must be an int, got {str(it)[:40]!r} "
                        f"({type(it).__name__})")
        elif it < 1 or (train_iters is not None and it > train_iters):
            errs.append(f"entry {i}: iteration {it} outside 1..{train_iters or 'train-iters'}: "
                        f"it would never run")
    if "layout" in e and (type(lay) is not str or not lay.strip() or not lay.isascii()
                          or len(lay) > MAX_LAYOUT_CHARS):
        errs.append(f"entry {i}: layout must be an ASCII string of at most {MAX_LAYOUT_CHARS} "
                    f"characters, got {str(lay)[:40]!r}")
    return errs


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, noting every key given twice in one mapping (the plain loader
    keeps the last one silently: `{iteration: 3, iteration: 9}` would run at 9)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.duplicates: list[str] = []

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` merges, explicit keys win
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                again = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the constructor below says so
                continue
            if again:
                self.duplicates.append(f"key {str(key)[:40]!r} given twice in the mapping at "
                                       f"line {key_node.start_mark.line + 1}")
        return super().construct_mapping(node, deep=deep)
