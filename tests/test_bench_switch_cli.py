"""`dynatrain bench-switch`: bad input is refused (exit 2, one line) before any rank spawns.

No timing here: the benchmark itself is run by hand (docs/bench/switch.md).
"""
from __future__ import annotations

import json

import pytest

from dynatrain_megatron import cli
from dynatrain_megatron.cli import bench_switch as cli_bench_switch
from dynatrain_megatron.bench import run as bench_run


@pytest.fixture(autouse=True)
def no_spawn(monkeypatch):
    def boom(*a, **kw):
        raise AssertionError("bench-switch spawned ranks for bad input")

    monkeypatch.setattr(bench_run, "run_bench", boom)


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
    seen = []

    def fake_run(cfg, timeout):
        seen.append(cfg)
        return {"dynatrain_seconds": 1.0}

    monkeypatch.setattr(bench_run, "run_bench", fake_run)
    assert cli.main(BASE + ["--json", "--memory-budget", "1MiB", "--skip", "refit"]) == 0
    assert json.loads(capsys.readouterr().out) == {"dynatrain_seconds": 1.0}
    cfg, = seen
    assert cfg.src == "tp2pp2dp1" and cfg.dst == "tp1pp4dp1"
    assert cfg.memory_budget == 1 << 20 and cfg.skip == ("refit",)
    assert cfg.model_path.endswith("configs/models/tiny-gpt.yaml")
    # the global batch divides both layouts' DP
    tr = cfg.train
    assert tr.global_batch_size % tr.micro_batch_size == 0


def test_train_batch_divides_both_dp():
    tr = cli_bench_switch._train_overrides(2, 4)
    assert tr["global_batch_size"] % 4 == 0 and tr["global_batch_size"] % 2 == 0


def test_config_refuses_what_the_flags_refuse_and_travels_to_ranks():
    import dataclasses
    import pickle

    from dynatrain_megatron.bench.config import BenchConfig
    from dynatrain_megatron.mcore.train_config import TrainConfig
    from dynatrain_megatron.vps.errors import DynatrainError

    good = BenchConfig(model_path="/m.yaml", model_name="m", nproc=4, src="tp2pp2dp1",
                       dst="tp1pp4dp1", train=TrainConfig(), ranks_per_node=4)
    assert pickle.loads(pickle.dumps(good)) == good
    assert good.checkpoint_runs == good.repeat and good.background
    for bad, needle in [(dict(nproc=1), "nproc 1 < 2"), (dict(repeat=0), "repeat 0 < 1"),
                        (dict(skip=("all",)), "can skip only"),
                        (dict(memory_budget=0), "memory_budget 0 is not positive"),
                        (dict(prepare="later"), "prepare 'later'")]:
        with pytest.raises(DynatrainError, match=needle):
            dataclasses.replace(good, **bad)


def test_transfer_probe_wraps_the_executor_and_gives_it_back():
    """Every function the probe times still exists in the executor (a rename would leave
    a part of the transfer split at zero), and closing it restores them."""
    from dynatrain_megatron.bench.measure import TransferProbe
    from dynatrain_megatron.transition import executor as ex

    before = dict(vars(ex.Executor)), ex.checksums
    probe = TransferProbe()
    try:
        assert ex.checksums is not before[1]
        assert vars(ex.Executor)["run_local"] is not before[0]["run_local"]
        ex.checksums([])
        assert set(probe.take()) == {"checksum"}
    finally:
        probe.close()
    assert ex.checksums is before[1]
    assert all(vars(ex.Executor)[k] is v for k, v in before[0].items())
