"""Running Megatron-LM's own pretrain_gpt.py (a copy of the snapshot) on gloo ranks in
torchrun's environment (forked after one import: `torchrun_cmd`), reading its losses from
the log and its checkpoints as logical tensors."""
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
UNPATCHED_SITE = Path(__file__).with_name("megatron_lm_unpatched")  # its sitecustomize

# a tiny GPT on mock data with the flags Megatron-LM needs on the CPU (README)
CPU_FLAGS = [
    "--distributed-backend", "gloo", "--transformer-impl", "local",
    "--no-rope-fusion", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
    "--no-bias-dropout-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
    "--no-masked-softmax-fusion",
]
TINY_MODEL = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "8",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--use-distributed-optimizer",
    "--log-interval", "1", "--eval-iters", "1",
    "--seed", "1234", "--ckpt-format", "torch_dist", "--dist-ckpt-optim-fully-reshardable",
]
MOCK_DATA = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
             "--split", "99,1,0"]
TINY_GPT = TINY_MODEL + MOCK_DATA + ["--eval-interval", "1000"]

LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")
# Megatron-LM's validation line: during training ("at iteration N") and after it ("at
# iteration N on validation set")
VALID = re.compile(r"validation loss at iteration (\d+)( on validation set)? \| "
                   r"lm loss value: ([0-9.E+-]+)")


def layout_flags(tp: int, pp: int, **extra: int) -> list[str]:
    out = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    for k, v in extra.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def job_env(tree: Path, *, patched: bool = True, extra: Optional[dict] = None,
            site: Optional[Path] = None) -> dict:
    """The environment of a Megatron-LM job of `tree`: this package and the tree importable
    (an unpatched tree also gets the CPU runtime from `megatron_lm_unpatched/sitecustomize.py`;
    a patched one the `sitecustomize.py` in `site`, if given), one thread per rank, and what
    Megatron-LM asserts about CUDA connections."""
    path = ([str(site)] if site else []) + [str(ROOT), str(tree)]
    if not patched:
        path = [str(UNPATCHED_SITE), str(ROOT), str(tree)]
    return dict(os.environ, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1",
                PYTHONPATH=os.pathsep.join(path), **(extra or {}))


def with_data_cache(flags: list[str]) -> list[str]:
    """`flags` with Megatron-LM's `--data-cache-path` set to the session's cache
    (`DYNATRAIN_TEST_DATA_CACHE`, conftest.py) for mock data that names none: rank 0 builds
    a split's indices once and saves them, the other ranks (and later jobs of the same
    sizes) load them, as a job on a real corpus does by default, instead of every rank
    shuffling ~2M mock samples per split."""
    cache = os.environ.get("DYNATRAIN_TEST_DATA_CACHE")
    if not cache or "--mock-data" not in flags or "--data-cache-path" in flags:
        return list(flags)
    return [*flags, "--data-cache-path", cache]


def torchrun_cmd(tree: Path, nproc: int, flags: list[str],
                 script: Optional[Path] = None) -> list[str]:
    """The command of `tree`'s pretrain_gpt.py (or another job `script` run in the tree) on
    `nproc` ranks: the workers forked after
    one import of torch and Megatron-LM, in torchrun's environment
    (`dynatrain_megatron/testing/forked_launch.py`: most of a tiny job's start-up on 2
    cores), through the session's preloaded launcher for the same script and environment
    where the session has them (`testing/launch_server.py`, `DYNATRAIN_TEST_LAUNCH_SERVERS`);
    `DYNATRAIN_TEST_LAUNCHER=torchrun`: the plain torchrun command (the README's
    quickstart test always runs that)."""
    script = str(script or tree / "pretrain_gpt.py")
    flags = with_data_cache(flags)
    if os.environ.get("DYNATRAIN_TEST_LAUNCHER") == "torchrun":
        return [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), script, *flags]
    servers = os.environ.get("DYNATRAIN_TEST_LAUNCH_SERVERS")
    if servers:  # the session's preloaded launchers (conftest.py)
        return [sys.executable, "-m", "dynatrain_megatron.testing.launch_server",
                "--server-dir", servers, "--owner-pid", str(os.getpid()),
                "--nproc-per-node", str(nproc), script, *flags]
    return [sys.executable, "-m", "dynatrain_megatron.testing.forked_launch",
            "--nproc-per-node", str(nproc), script, *flags]


