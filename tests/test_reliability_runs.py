"""Faults injected into real ``pipewright train`` runs (2 worker processes, tiny model, 6 steps), each
compared with one uninterrupted run of the same configuration (module fixture):

* a worker SIGKILLed mid-iteration, and a checkpoint write killed half-way, with ``--max-restarts``:
  the run completes, the restart after the killed write resumes from the previous checkpoint, and every
  loss equals the uninterrupted run's; the same SIGKILL under ``torchrun --max-restarts 1`` (torchrun's
  elastic agent restarts the group, the workers join a namespace of its store fresh for the attempt —
  ``launch.attempt_store`` — and resume by themselves);
* a rank that stalls before its data-parallel all-reduce: its peers' collectives time out after
  ``--collective-timeout`` and the run stops with every rank's position (hang-report.txt);
* SIGTERM to the launcher: the workers finish the step they are in, write its checkpoint and the run
  exits with status 75; ``--resume`` then reproduces the uninterrupted losses;
* two hosts: two Linux network namespaces joined by a veth pair, ``torchrun --nnodes 2`` with c10d
  rendezvous over that link only, one pipeline stage per host: the same losses as on one host.

Faults come from ``PIPEWRIGHT_FAULTS`` (:mod:`pipewright.runtime.reliability.faults`), read by the workers.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from _queue_spawn import forked_cli_launches
from pipewright.cli import main
from pipewright.data.tokens import write_tokens
from pipewright.runtime.reliability.elastic import PREEMPTED_EXIT_CODE

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--layers", "4", "--hidden", "32", "--heads", "4", "--seq-len", "16", "--microbatch-size", "2"]
TINY += ["--microbatches", "4", "--eval-every", "0", "--no-progress", "--no-artifacts", "--seed", "3"]
TINY += ["--lr", "0.01", "--steps", "6", "--checkpoint-every", "2"]


def _losses(out: Path) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(len(records)))
    return [r["loss"] for r in records]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "tokens.bin"
    text = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 400, dtype=np.uint8)
    write_tokens(path, text.astype(np.int64), vocab_size=256)
    return str(path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data) -> list[float]:
    """The uninterrupted run's losses (its workers forked: nothing here is about how they start)."""
    out = tmp_path_factory.mktemp("reference")
    with forked_cli_launches():
        assert main(["train", *TINY, "--data", data, "--out", str(out)]) == 0
    return _losses(out)


@pytest.mark.slow
def test_killed_worker_and_killed_checkpoint_write_restart_to_the_same_losses(
    reference, data, tmp_path, monkeypatch, caplog
):
    # attempt 0: rank 0 dies while step_4 is being written (shards on disk, not committed);
    # attempt 1: rank 1 dies in the middle of step 4's schedule.
    monkeypatch.setenv("PIPEWRIGHT_FAULTS", "kill-save:rank=0:step=4;kill:rank=1:step=4:attempt=1")
    caplog.set_level(logging.WARNING, logger="pipewright.runtime.reliability.elastic")
    out = tmp_path / "run"
    assert main(["train", *TINY, "--data", data, "--out", str(out), "--max-restarts", "2"]) == 0
    restarts = [r.getMessage() for r in caplog.records if "restart" in r.getMessage()]
    assert len(restarts) == 2, restarts
    # the killed write of step_4 is never used: the first restart resumes from step_2
    assert "restart 1 of 2 from" in restarts[0] and restarts[0].endswith(
        "step_2 (2 finished step(s) to redo)"
    )
    assert "restart 2 of 2 from" in restarts[1] and restarts[1].endswith(
        "step_4 (0 finished step(s) to redo)"
    )
    assert _losses(out) == pytest.approx(reference, rel=1e-6)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_6"
    assert not list((out / "checkpoints").glob("*.tmp"))


