"""Two CPU processes under torchrun (gloo, FSDP2): an error on one rank ends the whole job within seconds with its
message printed once, and a run killed in the middle of a step resumes onto the same loss curve; a checkpoint whose
write was cut is never resumed from.

The workers start through WORKER, a wrapper around ``python -m twell.train`` that injects the fault named by the
environment variable TWELL_TEST_FAULT and makes ``destroy_process_group`` wait for every rank, as NCCL's teardown
can. Gloo's teardown returns at once and gloo notices a dead peer, so without that a failure path that tears the
process group down would pass here and hang on GPUs. tests/test_train_resume_gpu.py runs the same kill-and-resume
flow on two GPUs.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
import yaml

from twell.data import DataConfig, prepare_data
from twell.paths import repo_root
from twell.train import read_metrics, run
from twell.train.checkpoint import CheckpointManager
from twell.train.parallel import DistInfo

# The 2-layer model on the smoke corpus of the single-process tests; under torchrun 2 ranks x micro-batch 4
# make a step (no accumulation).
from test_train_runs import _cfg as tiny_cfg, smoke_data  # noqa: E402, F401

ENV = {**os.environ, "PYTHONPATH": str(repo_root() / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

# Measured on 2 CPU cores: a failing job exits 5-7 s after the launch, start-up included (up to 12 s while other
# jobs load both cores).
EXIT_BOUND_S = 45
HANG_S = 150  # a job still running after this long hangs (the subprocess is killed and the test fails)

WORKER = '''\
"""python -m twell.train with a fault injected for the tests (TWELL_TEST_FAULT) and a teardown that waits for
every rank, as NCCL's can.

TWELL_TEST_FAULT: raise:<rank>:<step>   that rank raises at the start of the step (steps count from 1)
                  pause_step:<step>     every rank pauses after the first forward of the step
                  pause_ckpt:<step>     every rank pauses once its shards of that step's checkpoint are written
A pausing rank prints "PAUSED ... pid=<pid>" and sleeps until it is killed.
"""
import os
import sys
import time

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from twell.train import loop
from twell.train.__main__ import main

RANK = int(os.environ.get("RANK", "0"))
KIND, *ARGS = os.environ.get("TWELL_TEST_FAULT", "none").split(":")


def pause(where):
    os.write(1, f"PAUSED {where} rank={RANK} pid={os.getpid()}\\n".encode())  # one write: ranks share the log
    time.sleep(3600)


def destroy_waiting_for_peers(*args, **kw):
    dist.barrier()
    _destroy(*args, **kw)


def train_step(self, step):
    current["step"] = step + 1
    if KIND == "raise" and RANK == int(ARGS[0]) and step + 1 == int(ARGS[1]):
        raise RuntimeError(f"injected failure on rank {RANK} in step {step + 1}")
    return _train_step(self, step)


def loss_after_forward(*args, **kw):
    if KIND == "pause_step" and current["step"] == int(ARGS[0]):
        pause(f"in step {current['step']} after the forward")
    return _loss(*args, **kw)


def save_then_pause(*args, **kw):
    out = _save(*args, **kw)
    if KIND == "pause_ckpt" and f"step_{int(ARGS[0]):07d}" in str(kw.get("checkpoint_id")):
        pause(f"writing checkpoint {int(ARGS[0])}")
    return out


current = {"step": None}
_destroy, dist.destroy_process_group = dist.destroy_process_group, destroy_waiting_for_peers
_train_step, loop.Trainer._train_step = loop.Trainer._train_step, train_step
_loss, loop.sparse_lm_loss = loop.sparse_lm_loss, loss_after_forward
_save, dcp.save = dcp.save, save_then_pause
sys.exit(main(sys.argv[1:]))
'''


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    path = tmp_path_factory.mktemp("worker") / "twell_train_worker.py"
    path.write_text(WORKER)
    return path


def torchrun_cmd(worker, cfg_path, out, *extra, nproc=2):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), str(worker),
            "--config", str(cfg_path), "--out", str(out), *extra]


def write_cfg(tmp_path, cfg, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_to_exit(cmd, log, fault=None, timeout=HANG_S):
    """(exit code, output, seconds) of the job; a job that outlives ``timeout`` is killed and fails the test."""
    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=dict(ENV, TWELL_TEST_FAULT=fault or "none"), stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(proc)
        pytest.fail(f"the job hung: still running after {timeout} s; its output:\n{log.read_text()[-4000:]}")
    return proc.returncode, log.read_text(), time.time() - t0


def descendants(pid):
    """Process ids of everything ``pid`` started (Linux /proc)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def kill_job(proc):
    """SIGKILL torchrun and every process under it at once (torchrun starts each worker in a session of its own)."""
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def run_until_paused(cmd, log, fault, nproc=2, timeout=HANG_S):
    """Start the job, wait until every rank printed PAUSED (the fault's point), then SIGKILL the whole job."""
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=dict(ENV, TWELL_TEST_FAULT=fault), stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.time() + timeout
    paused = 0
    while time.time() < deadline and proc.poll() is None and paused < nproc:
        time.sleep(0.05)
        paused = log.read_text().count("PAUSED")
    kill_job(proc)
    assert paused == nproc, f"the job did not reach the fault {fault!r}:\n{log.read_text()[-4000:]}"