def run_megatron_lm(tree: Path, nproc: int, flags: list[str], log: Path, *,
                    patched: bool = True, timeout: float = 900,
                    env: Optional[dict] = None, script: Optional[Path] = None) -> str:
    """Run pretrain_gpt.py of `tree` (or `script`, a job run in the tree) on `nproc` gloo
    ranks; returns the log text. An unpatched tree gets the CPU runtime from
    `megatron_lm_unpatched/sitecustomize.py`."""
    env = job_env(tree, patched=patched, extra=env)
    cmd = torchrun_cmd(tree, nproc, flags, script)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT,
                              timeout=timeout)
    text = log.read_text()
    if proc.returncode != 0:
        raise AssertionError(f"Megatron-LM exited {proc.returncode}; log {log}:\n{text[-6000:]}")
    return text


# Megatron-LM's iteration line (printed by the world's last rank), or ours from rank 0 while
# the last rank is on standby
DONE = re.compile(r"\] iteration\s+(\d+)/|dynatrain: iteration (\d+) done at")


def run_operated(tree: Path, nproc: int, flags: list[str], log: Path, signal: Path,
                 requests: dict, *, env: Optional[dict] = None,
                 site: Optional[Path] = None) -> str:
    """Run pretrain_gpt.py of `tree` under torchrun and, as each iteration shows in its log,
    write the request due after it to the signal file (as `dynatrain request` does), once
    the job has taken the previous one (a request is never written over another). `env`,
    `site`: as `job_env`'s `extra` and `site`."""
    from dynatrain_megatron.elastic.signal_file import write_request

    env = job_env(tree, extra=env, site=site)
    cmd = torchrun_cmd(tree, nproc, flags)
    print("+ torchrun --standalone --nproc-per-node", nproc, "pretrain_gpt.py",
          " ".join(f for f in flags if f.startswith("--dynatrain") or f.startswith("--t")
                   or f.startswith("--p")), flush=True)
    pending = dict(requests)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in proc.stdout:
            f.write(line)
            m = DONE.search(line)
            if "switched" in line and "dynatrain" in line and "INFO" in line:
                print("  " + line.split("INFO:dynatrain:")[-1].strip()[:150], flush=True)
            if not m:
                continue
            it = int(m.group(1) or m.group(2))
            for due in sorted(k for k in pending if k <= it):
                if signal.exists():
                    break  # the previous request is not taken yet
                layout, world = pending.pop(due)
                write_request(signal, layout, world)
                print(f"[operator] after iteration {it}: requested {layout}"
                      + (f" on {world} ranks" if world else ""), flush=True)
        rc = proc.wait()
    text = log.read_text()
    if rc != 0:
        raise AssertionError(f"Megatron-LM exited {rc}; log {log}:\n{text[-4000:]}")
    return text


def losses(text: str) -> dict[int, str]:
    """iteration -> the loss as Megatron-LM printed it (printed once, by the last rank)."""
    out: dict[int, str] = {}
    for it, loss in LOSS.findall(text):
        out[int(it)] = loss
    return out


def validation_losses(text: str) -> dict[tuple[int, bool], str]:
    """(iteration, after training) -> the validation loss Megatron-LM printed."""
    return {(int(it), bool(final)): loss for it, final, loss in VALID.findall(text)}


def log_windows(iterations: list[int]) -> dict[int, list[int]]:
    """For one Megatron-LM process that logs every iteration (`--log-interval 1`) and
    trained `iterations`: the iterations whose mean loss it prints at each of them.

    training_log() sums the loss since its last reset and prints the sum over the count;
    the first iteration of a process prints but does not reset (core_v0.16.1 training.py:
    `should_reset = not is_first_iteration`, meant for a first print ahead of a longer
    interval). With an interval of 1 the second print is thus the mean of the first two
    iterations, in a fresh run (iteration 2) as after `--load` (K+2): a Megatron-LM bug,
    NVIDIA/Megatron-LM#6237 (fixed upstream by #7092), in the printed loss only."""
    its = sorted(iterations)
    out = {i: [i] for i in its}
    if len(its) > 1:
        out[its[1]] = its[:2]
    return out


