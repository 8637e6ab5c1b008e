"""A live 4-process job chooses its own layouts (issue 18): started on 2 ranks with 2 on
standby and --dynatrain-auto-layout, it moves to the advisor's best layout of 4 devices;
then `dynatrain request --world 2` without a layout moves it to the advisor's best of 2.
switches.jsonl names who asked, the reason and the ranking's top rows."""
import json
from pathlib import Path

import pytest

from dynatrain_megatron.cli import main as cli
from dynatrain_megatron.loop.auto_layout import LayoutAdvisor
from dynatrain_megatron.testing.multiproc import run_on_ranks
from dynatrain_megatron.mcore.train_config import TrainConfig
from dynatrain_megatron.vps.model_spec import ModelSpec
from rank_cases import main_job_case

pytestmark = pytest.mark.multirank

ROOT = Path(__file__).resolve().parent.parent


def test_job_moves_to_the_advisors_layouts(tmp_path):
    run = tmp_path / "run"
    signal = run / "switch.json"
    run.mkdir()
    # written before the start: read once the auto-layout switch is done (300 iterations
    # leave room for both switches' background preparations, which are timed, not counted
    # in steps: at 60 the job once ended before the second switch was ready)
    assert cli(["request", "--signal-file", str(signal), "--world", "2"]) == 0
    argv = ["--model-config", str(ROOT / "configs/models/tiny-gpt.yaml"),
            "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "300",
            "--lr", "1e-3", "--log-interval", "100", "--dynatrain",
            "--dynatrain-signal-file", str(signal), "--dynatrain-log-dir", str(run),
            "--dynatrain-standby-ranks", "2", "--dynatrain-auto-layout"]
    out = run_on_ranks(main_job_case, 4, str(run), argv)
    assert [o["code"] for o in out] == [0, 0, 0, 0]
    spec = ModelSpec.from_yaml(ROOT / "configs/models/tiny-gpt.yaml")
    adv = LayoutAdvisor(spec, TrainConfig(micro_batch_size=2, global_batch_size=8),
                        transformer_engine=False)
    best4, best2 = adv.ranking(4).best, adv.ranking(2).best
    rows = [r for r in map(json.loads, (run / "switches.jsonl").read_text().splitlines())
            if r["kind"] == "switch"]
    assert [(r["source"], r["src"], r["dst"]) for r in rows] == [
        ("auto", "tp1pp1dp2", str(best4)), ("signal", str(best4), str(best2))]
    assert rows[0]["reason"].startswith("auto-layout: 4 processes, the layout uses 2: "
                                        f"advisor's best of 4 devices is {best4} (top: {best4} ")
    assert rows[1]["reason"].startswith("request for 2 ranks without a layout: advisor's "
                                        f"best of 2 devices is {best2}")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["iteration"] == 300 and summary["layout"] == str(best2)
    assert summary["rejected"] == [] and summary["rolled_back"] == []
    (record,) = run.glob("switch.json.applied.*")  # named after the request it answers
    filed = json.loads(record.read_text())
    assert json.loads(filed["request"])["layout"] is None
    assert record.name == f"switch.json.applied.{filed['id']}" == f"switch.json.applied.{rows[1]['request']}"
