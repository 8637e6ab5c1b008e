"""Who may join the job (issue 7): a process must prove it holds the job's secret; without
it, or with a wrong one, it is refused, the refusal logged with its origin, and training
goes on unchanged. Pure tests of the protocol and the secret, and one spawned 2-rank
training run with real `dynatrain join` processes knocking during training."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from dynatrain_megatron import cli
from dynatrain_megatron.elastic import join as J
from dynatrain_megatron.elastic.job_secret import (ENV_VAR, JobSecret, SecretError, establish,
                                                   load_secret, read_secret_file,
                                                   write_secret_file)

pytestmark = pytest.mark.faults


# --- the secret ------------------------------------------------------------------------

def test_secret_file_is_written_0600_and_read_back(tmp_path):
    s = JobSecret.generate()
    p = write_secret_file(tmp_path / "sub" / "secret", s)
    assert oct(p.stat().st_mode & 0o777) == "0o600"
    assert read_secret_file(p) == s
    assert len(s.value) == 64  # token_hex(32)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o660])
def test_secret_file_others_can_reach_is_refused(tmp_path, mode):
    p = write_secret_file(tmp_path / "secret", JobSecret.generate())
    os.chmod(p, mode)
    with pytest.raises(SecretError, match=f"mode {mode:04o}: group or others"):
        read_secret_file(p)


def test_secret_file_of_another_user_link_or_directory_is_refused(tmp_path):
    s = JobSecret.generate()
    p = write_secret_file(tmp_path / "secret", s)
    link = tmp_path / "link"
    link.symlink_to(p)
    with pytest.raises(SecretError, match="is a symbolic link, not a regular file: refused"):
        read_secret_file(link)
    with pytest.raises(SecretError, match="not a regular file"):
        read_secret_file(tmp_path)
    with pytest.raises(SecretError, match="does not exist"):
        read_secret_file(tmp_path / "missing")
    if os.getuid() != 0:
        pytest.skip("changing a file's owner needs root")
    os.chown(p, 65534, 65534)
    with pytest.raises(SecretError, match="owned by uid 65534, not the job's uid"):
        read_secret_file(p)


def test_weak_secret_is_refused_without_showing_it(tmp_path):
    p = tmp_path / "secret"
    p.write_text("hunter2\n")
    os.chmod(p, 0o600)
    with pytest.raises(SecretError) as e:
        read_secret_file(p)
    assert "at least 32 characters" in str(e.value) and "hunter2" not in str(e.value)
    with pytest.raises(SecretError, match=ENV_VAR):
        load_secret(None, {ENV_VAR: "short"})


def test_secret_never_shown_by_repr_or_str():
    s = JobSecret.generate()
    assert s.value.decode() not in repr(s) + str(s) + f"{s}" + repr([s])


def test_where_the_secret_comes_from(tmp_path):
    rdv = tmp_path / "rdv"
    # nothing given: generated at launch into the rendezvous directory, 0600
    s, where = establish(None, str(rdv), env={})
    assert "generated" in where and s.value.decode() not in where
    assert oct((rdv / "job_secret").stat().st_mode & 0o777) == "0o600"
    assert establish(None, str(rdv), env={})[0] == s  # read back, not replaced
    assert load_secret(None, {}, str(rdv)) == s  # where a joiner looks by default
    # the environment wins over the default file; a named file wins over both
    other = JobSecret.generate()
    assert establish(None, str(rdv), env={ENV_VAR: other.value.decode()})[0] == other
    named = tmp_path / "named"
    s2, where = establish(named, str(rdv), env={ENV_VAR: other.value.decode()})
    assert s2 not in (s, other) and read_secret_file(named) == s2
    assert establish(None, None, env={}) == (None, "none (no --dynatrain-secret-file, no "
                                                   "rendezvous directory)")
    assert load_secret(None, {}, None) is None


# --- the protocol ----------------------------------------------------------------------

def _origin(user="alice", host="node7", pid=4242) -> J.Origin:
    return J.Origin(host, pid, user)


def _raw(**over) -> bytes:
    d = {"protocol": J.PROTOCOL, "id": "ab" * 16, "host": "h", "pid": 1, "user": "u",
         "mac": "cd" * 32}
    d.update(over)
    return json.dumps(d).encode()


@pytest.fixture
def job():
    """A job's reviewer on an in-process store, with its secret."""
    store = dist.HashStore()
    secret = JobSecret.generate()
    return store, secret, J.JoinReviewer(store, secret, world_size=4)