def _float32s_printed_as(text: str) -> list[float]:
    """Every float32 value that Megatron-LM's `{:.6E}` prints as `text` (7 digits: a few
    float32 values each)."""
    import numpy as np

    def shows(v) -> bool:
        return f"{float(v):.6E}" == text

    lo = hi = np.float32(float(text))
    if not shows(lo):
        raise ValueError(f"no float32 prints as {text!r}")
    while shows(np.nextafter(lo, np.float32(-np.inf))):
        lo = np.nextafter(lo, np.float32(-np.inf))
    while shows(np.nextafter(hi, np.float32(np.inf))):
        hi = np.nextafter(hi, np.float32(np.inf))
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v = np.nextafter(v, np.float32(np.inf))
    return out


def printable_means(printed: list[str]) -> set[str]:
    """Every loss training_log() can print as the mean over a window of iterations whose
    own losses printed as `printed`: it adds the float32 losses into a float32 tensor (from
    0) and divides `.item()` by the count. Exact up to what the prints keep: for one
    iteration, just `{printed[0]}`; for more, each print stands for its float32 values."""
    import itertools

    import numpy as np

    out = set()
    for values in itertools.product(*map(_float32s_printed_as, printed)):
        total = np.float32(0.0)
        for v in values:
            total = np.float32(total + v)
        out.add(f"{float(total) / len(values):.6E}")
    return out


def checkpoint_tensors(ckpt_dir: Path, iteration: int) -> dict[str, object]:
    """Every entry of a torch_dist checkpoint as one logical (global) object: tensors whole,
    whatever layout saved them (torch.distributed.checkpoint's reader, no process group)."""
    src = ckpt_dir / f"iter_{iteration:07d}"
    out = ckpt_dir.parent / f"{ckpt_dir.name}-{iteration}.pt"
    return _load_as_plain("dcp", src, out)


def load_common(iteration_dir: Path) -> dict:
    """A checkpoint's common state (Megatron-LM's args, iteration, ...), read by
    megatron-core's own `load_common_state_dict`: core_v0.16.1 keeps it in `common.pt`,
    core_v0.19.0 inside the torch_dist checkpoint (its `common_state` object)."""
    return _load_as_plain("common", iteration_dir, iteration_dir / "common.plain.pt")


# Read in an interpreter whose megatron.core is the snapshot's: a checkpoint pickles objects
# of the megatron-core that wrote it (args holding its enums), which the test process's own
# megatron-core (the 0.16.1 wheel) may not have. There they become plain objects (an
# argparse.Namespace of plain values, an enum its name), compared as before. One reader per
# snapshot serves the whole session (a request per line on its stdin, the answer on a pipe of
# its own): a fresh interpreter per checkpoint paid the imports of torch and the snapshot's
# megatron-core again, seconds of CPU each, two or three times per Megatron-LM test.
_READER = """
import argparse, enum, json, os, sys, traceback, torch
answers = os.fdopen(os.dup(1), 'w')
os.dup2(2, 1)  # whatever the libraries print goes to the reader's log, not to the answers
from dynatrain_megatron.compat.megatron_lm import prepare_megatron_lm
prepare_megatron_lm()
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from megatron.core.dist_checkpointing import load_common_state_dict

def plain(x):
    if torch.is_tensor(x) or x is None or isinstance(x, (bool, int, float, str, bytes)):
        return x
    if type(x).__module__ == 'numpy':
        return x
    if isinstance(x, enum.Enum):
        return f'{type(x).__name__}.{x.name}'
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(plain(v) for v in x)
    if isinstance(x, argparse.Namespace):
        return argparse.Namespace(**{k: plain(v) for k, v in vars(x).items()})
    return repr(x)

for line in sys.stdin:
    kind, src, out = json.loads(line)
    try:
        if kind == 'dcp':
            dcp_to_torch_save(src, out)
            obj = torch.load(out, weights_only=False)
        else:
            obj = load_common_state_dict(src)
        torch.save(plain(obj), out)
        answer = 'ok'
    except BaseException:
        answer = traceback.format_exc()
    answers.write(json.dumps(answer) + '\\n')
    answers.flush()
"""
_READERS: dict = {}


