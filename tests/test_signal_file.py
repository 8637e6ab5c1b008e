"""Signal-file requests: atomic write, refusal of unsafe or corrupt files (pure)."""
import json
import os

import pytest

from dynatrain_megatron.cli import main as cli
from dynatrain_megatron.elastic.signal_file import RequestError, archive, read_request, write_request


def test_write_then_read_roundtrip(tmp_path):
    p = tmp_path / "switch.json"
    write_request(p, "tp4pp1dp1", 4)
    req = read_request(p)
    assert (req.layout, req.world) == ("tp4pp1dp1", 4)
    assert oct(p.stat().st_mode & 0o777) == oct(0o600)
    assert [x.name for x in tmp_path.iterdir()] == ["switch.json"]  # no temp file left


def test_no_file_no_request(tmp_path):
    assert read_request(tmp_path / "missing.json") is None


@pytest.mark.parametrize("text,match", [
    ("{not json", "not valid JSON"),
    ('["tp2"]', "JSON object"),
    ('{"origin": "me"}', "no 'layout'"),
    ('{"layout": null}', "or a 'world'"),
    ('{"layout": "tp2", "evil": 1}', "unknown fields"),
    ('{"layout": ""}', "non-empty"),
    ('{"layout": "tp2", "world": -1}', "positive int"),
])
def test_corrupt_requests_are_refused(tmp_path, text, match):
    p = tmp_path / "s.json"
    p.write_text(text)
    os.chmod(p, 0o600)
    with pytest.raises(RequestError, match=match):
        read_request(p)


def test_world_writable_file_is_refused(tmp_path):
    p = tmp_path / "s.json"
    write_request(p, "tp2pp2")
    os.chmod(p, 0o666)
    with pytest.raises(RequestError, match="world-writable"):
        read_request(p)


def test_archive_keeps_outcome_and_reason(tmp_path):
    p = tmp_path / "s.json"
    r1 = write_request(p, "tp2pp2")
    a = archive(p, "rejected", "bad layout")
    r2, b = write_request(p, "tp2pp2"), archive(p, "rejected", "again")
    # named after the request they answer; one without an id is numbered
    assert not p.exists() and a.name == f"s.json.rejected.{r1.id}" != b.name
    assert b.name == f"s.json.rejected.{r2.id}"
    p.write_text('{"layout": "tp2pp2"}')
    assert archive(p, "rejected", "no id").name == "s.json.rejected.0"
    rec = json.loads(a.read_text())
    assert rec["outcome"] == "rejected" and rec["reason"] == "bad layout"
    assert json.loads(rec["request"])["layout"] == "tp2pp2"


def test_request_cli_writes_and_rejects_malformed(tmp_path, capsys):
    p = tmp_path / "s.json"
    assert cli(["request", "--signal-file", str(p), "--layout", "tp2pp2", "--world", "8"]) == 0
    assert read_request(p).layout == "tp2pp2"
    assert cli(["request", "--signal-file", str(tmp_path / "t.json"), "--layout", "tpX"]) == 2
    assert "malformed layout" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


def test_device_count_requests_within_the_processes_only(tmp_path, monkeypatch):
    """A request may name fewer ranks (scale-in) or more up to the processes the job has
    (scale-out onto standby ranks); never more; and none where the loop cannot (Megatron-LM)."""
    from pathlib import Path

    from dynatrain_megatron.elastic import controller as C
    from dynatrain_megatron.vps.model_spec import ModelSpec

    monkeypatch.setattr(C.dist, "get_world_size", lambda *a: 8)
    spec = ModelSpec.from_yaml(Path(__file__).parent.parent / "configs/models/tiny-gpt.yaml")
    path = str(tmp_path / "s.json")
    ctl = C.Controller(spec, path)
    write_request(path, "tp2pp2dp1", 4)
    d = ctl._decide_on_rank0(1, 8)
    assert (d.target, d.world, d.rejected) == ("tp2pp2dp1", 4, None)
    write_request(path, "tp2pp2dp4", 16)
    d = ctl._decide_on_rank0(1, 8)
    assert d.target is None and "more need a relaunch with more processes" in d.rejected
    ctl.allow_device_count_change = False
    write_request(path, "tp2pp2dp1", 4)
    d = ctl._decide_on_rank0(1, 8)
    assert d.target is None and "cannot change its device count" in d.rejected


def test_a_request_written_during_a_switch_is_the_next_one_not_filed_with_it(tmp_path,
                                                                               monkeypatch):
    """A request accepted at one poll leaves the signal path at once: a newer request
    written while the first is switched to (its preparation runs for several steps) is
    read at the next poll, and the first's outcome is filed with the first request.
    Before, `done` archived whatever sat at the path, so the newer request was filed as
    "applied" by the older switch and never ran."""
    from pathlib import Path

    from dynatrain_megatron.elastic import controller as C
    from dynatrain_megatron.vps.model_spec import ModelSpec

    monkeypatch.setattr(C.dist, "get_world_size", lambda *a: 4)
    monkeypatch.setattr(C.dist, "get_rank", lambda *a: 0)
    spec = ModelSpec.from_yaml(Path(__file__).parent.parent / "configs/models/tiny-gpt.yaml")
    path = tmp_path / "s.json"
    ctl = C.Controller(spec, str(path))
    req1 = write_request(path, "tp4pp1dp1")
    first = ctl._decide_on_rank0(9, 4)
    assert first.target == "tp4pp1dp1" and not path.exists()
    req2 = write_request(path, "tp2pp1dp1", 2)  # arrives while the first switch is prepared
    ctl.done(first, "applied", "switched at iteration 11")
    # each record is named after the request it answers (`dynatrain request --wait`)
    filed = json.loads((tmp_path / f"s.json.applied.{req1.id}").read_text())
    assert filed["id"] == req1.id
    assert json.loads(filed["request"])["layout"] == "tp4pp1dp1"
    assert filed["reason"] == "switched at iteration 11"
    second = ctl._decide_on_rank0(12, 4)
    assert (second.target, second.world) == ("tp2pp1dp1", 2)
    ctl.done(second, "applied", "switched at iteration 13")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"s.json.applied.{req1.id}", f"s.json.applied.{req2.id}"])