def _start(args: list[str], out: Path, faults: str = "") -> subprocess.Popen:
    """``pipewright train args --out out`` in a subprocess (``faults``: its PIPEWRIGHT_FAULTS)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PIPEWRIGHT_FAULTS": faults}
    cmd = [sys.executable, "-m", "pipewright", "train", *args, "--out", str(out)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _sigterm_after(proc: subprocess.Popen, out: Path, steps: int) -> tuple[int, str]:
    """SIGTERM ``proc`` (a launcher) once ``steps`` steps are in ``out/metrics.jsonl``, as a scheduler
    would; its exit status and output."""
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= steps):
            assert proc.poll() is None and time.monotonic() < deadline, (
                proc.stdout.read() if proc.stdout else ""
            )
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    return proc.returncode, output


@pytest.mark.slow
def test_sigterm_checkpoints_the_current_step_and_resume_reproduces(reference, data, tmp_path):
    out = tmp_path / "run"
    proc = _start([*TINY, "--data", data], out, "pause:step=3:ms=60000")
    status, output = _sigterm_after(proc, out, 3)  # the workers are in step 3
    assert status == PREEMPTED_EXIT_CODE, output
    assert "preempted (SIGTERM) after step 4" in output
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_4"
    assert len(_losses(out)) == 4
    assert main(["train", *TINY, "--data", data, "--out", str(out), "--resume"]) == 0
    assert _losses(out) == pytest.approx(reference, rel=1e-6)


# 2bw carries the previous weight version from window to window: the checkpoint must hold it
ASYNC = [*TINY, "--schedule", "async-1f1b", "--weight-policy", "2bw"]


@pytest.mark.slow
def test_sigterm_in_an_asynchronous_window_checkpoints_its_end_and_resume_reproduces(data, tmp_path):
    # windows of 2 steps (they end at checkpoints): the ranks agree on the SIGTERM after the window
    # [2, 4) they are paused in, checkpoint step_4 and stop; --resume continues with the same windows.
    # The uninterrupted run meanwhile. The in-process runs fork their workers (the signalled one is
    # a real launcher in a subprocess).
    out, reference = tmp_path / "run", tmp_path / "reference"
    proc = _start([*ASYNC, "--data", data], out, "pause:step=2:ms=60000")
    with forked_cli_launches():
        assert main(["train", *ASYNC, "--data", data, "--out", str(reference)]) == 0
    status, output = _sigterm_after(proc, out, 2)
    assert status == PREEMPTED_EXIT_CODE, output
    assert "preempted (SIGTERM) after step 4" in output
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_4"
    assert len(_losses(out)) == 4
    # meanwhile, a copy resumed with the nesterov policy, which steps with NAdam: one line, before loading
    shutil.copytree(out, tmp_path / "nesterov")
    other = _start([*ASYNC, "--data", data, "--resume", "--weight-policy", "nesterov"], tmp_path / "nesterov")
    with forked_cli_launches():
        assert main(["train", *ASYNC, "--data", data, "--out", str(out), "--resume"]) == 0
    assert _losses(out) == pytest.approx(_losses(reference), rel=1e-6)
    output, _ = other.communicate(timeout=240)
    assert other.returncode == 2, output
    step_4 = tmp_path / "nesterov" / "checkpoints" / "step_4"
    saved, nesterov = "--optimizer adamw --weight-policy 2bw", "--optimizer adamw --weight-policy nesterov"
    last = output.strip().splitlines()[-1]
    assert last.endswith(
        f"ConfigError: --resume: checkpoint {step_4} holds the optimizer state of {saved} (AdamW: exp_avg, "
        f"exp_avg_sq, step) but this run has {nesterov} (NAdam: exp_avg, exp_avg_sq, mu_product, step); "
        f"resume with {saved}, or start a new --out"
    ), output


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_after_a_killed_worker(reference, data, tmp_path):
    if shutil.which("torchrun") is None:
        pytest.skip("needs torchrun")
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PIPEWRIGHT_FAULTS": "kill:rank=1:step=4"}
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    cmd += ["-m", "pipewright", "train", *TINY, "--data", data, "--out", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"restart 1: resuming from {out / 'checkpoints' / 'step_4'}" in done.stderr
    assert _losses(out) == pytest.approx(reference, rel=1e-6)


@pytest.mark.slow
def test_a_stalled_dp_all_reduce_stops_the_run_with_every_rank_position(data, tmp_path, monkeypatch, capsys):
    # pp 2 x dp 2; rank 3 (pp 1, dp 1) stalls before its gradient all-reduce in step 0: its dp peer
    # (rank 2) waits in that all-reduce, rank 0 in the loss all-reduce with rank 2 - collectives, bounded
    # by --collective-timeout, not by the receive timeout or the process group's 600 s
    monkeypatch.setenv("PIPEWRIGHT_FAULTS", "stall-reduce:rank=3:step=0:ms=60000")
    out = tmp_path / "run"
    args = ["train", *TINY, "--data", data, "--out", str(out), "--pp", "2", "--dp", "2", "--steps", "2"]
    assert main([*args, "--recv-timeout", "120", "--collective-timeout", "2"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "HangError: hang: rank " in error and "did not complete within 2 s" in error, error
    report = (out / "hang-report.txt").read_text()
    assert error.endswith(f"every rank's position in {out / 'hang-report.txt'}")
    lines = report.split("\n\n", 1)[1].splitlines()
    assert lines[3].startswith("rank 3 (pp 1, dp 1): step 0, position 15 1REDUCE_GRAD")
    grid = {line.split(")")[0] + ")": line for line in lines[5:9]}
    assert "[1REDUCE_GRAD]" in grid["rank 3 (pp 1, dp 1)"]
    assert all(row.count("[") <= 1 for row in grid.values())


def _report(error: str, out: Path) -> list[str]:
    """The lines of ``out``'s hang report after its first (which repeats the error line)."""
    assert error.endswith(f"every rank's position in {out / 'hang-report.txt'}"), error
    return (out / "hang-report.txt").read_text().split("\n\n", 1)[1].splitlines()