def _reader(snapshot: Path) -> subprocess.Popen:
    """The session's reader for `snapshot`, started at its first use (ended at exit)."""
    import atexit
    import tempfile

    proc = _READERS.get(snapshot)
    if proc is None or proc.poll() is not None:
        log = tempfile.NamedTemporaryFile(prefix="dynatrain-reader-", suffix=".log",
                                          delete=False)
        proc = subprocess.Popen([sys.executable, "-c", _READER], env=job_env(snapshot),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                text=True)
        proc.log_path = log.name  # type: ignore[attr-defined]
        _READERS[snapshot] = proc

        def end() -> None:
            proc.kill()
            Path(log.name).unlink(missing_ok=True)

        atexit.register(end)
    return proc


def _read_in_reader(snapshot: Path, kind: str, src: Path, out: Path) -> None:
    import json
    import select

    proc = _reader(snapshot)
    proc.stdin.write(json.dumps([kind, str(src), str(out)]) + "\n")
    proc.stdin.flush()
    ready, _, _ = select.select([proc.stdout], [], [], 600)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        _READERS.pop(snapshot, None)
        tail = Path(proc.log_path).read_text(errors="replace")[-3000:]
        raise AssertionError(f"reading {src}: the reader ended or hung:\n{tail}")
    answer = json.loads(line)
    if answer != "ok":
        raise AssertionError(f"reading {src} failed:\n{answer[-3000:]}")


def _load_as_plain(kind: str, src: Path, out: Path) -> dict:
    from megatron_lm_tree import require_snapshot

    snapshot = require_snapshot()
    if (snapshot / "megatron" / "core").is_dir():  # a checkout with its own megatron-core
        _read_in_reader(snapshot, kind, src, out)
        return torch.load(out, weights_only=False)
    if kind == "common":
        from megatron.core.dist_checkpointing import load_common_state_dict

        return load_common_state_dict(str(src))
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(src), str(out))
    return torch.load(out, weights_only=False)


def _same(x, y) -> bool:
    """Bit-for-bit equality of tensors (as bytes), arrays, and containers of them."""
    import numpy as np

    if torch.is_tensor(x) or torch.is_tensor(y):
        return (torch.is_tensor(x) and torch.is_tensor(y) and x.dtype == y.dtype
                and x.shape == y.shape and torch.equal(x.reshape(-1).view(torch.uint8),
                                                       y.reshape(-1).view(torch.uint8)))
    if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        return (isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and x.dtype == y.dtype
                and x.shape == y.shape and x.tobytes() == y.tobytes())
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(map(_same, x, y))
    return type(x) is type(y) and x == y


def differences(a: dict, b: dict, *, skip=lambda key: False) -> list[str]:
    """Keys whose values are not bit-identical. A `common_state/` entry (from 0.19 on,
    Megatron-LM writes its common state into the checkpoint as well) is compared without its
    `args`, which describe the run (its paths and flags), not the training state."""
    diff = []
    for k in sorted(set(a) | set(b)):
        if skip(k):
            continue
        if k not in a or k not in b:
            diff.append(f"{k}: only in {'first' if k in a else 'second'}")
        elif not _same(*(_without_args(x) if str(k).startswith("common_state/") else x
                         for x in (a[k], b[k]))):
            diff.append(f"{k}: {type(a[k]).__name__} values differ")
    return diff


def _without_args(x):
    if isinstance(x, dict):
        return {k: v for k, v in x.items() if k != "args"}
    if isinstance(x, (list, tuple)):
        return type(x)(map(_without_args, x))
    return x