def test_valid_request_is_accepted_and_recorded(job):
    store, secret, rev = job
    slot, req = J.post_request(store, secret, _origin())
    (v,) = rev.review()
    assert v.accepted and (v.slot, v.request_id) == (slot, req.request_id)
    assert str(v) == "accepted, generation 1, rank 4"  # after the job's 4 processes
    assert J.wait_verdict(store, slot, secret, timeout=1) == v  # the joiner reads it
    assert J.accepted_requests(store) == (v,)  # for the work that re-forms the world
    slot2, _ = J.post_request(store, secret, _origin(pid=4243))
    assert str(rev.review()[0]) == "accepted, generation 1, rank 5"
    assert len(J.accepted_requests(store)) == 2
    assert rev.review() == ()  # nothing new


def test_requests_without_or_with_a_wrong_secret_are_refused(job):
    store, secret, rev = job
    s_none, _ = J.post_request(store, None, _origin())
    s_wrong, _ = J.post_request(store, JobSecret.generate(), _origin())
    v_none, v_wrong = rev.review()
    assert not v_none.accepted and "does not hold the job's secret" in v_none.reason
    assert not v_wrong.accepted and "tag does not match" in v_wrong.reason
    # each joiner reads its refusal (a joiner with a wrong secret too)
    assert "refused" in str(J.wait_verdict(store, s_none, None, timeout=1))
    assert "refused" in str(J.wait_verdict(store, s_wrong, JobSecret.generate(), timeout=1))
    assert J.accepted_requests(store) == () and rev.accepted == []


@pytest.mark.parametrize("field_, value", [("user", "root"), ("host", "trusted-node"),
                                          ("pid", 1), ("request_id", "0" * 32)])
def test_altered_request_is_refused(job, field_, value):
    """A valid request copied from the store with its origin or id changed (the tag covers
    them): refused."""
    store, secret, rev = job
    nonce = store.get(J.NONCE_KEY).decode()
    good = J.JoinRequest.signed(nonce, _origin(), secret)
    origin = good.origin
    rid = good.request_id
    if field_ == "request_id":
        rid = value
    else:
        origin = J.Origin(**{**{"host": origin.host, "pid": origin.pid, "user": origin.user},
                             field_: value})
    v = rev.judge(9, J.JoinRequest(rid, origin, good.mac).to_bytes())
    assert not v.accepted and "tag does not match" in v.reason
    assert rev.judge(10, good.to_bytes()).accepted  # the unaltered one is fine


def test_request_for_another_launch_is_refused(job):
    store, secret, rev = job
    old = J.JoinRequest.signed("f" * 32, _origin(), secret)  # tagged with an older nonce
    assert "another launch" in rev.judge(1, old.to_bytes()).reason


def test_replayed_request_is_refused(job):
    store, secret, rev = job
    slot, req = J.post_request(store, secret, _origin())
    assert rev.review()[0].accepted
    # someone with store access copies the accepted request into a new slot
    s2 = int(store.add(J.SLOTS_KEY, 1))
    store.set(f"{J.PREFIX}/request/{s2}", store.get(f"{J.PREFIX}/request/{slot}"))
    (v,) = rev.review()
    assert not v.accepted and "replayed" in v.reason and v.request_id == req.request_id
    assert len(J.accepted_requests(store)) == 1


@pytest.mark.parametrize("raw, why", [
    (b"\xff\xfe", "not UTF-8 JSON"), (b"{not json", "not UTF-8 JSON"),
    (b"[1, 2]", "not an object"), (_raw(mac=None), "mac must be"),
    (json.dumps({"id": "ab" * 16}).encode(), "fields"),
    (_raw(extra=1), "fields"), (_raw(protocol="v0"), "protocol"),
    (_raw(pid="1"), "pid must be a positive int"), (_raw(pid=True), "pid must be"),
    (_raw(pid=0), "pid must be"), (_raw(user="a\nWARNING forged log line"), "user must be"),
    (_raw(host=""), "host must be"), (_raw(id="XYZ"), "request id"),
    (_raw(mac="00"), "mac must be"), (_raw(user="x" * 5000), "bytes, more than"),
])
def test_garbage_is_refused(job, raw, why):
    store, secret, rev = job
    v = rev.judge(1, raw)
    assert not v.accepted and v.reason.startswith("malformed request") and why in v.reason


