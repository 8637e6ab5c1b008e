"""Admission after an accepted join request is authenticated too (issue 14): a process
without the secret that reaches the store (torchrun's agent store has no authentication)
tries every step after a legitimate acceptance and gets nowhere, while the legitimate
joiner is admitted; the join store refuses a rendezvous directory or store file others may
write to. The real growth of the world on ranks is test_join.py's spawned run."""
from __future__ import annotations

import datetime
import json
import os

import pytest
import torch.distributed as dist

from dynatrain_megatron.elastic import join as J
from dynatrain_megatron.elastic.job_secret import JobSecret
from dynatrain_megatron.loop import growth
from dynatrain_megatron.vps.layout import Layout
from dynatrain_megatron.vps.placement import Placement

pytestmark = pytest.mark.faults


@pytest.fixture
def agent_store():
    """A TCPStore like torchrun's agent store: anyone who reaches the port may write."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True,  # the OS picks a free port
                           timeout=datetime.timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", master.port, is_master=False,
                           timeout=datetime.timedelta(seconds=10))
    return master, client


def test_a_process_without_the_secret_cannot_claim_an_acceptance(agent_store):
    job_store, attacker = agent_store
    secret = JobSecret.generate()
    rev = J.JoinReviewer(job_store, secret, world_size=4)
    slot, req = J.post_request(job_store, secret, J.Origin("node1", 77, "alice"))
    (v,) = rev.review()
    assert v.accepted and v.rank == 4
    g, nonce = v.generation, rev.nonce
    # the attacker watches the store: it can read the verdict and the nonce, and writes
    # "ready" for the accepted rank: untagged, with a tag of its own, and replaying the id
    key = f"{growth.PREFIX}{g}/ready/{v.rank}"
    wrong = JobSecret.generate()
    for word in (b"1", b"{}", json.dumps({"id": req.request_id, "mac": "0" * 64}).encode(),
                 json.dumps({"id": req.request_id, "mac": wrong.tag(b"x")}).encode()):
        attacker.set(key, word)
        assert not growth.all_ready(job_store, g, [v], secret, nonce, wait_seconds=0.2)
    growth.ready(attacker, g, v.rank, wrong, nonce, req.request_id)  # a wrong secret
    assert not growth.all_ready(job_store, g, [v], secret, nonce, wait_seconds=0.2)
    # the legitimate joiner says ready: admitted
    growth.ready(job_store, g, v.rank, secret, J.current_nonce(job_store), req.request_id)
    assert growth.all_ready(job_store, g, [v], secret, nonce, wait_seconds=5)
    # the new world meets under a prefix the attacker cannot derive: nothing it can find
    # at the old, guessable keys, and its own guess is another prefix
    prefix = growth.meeting_prefix(secret, nonce, g)
    assert prefix != growth.meeting_prefix(wrong, nonce, g) and len(prefix.split("/")[-1]) == 32
    growth.announce(job_store, prefix, 5, Layout.parse("tp2pp2dp1", 4),
                  Placement((0, 1, 2, 3)), secret)
    for k in (f"{growth.PREFIX}{g}/world", f"{growth.PREFIX}{g}/layout", f"{growth.PREFIX}{g}/pg"):
        assert not attacker.check([k])
    # a forged announcement (had it found the prefix) is not believed by the joiner
    info = json.loads(job_store.get(f"{prefix}/info"))
    attacker.set(f"{prefix}/info", json.dumps({**info, "world": 9}))
    with pytest.raises(J.JoinError, match="not tagged with the job's secret"):
        growth.join_world(None, None, job_store, prefix, v.rank, secret, wait_seconds=1)


def test_join_store_refuses_what_others_can_write(tmp_path):
    ok = tmp_path / "ok"
    assert isinstance(J.join_store(str(ok)), dist.FileStore)
    assert (ok.stat().st_mode & 0o777) == 0o700  # created private, whatever the umask
    assert ((ok / "rendezvous").stat().st_mode & 0o777) == 0o600
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(J.JoinError, match="writable by others .* and not sticky"):
        J.join_store(str(open_dir))
    os.chmod(open_dir, 0o1777)  # sticky (like /tmp): the store file's own checks decide
    J.join_store(str(open_dir))
    os.chmod(open_dir / "rendezvous", 0o666)
    with pytest.raises(J.JoinError, match="rendezvous is writable by others"):
        J.join_store(str(open_dir))
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    target = tmp_path / "elsewhere"
    target.write_text("")
    os.symlink(target, swapped / "rendezvous")
    with pytest.raises(J.JoinError, match="not a regular file"):
        J.join_store(str(swapped))
    if os.getuid() == 0:  # another user's store file (only root can make one)
        os.unlink(swapped / "rendezvous")
        (swapped / "rendezvous").write_text("")
        os.chown(swapped / "rendezvous", 12345, 12345)
        with pytest.raises(J.JoinError, match="owned by uid 12345"):
            J.join_store(str(swapped))