def run_launched(tree: Path, nproc: int, flags: list[str], log: Path, *, env: dict,
                 timeout: float = 900, forked: bool = True) -> tuple[int, str]:
    """Run pretrain_gpt.py of `tree` on `nproc` gloo ranks supervised as under `dynatrain
    launch` (a worker that dies does not stop the others); returns (the launcher's status,
    the log). `forked`: the workers are forked after one import (`forked_launch
    --survivors`, the same supervision, `loop.launch.supervise`); else `dynatrain launch`
    itself starts an interpreter per rank."""
    full = job_env(tree, extra=env)
    if forked:
        cmd = [sys.executable, "-m", "dynatrain_megatron.testing.forked_launch", "--survivors",
               "--nproc-per-node", str(nproc)]
    else:
        cmd = [sys.executable, "-m", "dynatrain_megatron.cli", "launch", "--nproc-per-node",
               str(nproc)]
    cmd += [str(tree / "pretrain_gpt.py"), *with_data_cache(flags)]
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=tree, env=full, stdout=f, stderr=subprocess.STDOUT,
                              timeout=timeout)
    return proc.returncode, log.read_text()


# ---------------------------------------------------------------- switch vs restart
def switch_and_restart(w: Path, common: list[str], a: list[str], b: list[str], layout_b: str,
                       k: int, *, before: Sequence[tuple[int, str]] = (),
                       env: Optional[dict] = None, plain: bool = False,
                       switched_flags: Sequence[str] = (), own_save: bool = False) -> dict:
    """The three torchrun jobs (4 gloo ranks) that compare an in-memory switch with
    Megatron-LM's own restart, on copies of the snapshot under `w`:

    * switched: patched, `--dynatrain-schedule` switches A -> `layout_b` after iteration `k`,
      trains to the end of `common`'s `--train-iters` and `--save`s there;
    * saved: the UNPATCHED tree (CPU runtime from a sitecustomize) trains A to `k` and saves;
    * resumed: patched, without `--dynatrain`, `--load`s that at B and trains to the end.

    `a`/`b`: the flags of each layout; `before`: (iteration, layout) entries scheduled ahead
    of B's, `env` and `switched_flags` for the switched run only (a fault plan that makes
    them fail; more `--dynatrain*` flags). With `plain`,
    the unpatched run goes on to the end (saving at `k` on the way) and a fourth job, the
    patched tree WITHOUT `--dynatrain`, trains A to the end: "plain". With `own_save`, two
    jobs only: the switched run itself `--save`s A's state at `k` (Megatron-LM saves before
    the step boundary where the switch lands) and the restart loads that; there is no
    "saved" log (the unpatched tree is the reference where a case needs its losses before
    `k`). Returns the logs by name and `w`."""
    from megatron_lm_tree import copy_tree

    patched = copy_tree(w / "patched", patched=True)
    unpatched = copy_tree(w / "unpatched", patched=False)
    sched = w / "schedule.yaml"
    sched.write_text("".join(f"- {{iteration: {i}, layout: {lay}}}\n"
                             for i, lay in [*before, (k, layout_b)]))
    switched = run_megatron_lm(
        patched, 4, common + a + ["--save", str(w / "switched"),
                                  "--save-interval", str(k) if own_save else "1000",
                                  "--dynatrain", "--dynatrain-schedule", str(sched),
                                  *switched_flags],
        w / "switched.log", env=env)
    out = dict(w=w, switched=switched)
    if not own_save:
        out["saved"] = run_megatron_lm(
            unpatched, 4, common + a + ["--save", str(w / "saved"), "--save-interval", str(k)]
            + ([] if plain else ["--exit-interval", str(k)]),
            w / "saved.log", patched=False)
    out["resumed"] = run_megatron_lm(
        patched, 4, common + b + ["--load", str(w / ("switched" if own_save else "saved")),
                                  "--ckpt-step", str(k),
                                  "--save", str(w / "resumed"), "--save-interval", "1000"],
        w / "resumed.log")
    if plain:
        out["plain"] = run_megatron_lm(patched, 4, common + a, w / "plain.log")
    return out


def switch_lines(text: str) -> list[tuple[str, str, str]]:
    """(iteration, from, to) of every `iteration N: switched A -> B` log line (rank 0 logs
    one per switch, with the stall of its slowest rank)."""
    return [m[:3] for m in re.findall(r"iteration (\d+): switched (\S+) -> (\S+) .*", text)]