def test_garbage_in_the_store_does_not_stop_reviews(job):
    store, secret, rev = job
    store.set(J.SLOTS_KEY, "not a number")  # someone broke the counter
    assert rev.review() == ()
    store.set(J.SLOTS_KEY, "0")
    slot, _ = J.post_request(store, secret, _origin())
    assert rev.review()[0].accepted


def test_forged_acceptance_is_not_believed(job):
    """Someone with store access writes 'accepted' into a refused joiner's slot: a joiner
    holding the secret checks the job's tag on it and does not believe it."""
    store, secret, rev = job
    slot, _ = J.post_request(store, secret, _origin())
    fake = J.JoinVerdict(slot, None, "x", True, generation=1, rank=4)
    store.set(f"{J.PREFIX}/verdict/{slot}", fake.to_bytes("00" * 32))
    with pytest.raises(J.JoinError, match="not tagged with the job's secret"):
        J.wait_verdict(store, slot, secret, timeout=0.5)
    rev.review()  # the job's own verdict replaces it
    assert J.wait_verdict(store, slot, secret, timeout=1).accepted


def test_refusals_logged_with_origin_secret_and_tags_never(job, caplog):
    store, secret, rev = job
    caplog.set_level(logging.DEBUG)
    J.post_request(store, JobSecret.generate(), _origin("mallory", "evil-host", 666))
    store.set(f"{J.PREFIX}/request/{int(store.add(J.SLOTS_KEY, 1))}",
              _raw(user="a\nFAKE LINE", host="h2", pid=7))
    _, good = J.post_request(store, secret, _origin())
    rev.review()
    text = caplog.text
    assert "mallory@evil-host pid 666" in text and "tag does not match" in text
    assert "claimed 'a\\nFAKE LINE'" in text and "\nFAKE LINE" not in text  # escaped
    assert "alice@node7 pid 4242: accepted" in text
    tags = [J.JoinRequest.parse(store.get(f"{J.PREFIX}/request/{i}")).mac for i in (1, 3)]
    for s in [secret.value.decode(), good.mac, *tags, "cd" * 32]:
        assert s not in text


def _review_in_background(rev: J.JoinReviewer, stop: threading.Event) -> threading.Thread:
    def loop():
        while not stop.is_set():
            rev.review()
            time.sleep(0.05)
    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def test_cli_join_exit_status_and_no_secret_in_output(tmp_path, capsys, caplog):
    """`dynatrain join` against a job reviewing in a thread: accepted with the secret file
    (exit 0), refused with a wrong one or none (exit 1); the secret is printed nowhere."""
    caplog.set_level(logging.DEBUG)
    rdv = tmp_path / "rdv"
    rdv.mkdir()
    secret = JobSecret.generate()
    rev = J.JoinReviewer(dist.FileStore(str(rdv / "rendezvous"), -1), secret, world_size=2)
    good = write_secret_file(tmp_path / "good", secret)
    bad = write_secret_file(tmp_path / "bad", JobSecret.generate())
    stop = threading.Event()
    t = _review_in_background(rev, stop)
    try:
        base = ["join", "--rendezvous-dir", str(rdv), "--timeout", "20"]
        assert cli.main(base + ["--secret-file", str(good)]) == 0
        assert cli.main(base + ["--secret-file", str(bad)]) == 1
        os.environ.pop(ENV_VAR, None)
        assert cli.main(base) == 1
        os.chmod(good, 0o644)
        assert cli.main(base + ["--secret-file", str(good)]) == 2  # unsafe file: refused locally
    finally:
        stop.set()
        t.join()
    out = capsys.readouterr()
    assert out.out.count("accepted, generation 1, rank 2") == 1
    assert "refused: tag does not match" in out.out and "refused: no tag" in out.out
    assert "group or others may read" in out.err
    assert secret.value.decode() not in out.out + out.err + caplog.text
    assert cli.main(["join", "--rendezvous-dir", str(tmp_path / "nope")]) == 2


# --- one spawned training run ------------------------------------------------------------

STEPS, KNOCK_AT = 6, 2


