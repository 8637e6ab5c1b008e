"""The README's commands run as written, its support matrix is the generated one, and it
stays short.

Every ```bash block of README.md follows a marker line saying what CI does with it:
- `<!-- ci: run -->`: run as written (cheap `dynatrain` commands);
- `<!-- ci: megatron-lm (...) -->`: the quickstart, run as written on the Megatron-LM
  snapshot: `git clone ... Megatron-LM.git DIR` becomes a copy of the snapshot into DIR
  (CI has no network; the snapshot is an export of that tag);
- `<!-- ci: parse (...) -->`: GPU-only: every command is parsed by its own parser
  (`dynatrain`, torchrun, Megatron-LM's with our flags), nothing runs;
- `<!-- ci: skip (reason) -->`: installs and `make` targets, with the reason.
Paths under `/tmp/dynatrain-demo` are moved into the test's temporary directory.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DEMO = "/tmp/dynatrain-demo"
MARKED = re.compile(r"<!-- ci: ([a-z-]+)(?: \(([^)]*)\))? -->\n```bash\n(.*?)```", re.S)
KINDS = {"run", "megatron-lm", "parse", "skip"}
CLONE = re.compile(r"^git clone .*--branch (\S+) .*Megatron-LM\.git (\S+)$", re.M)

sys.path.insert(0, str(ROOT / "scripts"))
import support_matrix  # noqa: E402


def blocks(kind: str | None = None) -> list[tuple[str, str, str]]:
    """(kind, reason, body) of every marked bash block."""
    out = [(m.group(1), m.group(2) or "", m.group(3))
           for m in MARKED.finditer(README.read_text())]
    return [b for b in out if kind is None or b[0] == kind]


def commands(body: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and blanks dropped."""
    joined = re.sub(r"\\\n\s*", " ", body)
    return [ln.split(" #")[0].strip() for ln in joined.splitlines()
            if ln.strip() and not ln.lstrip().startswith("#")]


def shell_env() -> dict:
    bin_dir = str(Path(sys.executable).parent)
    return dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""),
                PYTHONPATH=str(ROOT))


def run_block(body: str, tmp_path: Path, timeout: float) -> subprocess.CompletedProcess:
    script = "set -euo pipefail\n" + body.replace(DEMO, str(tmp_path / "dynatrain-demo"))
    (tmp_path / "dynatrain-demo").mkdir(exist_ok=True)
    return subprocess.run(["bash", "-c", script], cwd=ROOT, env=shell_env(),
                          capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------ structure
def test_every_shell_block_is_marked_for_ci():
    text = README.read_text()
    fences = len(re.findall(r"^```bash$", text, re.M))
    found = blocks()
    assert fences == len(found), "a ```bash block without a `<!-- ci: ... -->` line before it"
    assert {k for k, _, _ in found} <= KINDS
    for kind, reason, _ in found:
        assert kind in ("run",) or reason, f"ci: {kind} needs a reason in parentheses"
    assert blocks("megatron-lm"), "the quickstart must be run by CI"


def test_readme_is_short_and_links_no_shared_path():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"{len(lines)} lines"
    text = README.read_text()
    assert "../shared" not in text
    assert not [s for s in sentences(text) if len(s.split()) > 60]


def sentences(text: str) -> list[str]:
    """The README's prose sentences: code blocks, tables and comments left out; list items,
    headings and paragraphs end a sentence."""
    prose = re.sub(r"```.*?```|<!--.*?-->|^\|[^\n]*\|$", "", text, flags=re.S | re.M)
    prose = re.sub(r"\n(?=- |\d+\. |#)", "\n\n", prose)
    out = []
    for para in re.split(r"\n\s*\n", prose):
        out += re.split(r"(?<=[.!?])\s+", " ".join(para.split()))
    return [s for s in out if s]


def test_support_matrix_is_the_generated_one():
    assert support_matrix.readme_section(README.read_text()) == support_matrix.section(), \
        "README.md's support matrix is stale: python scripts/support_matrix.py --write"


def test_every_relative_link_resolves_or_is_a_page_in_progress():
    """Relative links point at files of the checkout."""
    for target in re.findall(r"\]\(([^)#]+)\)", README.read_text()):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), target