def train_records(out):
    """(step, ce, grad_norm) of every train record in order."""
    return [(r["step"], r["ce"], r["grad_norm"]) for r in read_metrics(out / "metrics.jsonl")["train"]]


def resume_events(out):
    return [e for e in read_metrics(out / "metrics.jsonl")["event"] if e["event"] == "resume"]


# -- an error on one rank ends the job ---------------------------------------------------------------------------
@pytest.mark.timeout(2 * HANG_S)
def test_a_data_error_on_rank_0_ends_the_job_and_is_printed_once(tmp_path, smoke_data, worker):
    """Rank 0 prepares the data while rank 1 waits for it: the empty validation split must stop both."""
    corpus = tmp_path / "small.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"doc{i}", "text": f"document {i} " + "words and more words " * 40})
                              + "\n" for i in range(30)))
    cfg = tiny_cfg(smoke_data)
    cfg["data"] = {"source": str(corpus), "tokenizer": str(smoke_data.dir / "tokenizer"), "val_fraction": 0.0005,
                   "prepared_dir": str(tmp_path / "prepared")}
    rc, out, secs = run_to_exit(torchrun_cmd(worker, write_cfg(tmp_path, cfg), tmp_path / "run"), tmp_path / "log")
    print(f"exit {rc} after {secs:.1f} s")
    assert rc != 0 and secs < EXIT_BOUND_S, out[-4000:]
    assert out.count("validation split of") == 1, out[-4000:]
    assert "--set data.val_fraction=" in out  # the error names the setting and a value that works


@pytest.mark.timeout(2 * HANG_S)
def test_a_config_error_on_every_rank_is_printed_once(tmp_path, smoke_data, worker):
    cfg = tiny_cfg(smoke_data, global_batch=12)  # not a multiple of micro-batch 4 x 2 ranks
    rc, out, secs = run_to_exit(torchrun_cmd(worker, write_cfg(tmp_path, cfg), tmp_path / "run"), tmp_path / "log")
    print(f"exit {rc} after {secs:.1f} s")
    assert rc != 0 and secs < EXIT_BOUND_S, out[-4000:]
    assert out.count("must be divisible by train.micro_batch") == 1, out[-4000:]


@pytest.mark.timeout(2 * HANG_S)
def test_an_error_on_rank_1_in_the_middle_of_the_run_ends_the_job(tmp_path, smoke_data, worker):
    """Rank 1 raises at the start of step 3 while rank 0 is already in that step's collectives."""
    rc, out, secs = run_to_exit(torchrun_cmd(worker, write_cfg(tmp_path, tiny_cfg(smoke_data)), tmp_path / "run"),
                                tmp_path / "log", fault="raise:1:3")
    print(f"exit {rc} after {secs:.1f} s")
    assert rc != 0 and secs < EXIT_BOUND_S, out[-4000:]
    assert out.count("injected failure on rank 1 in step 3") == 1, out[-4000:]