def join_run(rdv: str, n_requests: int) -> dict:
    """On 2 ranks: the same training twice through the hook wired by `from_args`, once with
    join review configured (the joiners knock during it) and once without the feature.
    Rank 0 holds training at iteration KNOCK_AT until the requests are in the store (test
    synchronisation only), so that they are reviewed during training."""
    import argparse

    from dynatrain_megatron.elastic.job_secret import share_with_ranks
    from dynatrain_megatron.loop.arguments import add_dynatrain_args
    from dynatrain_megatron.loop.hook import DynatrainHook
    from dynatrain_megatron.mcore.session import release, start_job
    from dynatrain_megatron.testing import gather as G
    from rank_cases import gather_layout_state, spec_variant, switch_train_config

    rank = dist.get_rank()
    s, train = spec_variant("tiny-gpt"), switch_train_config()
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    if rank == 0:  # the root and our own logger (which does not propagate once configured)
        for name in ("", "dynatrain"):
            logging.getLogger(name).setLevel(logging.INFO)
            logging.getLogger(name).addHandler(Keep())
    secret = share_with_ranks(None, rdv)  # as main.py: here from the launcher's environment

    def run(joins: bool):
        flags = ["--dynatrain", "--dynatrain-ranks-per-node", "4"]
        flags += ["--dynatrain-rendezvous-dir", rdv] if joins else []
        args = add_dynatrain_args(argparse.ArgumentParser()).parse_args(flags)
        tr = start_job(s, "tp2pp1dp1", train)
        hook = DynatrainHook.from_args(args, s, train)
        losses, waited = [], None
        for _ in range(STEPS):
            losses.append(tr.step().loss)
            if joins and rank == 0 and tr.iteration == KNOCK_AT:
                waited = _wait_for_requests(hook.controller.joins.store, n_requests)
            tr = hook.after_step(tr)
        state = gather_layout_state(s, tr)
        release(tr.objs)
        return losses, state, hook, waited

    losses, state, hook, waited = run(joins=True)
    plain_losses, plain_state, plain_hook, _ = run(joins=False)
    verdicts = [None, None]
    dist.all_gather_object(verdicts, hook.controller.join_verdicts)
    return dict(losses=losses, plain_losses=plain_losses, waited=waited,
                state_diff=None if state is None else G.states_equal(state, plain_state),
                n_tensors=None if state is None else len(state),
                verdicts=[[str(v) for v in vs] for vs in verdicts],
                origins=[v.origin for v in verdicts[0]],
                plain_reviews=plain_hook.controller.joins is None,
                secret_in_env=os.environ.get(ENV_VAR) == secret.value.decode(),
                log=records if rank == 0 else None,
                accepted=[str(v) for v in J.accepted_requests(hook.controller.joins.store)]
                if rank == 0 else None)