# ------------------------------------------------------------------ the commands
def test_cheap_blocks_run_as_written(tmp_path):
    ran = 0
    for _, _, body in blocks("run"):
        p = run_block(body, tmp_path, timeout=600)
        assert p.returncode == 0, f"{body}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        ran += 1
    assert ran >= 3
    # what the request block wrote is a request the job would take
    req = tmp_path / "dynatrain-demo" / "switch.json"
    assert req.is_file() and '"layout": "tp1pp2dp2"' in req.read_text()


def test_gpu_blocks_parse(tmp_path):
    """GPU-only commands: `dynatrain` by its parser, torchrun's options by torchrun's, the
    script's flags by Megatron-LM's own parser with our flags (nothing is run)."""
    from megatron_lm_runs import job_env
    from megatron_lm_tree import require_snapshot
    from torch.distributed.run import get_args_parser

    from dynatrain_megatron import cli

    tree = require_snapshot()
    checked = 0
    for _, _, body in blocks("parse"):
        for cmd in commands(body):
            argv = [a for a in shlex.split(re.sub(r"<[^>]*>", "", cmd))]
            if argv[0] == "export":
                continue
            if argv[0] == "dynatrain":
                cli.build_parser().parse_args(argv[1:])
            elif argv[0] == "torchrun":
                targs = get_args_parser().parse_args(argv[1:])
                assert Path(targs.training_script).name == "pretrain_gpt.py"
                _megatron_parses(tree, targs.training_script_args, job_env(tree))
            else:
                raise AssertionError(f"no parser for {argv[0]!r}: {cmd}")
            checked += 1
    assert checked >= 1


def _megatron_parses(tree: Path, flags: list[str], env: dict) -> None:
    code = ("import sys, os\n"
            "os.environ.setdefault('WORLD_SIZE', '8'); os.environ.setdefault('RANK', '0')\n"
            "from dynatrain_megatron.compat.megatron_lm import prepare_megatron_lm\n"
            "prepare_megatron_lm()\n"
            "from megatron.training.arguments import parse_args\n"
            "from dynatrain_megatron.megatron_lm.arguments import chain_extra_args_providers\n"
            "sys.argv = ['pretrain_gpt.py'] + sys.argv[1:]\n"
            "parse_args(extra_args_provider=chain_extra_args_providers())\n"
            "print('parsed')\n")
    p = subprocess.run([sys.executable, "-c", code, *flags], cwd=tree, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "parsed" in p.stdout, p.stderr[-3000:]


@pytest.mark.multirank
def test_the_megatron_lm_quickstart_reaches_a_switch(tmp_path):
    """The quickstart block as written (4 gloo ranks of the snapshot's pretrain_gpt.py):
    it patches a copy, trains, switches after iteration 3 and finishes. ~1-2 min."""
    from megatron_lm_tree import SHARED

    (_, _, body), = blocks("megatron-lm")
    clone = CLONE.search(body)
    assert clone, "the quickstart clones a Megatron-LM release tag"
    tree = SHARED / clone.group(1)  # the export of that tag
    if not (tree / "pretrain_gpt.py").is_file():
        pytest.skip(f"no Megatron-LM snapshot of {clone.group(1)} at {tree}")
    body = CLONE.sub(lambda m: f"mkdir -p $(dirname {m.group(2)}) && cp -r {tree} "
                               f"{m.group(2)} && chmod -R u+w {m.group(2)}", body)
    p = run_block(body, tmp_path, timeout=1200)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    assert "patched (megatron/training/training.py, pretrain_gpt.py)" in out
    assert "iteration 3: switched tp2pp2dp1 -> tp1pp2dp2" in out, out[-6000:]
    assert re.search(r"iteration\s+6/\s+6 \|", out)
    assert "dynatrain switches:" in out