# -- a killed run resumes onto the same loss curve ---------------------------------------------------------------
def kill_and_resume(tmp_path, worker, cfg, *, ckpt_every, kill_in_checkpoint, nproc=2):
    """A reference run, then the same run killed in the middle of the step after its second checkpoint and resumed
    to the end; with ``kill_in_checkpoint`` it is first killed while it writes that second checkpoint (after every
    rank wrote its shards) and resumed up to the kill in the step.

    Returns the reference's and the resumed run's output folders. A resume after the kill in the checkpoint must
    start from the first checkpoint: the one being written was not complete.
    """
    steps = cfg["train"]["steps"]
    second = 2 * ckpt_every
    assert steps > second + 1
    cfg["train"]["ckpt_every"] = ckpt_every
    path = write_cfg(tmp_path, cfg)
    ref, out = tmp_path / "ref", tmp_path / "killed"
    rc, log, _ = run_to_exit(torchrun_cmd(worker, path, ref, nproc=nproc), tmp_path / "ref.log")
    assert rc == 0, log[-4000:]
    resume, expected = [], []
    if kill_in_checkpoint:
        run_until_paused(torchrun_cmd(worker, path, out, nproc=nproc), tmp_path / "kill-ckpt.log",
                         f"pause_ckpt:{second}", nproc=nproc)
        assert (out / "ckpt" / f".step_{second:07d}.tmp" / ".metadata").is_file()  # every shard was written
        resume, expected = ["--resume"], [f"from step_{ckpt_every:07d}"]
    run_until_paused(torchrun_cmd(worker, path, out, *resume, nproc=nproc), tmp_path / "kill-step.log",
                     f"pause_step:{second + 1}", nproc=nproc)
    rc, log, _ = run_to_exit(torchrun_cmd(worker, path, out, "--resume", nproc=nproc), tmp_path / "resume.log")
    assert rc == 0, log[-4000:]
    expected.append(f"from step_{second:07d}")
    assert [e["detail"].split(";")[0] for e in resume_events(out)] == expected
    return ref, out


@pytest.mark.slow
@pytest.mark.timeout(4 * HANG_S)
def test_a_two_process_run_killed_in_a_step_resumes_onto_the_same_loss_curve(tmp_path, smoke_data, worker):
    """FSDP2 over gloo on CPU, fp32: the resumed run's losses, gradient norms and validation equal the reference's
    bit for bit (the data order is a function of the step; weights, optimizer state and tracker are restored)."""
    t0 = time.time()
    ref, out = kill_and_resume(tmp_path, worker, tiny_cfg(smoke_data, steps=12, eval_every=6), ckpt_every=4,
                               kill_in_checkpoint=False)
    print(f"reference, kill and resume: {time.time() - t0:.1f} s")
    assert [r[0] for r in train_records(out)] == list(range(1, 13))
    assert train_records(out) == train_records(ref)
    val = [(r["step"], r["val_ce"]) for r in read_metrics(out / "metrics.jsonl")["val"]]
    assert val == [(r["step"], r["val_ce"]) for r in read_metrics(ref / "metrics.jsonl")["val"]]


def test_resume_skips_a_checkpoint_whose_write_was_cut(tmp_path, smoke_data, monkeypatch):
    """One process: the write of checkpoint 8 stops once DCP wrote its shards and metadata (what a kill there leaves),
    beside other leftovers of crashes: a step folder without its marker, one with only its marker left, and a cut
    latest.json. --resume must take checkpoint 4 and redo steps 5-8 exactly as the first attempt made them. A shard
    damaged after its checkpoint was complete stops a resume with an error naming the folder."""
    cfg = tiny_cfg(smoke_data, steps=12, eval_every=6, ckpt_every=4)

    class Killed(Exception):
        pass

    def save_then_die(*args, **kw):
        real_save(*args, **kw)
        if "step_0000008" in str(kw["checkpoint_id"]):
            raise Killed

    real_save = dcp.save
    monkeypatch.setattr(dcp, "save", save_then_die)
    out = tmp_path / "cut"
    with pytest.raises(Killed):
        run(cfg, out=out)
    monkeypatch.undo()
    first = train_records(out)
    assert [r[0] for r in first] == list(range(1, 9))
    root = out / "ckpt"
    cut = root / ".step_0000008.tmp"
    assert (cut / ".metadata").is_file() and not (cut / "trainer.pt").exists()
    shutil.copytree(cut, root / "step_0000012")  # a step folder without its marker
    (root / "step_0000016").mkdir()  # a half-deleted one that kept its marker
    shutil.copy(root / "step_0000004" / "trainer.pt", root / "step_0000016")
    (root / "latest.json").write_text('{"step": 12, "dir": "step_00')  # a pointer cut by a crash of the machine
    assert CheckpointManager(root, DistInfo()).latest() == root / "step_0000004"
    res = run(cfg, out=out, resume=True)
    assert [e["detail"].split(";")[0] for e in resume_events(out)] == ["from step_0000004"]
    again = train_records(out)
    assert [r[0] for r in again] == list(range(1, 13)) and again[:8] == first
    assert CheckpointManager(root, DistInfo()).latest() == res.checkpoint_dir == root / "step_0000012"
    (root / "step_0000012" / "__0_0.distcp").write_bytes(b"")  # a complete checkpoint damaged later: named, not used
    with pytest.raises(ValueError, match="step_0000012: its shards do not load .*move that folder away"):
        run(cfg, out=out, resume=True)