def _wait_for_requests(store, n: int, timeout: float = 240.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if store.check([J.SLOTS_KEY]) and int(store.get(J.SLOTS_KEY)) >= n \
                and store.check([f"{J.PREFIX}/request/{i}" for i in range(1, n + 1)]):
            break
        time.sleep(0.1)
    return time.monotonic() - t0


@pytest.mark.multirank
def test_joiners_without_the_secret_are_refused_and_training_is_unchanged(tmp_path):
    from dynatrain_megatron.testing.multiproc import run_on_ranks

    rdv = tmp_path / "rdv"
    rdv.mkdir()
    secret = JobSecret.generate()  # the launcher's
    good = write_secret_file(tmp_path / "good", secret)
    wrong = write_secret_file(tmp_path / "wrong", JobSecret.generate())
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    base = [sys.executable, "-m", "dynatrain_megatron.cli", "join", "--rendezvous-dir",
            str(rdv), "--timeout", "300"]
    joiners = {name: subprocess.Popen(base + extra, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
               for name, extra in (("none", []), ("wrong", ["--secret-file", str(wrong)]),
                                   ("right", ["--secret-file", str(good)]))}
    try:
        t0 = time.monotonic()
        res = run_on_ranks(join_run, 2, str(rdv), len(joiners),
                           env={ENV_VAR: secret.value.decode()})
        print(f"spawned run {time.monotonic() - t0:.1f} s")
        out = {n: (p.wait(timeout=120), p.stdout.read()) for n, p in joiners.items()}
    finally:
        for p in joiners.values():
            if p.poll() is None:
                p.kill()
    r0, r1 = res
    # the joiners: two refused (non-zero exit), one accepted
    assert out["none"][0] == 1 and "refused: no tag" in out["none"][1], out["none"]
    assert out["wrong"][0] == 1 and "refused: tag does not match" in out["wrong"][1], out["wrong"]
    assert out["right"][0] == 0 and "accepted, generation 1, rank 2" in out["right"][1], out["right"]
    # reviewed during training, at one poll; every rank got the same verdicts
    assert r0["waited"] < 240
    assert sorted(r0["verdicts"][0]) == sorted(["refused: no tag: the joiner does not hold the "
                                                "job's secret", "accepted, generation 1, rank 2",
                                                "refused: tag does not match: wrong secret, or "
                                                "the request was altered or made for another "
                                                "launch of the job"])
    assert r0["verdicts"][0] == r0["verdicts"][1] == r1["verdicts"][0]
    assert r0["accepted"] == ["accepted, generation 1, rank 2"] and r0["plain_reviews"]
    # training went on unchanged: losses and the whole final state bit-identical to the
    # same run with the feature off
    assert r0["losses"] == r0["plain_losses"] and len(r0["losses"]) == STEPS
    assert r0["n_tensors"] and r0["state_diff"] == []
    assert r0["secret_in_env"] and r1["secret_in_env"]
    # refusals logged with their origin; the secret and the tags nowhere in the log
    log_text = "\n".join(r0["log"])
    refusals = [m for m in r0["log"] if "refused" in m]
    assert len(refusals) == 2 and all(f"@{os.uname().nodename} pid " in m for m in refusals)
    store = dist.FileStore(str(rdv / "rendezvous"), -1)
    tags = [J.JoinRequest.parse(store.get(f"{J.PREFIX}/request/{i}")).mac for i in (1, 2, 3)]
    assert secret.value.decode() not in log_text
    assert all(t not in log_text for t in tags if t)


@pytest.mark.multirank
def test_an_accepted_joiner_enters_the_world_and_trains_after_a_scale_out(tmp_path):
    """A process launched after the job, holding the secret, is accepted, the job's world
    grows by one (every piece of state a local copy), and a scale-out request then puts
    the joiner to work: the job ends at 2 ranks having started with 1 process."""
    import json
    import os
    import subprocess
    import sys
    import threading
    import time
    from pathlib import Path

    from dynatrain_megatron import process_env
    from dynatrain_megatron.elastic.signal_file import write_request
    from dynatrain_megatron.testing.multiproc import run_on_ranks
    from rank_cases import main_job_case

    root = Path(__file__).resolve().parent.parent
    run, rdv = tmp_path / "run", tmp_path / "rdv"
    argv = ["--model-config", str(root / "configs/models/tiny-gpt.yaml"),
            "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "400",
            "--lr", "1e-3", "--log-interval", "1000", "--dynatrain",
            "--dynatrain-signal-file", str(run / "switch.json"), "--dynatrain-log-dir", str(run),
            "--dynatrain-rendezvous-dir", str(rdv)]
    out: dict = {}
    job = threading.Thread(target=lambda: out.update(res=run_on_ranks(main_job_case, 1,
                                                                      str(run), argv)))
    job.start()
    secret = rdv / "job_secret"  # generated by the job at launch (mode 0600)
    deadline = time.monotonic() + 120
    while not secret.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    env = process_env.apply(dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    joiner = subprocess.Popen([sys.executable, str(root / "scripts/pretrain_gpt.py"), *argv,
                               "--dynatrain-join", "--dynatrain-secret-file", str(secret)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    lines = []
    for line in joiner.stdout:
        lines.append(line)
        if "world grown" in line:
            write_request(str(run / "switch.json"), "tp1pp1dp2", 2)  # put it to work
    code = joiner.wait(timeout=300)
    job.join(timeout=300)
    assert code == 0, "".join(lines[-20:])
    assert out["res"] == [{"code": 0}]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["iteration"] == 400 and summary["world"] == 2
    assert summary["layout"] == "tp1pp1dp2"  # the joiner trains
    [adm] = summary["admitted"]
    assert adm["world"] == 2 and len(adm["joiners"]) == 1
