"""machinery.lock.OutDirLock, in-process: a lock whose owner lives is refused in one line naming it; one
whose owner is gone (its process on this host, its node's heartbeat, an earlier attempt of the same
Slurm job or torchrun) is taken over with a note; the owner notices a takeover or a deleted lock
before it writes; and release removes only its own lock."""
import json
import os
import subprocess
import sys
import time

import pytest

from machinery.errors import UserError
from machinery.launch import host_name
from machinery.lock import OutDirLock, process_start


def write_lock(out_dir, host, age_s, **fields):
    path = os.path.join(out_dir, OutDirLock.NAME)
    with open(path, "w") as f:
        json.dump({"host": host, "pid": 4242, "started": 1, "slurm_job": None, "torchrun": None,
                   "token": "feedbeef", "since": "then", **fields}, f)
    t = time.time() - age_s
    os.utime(path, (t, t))


@pytest.fixture(autouse=True)
def no_job_ids(monkeypatch):
    for key in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.parametrize("age_s,fields,env,outcome", [
    (5, {}, {}, "refused"),  # alive on another node
    (OutDirLock.STALE_S + 30, {}, {}, "no heartbeat for"),  # that node died
    (5, {"slurm_job": "77"}, {"SLURM_JOB_ID": "77"}, "an earlier run of this Slurm job 77 (requeued)"),
    (5, {"slurm_job": "77"}, {"SLURM_JOB_ID": "78"}, "refused"),  # the same job submitted twice
    (5, {"torchrun": "rdzv-1"}, {"TORCHELASTIC_RUN_ID": "rdzv-1"}, "an earlier attempt of this torchrun job"),
])
def test_a_lock_from_another_node_is_refused_unless_stale_or_an_earlier_attempt_of_this_job(
        tmp_path, monkeypatch, age_s, fields, env, outcome):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    write_lock(tmp_path, "some-other-node", age_s, **fields)
    if outcome == "refused":
        with pytest.raises(UserError, match="is in use by another run .host some-other-node, pid 4242"):
            OutDirLock(str(tmp_path)).acquire()
        return
    lock = OutDirLock(str(tmp_path)).acquire()
    assert outcome in lock.note
    lock.check()
    write_lock(tmp_path, "a-third-node", 0)  # taken over by mistake: the owner notices before writing
    with pytest.raises(UserError, match="another run took over"):
        lock.check()
    lock.release()
    assert (tmp_path / OutDirLock.NAME).exists()  # not ours to remove


def test_a_lock_on_this_host_is_refused_while_its_process_lives_and_taken_over_once_it_is_gone(tmp_path):
    """Gone as soon as it has exited: killed and not yet reaped (a zombie, as a run's ranks are after a
    kill -9 of them and their launcher, until init reaps them), its lock is taken over; reaped, too."""
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = process_start(alive.pid)
        write_lock(tmp_path, host_name(), 0, pid=alive.pid, started=started)
        with pytest.raises(UserError) as e:
            OutDirLock(str(tmp_path)).acquire()
        assert f"pid {alive.pid}" in str(e.value) and "\n" not in str(e.value)
    finally:
        alive.kill()
    try:
        os.waitid(os.P_PID, alive.pid, os.WEXITED | os.WNOWAIT)  # it has exited; left unreaped
        lock = OutDirLock(str(tmp_path)).acquire()  # the same record, its process gone
    finally:
        alive.wait()
    assert f"its process {alive.pid} is gone" in lock.note
    lock.release()
    # and once reaped: no such process at all
    write_lock(tmp_path, host_name(), 0, pid=alive.pid, started=started)  # the same record
    lock = OutDirLock(str(tmp_path)).acquire()
    assert f"its process {alive.pid} is gone" in lock.note
    assert json.loads((tmp_path / OutDirLock.NAME).read_text())["token"] == lock.me["token"]
    lock.release()
    assert os.listdir(tmp_path) == []  # its own lock removed, nothing left behind


def test_a_run_whose_lock_is_gone_says_so_and_writes_nothing(tmp_path):
    lock = OutDirLock(str(tmp_path)).acquire()
    os.unlink(tmp_path / "run.lock")
    with pytest.raises(UserError,
                       match=f"this run's lock {tmp_path}/run.lock is gone .deleted, or --out-dir removed."):
        lock.check()
    lock.release()
    assert os.listdir(tmp_path) == []  # no lock put back, no file of any kind
