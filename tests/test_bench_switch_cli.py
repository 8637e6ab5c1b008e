"""`dynatrain bench-switch`: bad input is refused (exit 2, one line) before any rank spawns.

No timing here: the benchmark itself is run by hand (docs/bench/switch.md).
"""
from __future__ import annotations

import json

import pytest

from dynatrain_megatron import cli
from dynatrain_megatron.cli import bench_switch as cli_bench_switch
from dynatrain_megatron.bench import run as bench_switch


@pytest.fixture(autouse=True)
def no_spawn(monkeypatch):
    def boom(*a, **kw):
        raise AssertionError("bench-switch spawned ranks for bad input")

    monkeypatch.setattr(bench_switch, "run_bench", boom)


BASE = ["bench-switch", "--model", "tiny-gpt", "--nproc", "4", "--from", "tp2pp2", "--to", "tp1pp4"]


def _replace(flag: str, value: str) -> list[str]:
    a = list(BASE)
    a[a.index(flag) + 1] = value
    return a


@pytest.mark.parametrize("argv, needle", [
    (_replace("--model", "no-such-model"), "unknown model 'no-such-model'"),
    (_replace("--model", "/nonexistent/x.yaml"), "not found"),
    (_replace("--from", "tp2px2"), "malformed layout"),
    (_replace("--to", "tp3pp1"), "does not divide world size 4"),
    (["bench-switch", "--model", "tiny-gpt", "--nproc", "8", "--from", "tp8pp1", "--to",
      "tp1pp8"], "num_query_groups 4 % tp 8"),
    (_replace("--to", "tp1pp2dp4"), "dp4 but world size 4"),
    (_replace("--nproc", "1"), "--nproc must be >= 2"),
    (BASE + ["--repeat", "0"], "--repeat must be >= 1"),
    (BASE + ["--ckpt-repeat", "0"], "--ckpt-repeat must be >= 1"),
    (BASE + ["--iters-before", "0"], "--iters-before must be >= 1"),
    (BASE + ["--memory-budget", "lots"], "not a byte size"),
    (BASE + ["--memory-budget", "0"], "--memory-budget must be positive"),
    (BASE + ["--skip", "everything"], "can skip only"),
    (_replace("--to", "tp1pp2cp2"), "context parallelism"),
    (BASE + ["--ckpt-dir", "/nonexistent/dir"], "is not a writable directory"),
])
def test_bad_input_exits_2_with_one_line(argv, needle, capsys):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith("dynatrain bench-switch: error:")
    assert needle in err, err


def test_registered_and_good_input_reaches_the_runner(monkeypatch, capsys):
    seen = {}

    def fake_run(cfg, timeout):
        seen.update(cfg)
        return {"dynatrain_seconds": 1.0}

    monkeypatch.setattr(bench_switch, "run_bench", fake_run)
    assert cli.main(BASE + ["--json", "--memory-budget", "1MiB", "--skip", "refit"]) == 0
    assert json.loads(capsys.readouterr().out) == {"dynatrain_seconds": 1.0}
    assert seen["src"] == "tp2pp2dp1" and seen["dst"] == "tp1pp4dp1"
    assert seen["memory_budget"] == 1 << 20 and seen["skip"] == ["refit"]
    assert seen["model_path"].endswith("configs/models/tiny-gpt.yaml")
    # the global batch divides both layouts' DP
    tr = seen["train"]
    assert tr["global_batch_size"] % tr["micro_batch_size"] == 0


def test_train_batch_divides_both_dp():
    tr = cli_bench_switch._train_overrides(2, 4)
    assert tr["global_batch_size"] % 4 == 0 and tr["global_batch_size"] % 2 == 0