@pytest.mark.slow
def test_a_stalled_checkpoint_save_or_evaluation_stops_with_every_rank_position(
    data, tmp_path, monkeypatch, capsys
):
    # two runs at once. Save: rank 1 stalls as it starts writing its shards of step_2; rank 0 waits in
    # DCP's collective for them, bounded by --collective-timeout (its process group's timeout).
    save = tmp_path / "save"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "PIPEWRIGHT_FAULTS": "stall-save:rank=1:step=2:ms=60000",
    }
    args = [*TINY, "--data", data, "--steps", "2", "--recv-timeout", "120", "--collective-timeout", "2"]
    cmd = [sys.executable, "-m", "pipewright", "train", *args, "--out", str(save)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # Evaluation: rank 1 stalls at position 0 of the first of the 2 batches after step 2; rank 0 runs
        # that batch's forwards (rank 1's receives are posted), then waits for its sends of the second
        monkeypatch.setenv("PIPEWRIGHT_FAULTS", "stall-eval:rank=1:step=2:ms=60000")
        evaluate = tmp_path / "evaluate"
        args = [*TINY, "--data", data, "--steps", "2", "--eval-every", "2", "--recv-timeout", "2"]
        assert main(["train", *args, "--collective-timeout", "2", "--out", str(evaluate)]) == 2
        output, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    error = capsys.readouterr().err.strip().splitlines()[-1]
    lines = _report(error, evaluate)
    # rank 1 posted its receives of F0 and F1 (a window of pp = 2 per channel, as on NCCL) before it
    # stalled, so F2 is rank 0's first send nobody receives
    waited = "0SEND_F2 was not received by rank 1 within 2 s (evaluating after step 2)"
    assert f"HangError: hang: rank 0 (pp 0): {waited}" in error, error
    assert lines[:2] == [
        "rank 0 (pp 0): evaluating after step 2, position 7 0SEND_F3",
        "rank 1 (pp 1): evaluating after step 2, position 0 1RECV_F0",
    ]
    grid = lines[3:5]  # the forward-only schedule, each rank's cell in brackets
    assert grid[0].split()[-1] == "[0SEND_F3]" and "[1RECV_F0]" in grid[1].split(), lines
    assert proc.returncode == 2, output
    error = output.strip().splitlines()[-1]
    stage = "saving checkpoint step_2, waiting for the other ranks' shards"
    assert f"HangError: hang: rank 0 (pp 0): {stage}: a collective did not complete within 2 s" in error, (
        error
    )
    assert _report(error, save) == [
        f"rank 0 (pp 0): {stage}",
        "rank 1 (pp 1): saving checkpoint step_2, writing its shards",
    ]
    assert not (save / "checkpoints" / "latest").exists()  # the save never committed


# ------------------------------------------------------------------------------------------- two hosts


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _namespaces_unavailable() -> str | None:
    if shutil.which("ip") is None or shutil.which("torchrun") is None:
        return "needs the ip and torchrun commands"
    probe = f"pwprobe{os.getpid()}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"cannot create network namespaces here ({made.stderr.strip() or 'ip netns add failed'})"
    _ip("netns", "del", probe)
    return None


@pytest.mark.slow
def test_two_hosts_over_a_veth_link_match_one_host(reference, data, tmp_path):
    reason = _namespaces_unavailable()
    if reason:
        pytest.skip(f"two-host test skipped: {reason}")
    tag = f"{os.getpid() % 100000}"
    hosts = [(f"pw{tag}a", f"v{tag}a", "10.213.0.1"), (f"pw{tag}b", f"v{tag}b", "10.213.0.2")]
    out = tmp_path / "run"
    procs: list[subprocess.Popen] = []
    try:
        for ns, _, _ in hosts:
            assert _ip("netns", "add", ns).returncode == 0
        assert _ip("link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1]).returncode == 0
        for ns, dev, addr in hosts:  # each host: loopback and its end of the link, nothing else
            for args in (
                ("link", "set", dev, "netns", ns),
                ("-n", ns, "addr", "add", f"{addr}/24", "dev", dev),
                ("-n", ns, "link", "set", dev, "up"),
                ("-n", ns, "link", "set", "lo", "up"),
            ):
                done = _ip(*args)
                assert done.returncode == 0, done.stderr
        for i, (ns, dev, addr) in enumerate(hosts):
            cmd = [
                "ip",
                "netns",
                "exec",
                ns,
                "env",
                f"GLOO_SOCKET_IFNAME={dev}",
                f"PYTHONPATH={ROOT / 'src'}",
            ]
            cmd += ["torchrun", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
            cmd += ["--rdzv-endpoint", f"{hosts[0][2]}:29400", "--rdzv-id", f"pw{tag}", "--local-addr", addr]
            cmd += ["--rdzv-conf", f"is_host={int(i == 0)},read_timeout=60", "--max-restarts", "0"]
            cmd += ["-m", "pipewright", "train", *TINY, "--data", data, "--out", str(out)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate(timeout=300)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for ns, _, _ in hosts:
            _ip("netns", "del", ns)  # removes its end of the veth pair, and so the pair
    assert not any(ns in _ip("netns", "list").stdout for ns, _, _ in hosts)
    # rank 0 (stage 0) ran on host a, rank 1 (stage 1) on host b: the pipeline crossed the link
    assert _losses(out) == pytest.approx(reference, rel=1e-6)
