"""``scripts/molt.sbatch`` run as sbatch would, on this machine, with a fake ``srun`` and ``scontrol``
(``tests/helpers/fake_slurm``): a 3-node allocation (the same loopback host three times) runs one ``molt serve`` step
and a 2-node trainer step (Lightning's SLURMEnvironment, gloo) that trains 2 steps over the server with verified
syncs, and leaves no process behind; an allocation too small is refused before anything starts. The fakes run every
task locally, each in its own process group, and log each step's options and command line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "tests" / "helpers" / "fake_slurm"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def sbatch(tmp_path: Path, hosts: int, *args: str, timeout: float = 60, **env) -> subprocess.CompletedProcess:
    """``bash scripts/molt.sbatch ARGS`` in an allocation of ``hosts`` loopback nodes, as sbatch starts it."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "MOLT_API_KEY"}
    env = {**base, "PATH": f"{FAKE}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "molt",
           "SLURM_JOB_NODELIST": ",".join(["127.0.0.1"] * hosts), "SLURM_SUBMIT_DIR": str(ROOT),
           "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "FAKE_SLURM_LOG": str(tmp_path / "srun.jsonl"), **env}
    return subprocess.run(["bash", str(ROOT / "scripts" / "molt.sbatch"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


def steps(tmp_path: Path) -> list[dict]:
    log = tmp_path / "srun.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def left_behind(groups: set[int], port: int) -> list[psutil.Process]:
    """Live (not zombie) processes in the fake's task groups, or serving on ``port``."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            mine = os.getpgid(p.pid) in groups or (
                "molt_lightning.commands.serve" in (p.info["cmdline"] or []) and str(port) in p.info["cmdline"])
        except (psutil.Error, ProcessLookupError):
            continue
        if mine and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p)
    return found


@pytest.mark.slow  # a vLLM server and two trainer processes: ~30 s on 2 cores (up to ~2 min when busy)
def test_sbatch_script_serves_and_trains_over_two_trainer_nodes(tmp_path):
    port, master_port = free_ports(2)
    out = sbatch(tmp_path, 3, "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.enable_checkpointing",
                 "false", "--trainer.enable_progress_bar", "false", "--model.rollout.group_size", "4",
                 "--model.rollout.prompts_per_step", "4", "--model.torch_threads", "1", timeout=900,
                 ENGINE_NODES="1", TRAINER_NODES="2", GPUS_PER_NODE="1", ACCELERATOR="cpu", STEPS="2",
                 PORT=str(port), MASTER_PORT=str(master_port), HOST="127.0.0.1")
    assert out.returncode == 0, out.stderr[-6000:]

    server, trainer = steps(tmp_path)
    assert (server["nodes"], server["ntasks"], server["ntasks_per_node"], server["relative"]) == (1, 1, 1, 0)
    assert server["argv"][:2] == ["bash", "-c"] and "molt_lightning.commands.serve" in server["argv"][2]
    assert (trainer["nodes"], trainer["ntasks"], trainer["ntasks_per_node"], trainer["relative"]) == (2, 2, 1, 1)
    argv = trainer["argv"]
    assert argv[:5] == [sys.executable, "-m", "molt_lightning.commands.cli", "fit", "--config"]
    flags = dict(zip(argv[4::2], argv[5::2]))  # the script's flags and the test's, as --flag value pairs
    assert flags["--model.engine.init_args.urls"] == f"[http://127.0.0.1:{port}]"
    assert flags["--trainer.num_nodes"] == "2" and flags["--trainer.devices"] == "1"
    assert flags["--model.engine.init_args.servers"] == "0" and flags["--trainer.max_steps"] == "2"
    assert flags["--trainer.strategy"] == "ddp" and flags["--trainer.accelerator"] == "cpu"
    assert flags["--config"] == "recipes/pool.yaml" and flags["--trainer.logger.init_args.save_dir"] == str(tmp_path)

    [run] = list((tmp_path / "pool").iterdir())  # the recipe's CSVLogger (name pool), rank 0 only
    metrics = pd.read_csv(run / "metrics.csv").dropna(subset=["reward"])
    assert len(metrics) == 2 and (metrics["sync/verified"] == 1).all(), metrics.T

    groups = {pid for step in (server, trainer) for pid in step["pids"]}
    gone, alive = psutil.wait_procs(left_behind(groups, port), timeout=30)
    assert not alive, [p.cmdline() for p in alive]


def test_sbatch_script_refuses_a_small_allocation_and_the_fake_srun_an_unknown_option(tmp_path):
    out = sbatch(tmp_path, 3, ENGINE_NODES="2", TRAINER_NODES="2", PYTHON="false")
    assert out.returncode != 0
    assert "ENGINE_NODES=2 + TRAINER_NODES=2 needs 4 nodes, the allocation has 3" in out.stderr, out.stderr
    assert steps(tmp_path) == []  # before any step started

    # the server step dies at once: said, and no trainer step
    out = sbatch(tmp_path, 2, PYTHON="false", MOLT_API_KEY="k", PORT=str(free_ports(1)[0]))
    assert out.returncode == 1 and "the server step exited (status 1)" in out.stderr, out.stderr
    assert [s["relative"] for s in steps(tmp_path)] == [0]

    out = subprocess.run([str(FAKE / "srun"), "--exclusive", "true"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unknown option --exclusive" in out.stderr
    env = {**os.environ, "SLURM_JOB_NODELIST": "a,b,c", "SLURM_JOB_NAME": "molt"}
    out = subprocess.run([str(FAKE / "srun"), "-N", "2", "--ntasks-per-node=2", "--relative=1", "bash", "-c",
                          "echo $SLURM_PROCID $SLURM_LOCALID $SLURM_NODEID $SLURMD_NODENAME $SLURM_NTASKS"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert sorted(out.stdout.splitlines()) == ["0 0 0 b 4", "1 1 0 b 4", "2 0 1 c 4", "3 1 1 c 4"], out.stderr