def assert_losses_as_restart(runs: dict, k: int, n: int) -> None:
    """The switched run's losses: before `k` the unpatched tree's, after it the restart's,
    every iteration. Each print is the mean over its log window (`log_windows`): Megatron-LM
    prints mean(K+1, K+2) at K+2 after `--load`, while the switched process, training since
    iteration 1, prints K+2's own loss (its only mean is at iteration 2, as the unpatched
    tree's). The prints keep 7 digits, so the restart's mean is checked against every float32
    sum those digits allow (`printable_means`; a single iteration's set is its print)."""
    sw, resumed = losses(runs["switched"]), losses(runs["resumed"])
    assert sorted(sw) == list(range(1, n + 1)) and sorted(resumed) == list(range(k + 1, n + 1))
    if "saved" in runs:  # else the restart resumed the switched run's own save at k
        saved = losses(runs["saved"])
        assert [sw[i] for i in range(1, k + 1)] == [saved[i] for i in range(1, k + 1)]
    ours, theirs = log_windows(list(sw)), log_windows(list(resumed))
    assert theirs[k + 2] == [k + 1, k + 2]
    for i in range(k + 1, n + 1):
        assert all(ours[j] == [j] for j in theirs[i])
        window = [sw[j] for j in theirs[i]]
        assert resumed[i] in printable_means(window), (i, resumed[i], window)


def assert_switched_as_scheduled(text: str, k: int, a: str, b: str,
                                 rolled_back: bool = False) -> None:
    """The job switched `a` -> `b` once, exactly after iteration `k`, as scheduled (one line,
    from rank 0, with the stall); no switch was rolled back (unless `rolled_back`: the test
    made one fail)."""
    lines = switch_lines(text)
    assert lines == [(str(k), a, b)], lines
    assert re.search(rf"iteration {k}: switched .* stall [0-9.]+ s \[", text)
    assert all("as scheduled" in m.group(0)
               for m in re.finditer(r"iteration \d+: switched .*", text))
    assert rolled_back or "rolled back" not in text


def assert_final_checkpoints_identical(runs: dict, n: int) -> dict:
    """The switched and the resumed runs' checkpoints at `n`, as logical tensors, equal entry
    for entry, bit for bit: the model, the fp32 main params and both Adam moments of every
    tensor, the scheduler, the optimizer's param groups and step; everything but the
    per-rank RNG states (a switch does not carry them). Returns the switched run's."""
    ours = checkpoint_tensors(runs["w"] / "switched", n)
    theirs = checkpoint_tensors(runs["w"] / "resumed", n)
    diff = differences(ours, theirs, skip=lambda k: k.startswith("rng_state"))
    assert not diff, diff[:10]
    kinds = {k.split(".")[2] for k in ours if k.startswith("optimizer.state.")}
    # the fp32 main copy: `param` of the distributed optimizer, `fp32_param` of a plain one
    assert kinds in ({"exp_avg", "exp_avg_sq", "param"}, {"exp_avg", "exp_avg_sq", "fp32_param"})
    return ours


def job_processes(tree: Path, grace: float = 10.0) -> list[str]:
    """The processes of a Megatron-LM job of `tree` still running (`pid: command line`,
    read from /proc: any whose command line names the tree's pretrain_gpt.py, the ranks and
    whatever they forked, but the session's preloaded launch servers) after up to `grace`
    seconds for them to end; those are then killed, so that a failing check leaves nothing
    behind."""
    import signal
    import time

    from dynatrain_megatron.testing.launch_server import server_pids

    script = str(tree / "pretrain_gpt.py").encode()
    servers = os.environ.get("DYNATRAIN_TEST_LAUNCH_SERVERS")
    skip = {os.getpid()} | (server_pids(Path(servers)) if servers else set())

    def running() -> dict[int, str]:
        out = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in skip:
                continue
            try:
                cmd = (entry / "cmdline").read_bytes()
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if script in cmd and state != "Z":
                out[int(entry.name)] = cmd.replace(b"\0", b" ").decode(errors="replace")[:200]
        return out

    deadline = time.monotonic() + grace
    left = running()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = running()
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return [f"{pid}: {cmd}" for pid, cmd in sorted(left.items())]
