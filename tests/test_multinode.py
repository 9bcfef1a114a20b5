"""Past one machine, on loopback: the trainer as two "nodes" (two launches of ``scripts/multinode.sh trainer``, i.e.
``torchrun --nnodes 2 --node-rank 0/1`` with its rendezvous on 127.0.0.1; gloo; one process each) and its rollouts
from the session's two ``molt serve`` servers as a pool (a third "node"). What a cluster user relies on: the ranks of
the two nodes train disjoint rows of every batch, both servers serve every version (the pool's fingerprint check at
every sync, and the servers' weights read back at the end), the audit accounts for every sample, a checkpoint the two
nodes wrote resumes on one, the two nodes take the steps one process takes (same seeds), and a node that dies stops
the run with a message that names it, after which both nodes resume from the last checkpoint losing nothing.

An engine server SIGKILLed under the two nodes fails its requests in flight (counted), the pool routes around it, and
when it is back the pool loads it the current weights before it serves; the run goes on and both servers serve its
last weights (``tests/test_remote.py`` checks the same pool's routing and failure accounting in one process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from test_distributed import ENV, ROOT, metrics, recipe, records

from molt_lightning.callbacks import audit
from molt_lightning.engines.fingerprint import Print, verify
from molt_lightning.engines.vllm.server import free_port

SCRIPT = ROOT / "scripts" / "multinode.sh"
P = 4  # prompts per step
STOPS_WITHIN_S = 180  # a node's death to the other's exit: gloo sees the peer's socket close at its next collective


def pool(servers, **kw) -> dict:
    return {"class_path": "molt_lightning.engines.EnginePool",
            "init_args": {"urls": [s.url for s in servers], "channel": "http", "down_timeout_s": 60, **kw}}


def audited(tmp_path: Path) -> tuple[dict, ...]:
    return ({"class_path": "molt_lightning.callbacks.SampleAudit",
             "init_args": {"path": str(tmp_path / "audit.jsonl")}},)


def launch(config: Path, steps: int, tmp_path: Path, strategy: str = "ddp", engines: str = "", *args: str,
           tag: str = "run", **extra: str) -> list[subprocess.Popen]:
    """Two trainer "nodes", as a cluster user starts them (one command per node), each in a session of its own."""
    env = {**ENV, **extra, "PYTHON": sys.executable, "NNODES": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "RECIPE": str(config), "STEPS": str(steps), "STRATEGY": strategy,
           "ACCELERATOR": "cpu", "ENGINES": engines, "CHANNEL": "http", "PYTHONUNBUFFERED": "1"}
    return [subprocess.Popen(["bash", str(SCRIPT), "trainer", *args], cwd=ROOT, env={**env, "NODE_RANK": str(k)},
                             stdout=open(tmp_path / f"{tag}-node{k}.log", "w"), stderr=subprocess.STDOUT,
                             start_new_session=True) for k in (0, 1)]


def finish(nodes: list[subprocess.Popen], tmp_path: Path, tag: str = "run", timeout: float = 600) -> None:
    for k, node in enumerate(nodes):
        try:
            node.wait(timeout)
        finally:
            for other in nodes:  # one node failed or hung: stop the other too
                if other.poll() is None and node.returncode != 0:
                    os.killpg(other.pid, signal.SIGKILL)
        assert node.returncode == 0, (tmp_path / f"{tag}-node{k}.log").read_text()[-4000:]


def one_node(config: Path, *args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "molt_lightning.commands.cli", "fit", "--config", str(config), *args],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


def lossless(tmp_path: Path, steps: int) -> list[dict]:
    """The audit after replaying the restarts: steps 1..steps once each, no prompt trained twice, every group whole,
    and the prompts trained are exactly those the last checkpoint counts as done (every prompt below its watermark
    and the ones above it), so a resume from it loses and repeats nothing; groups finish out of order at max_lag 1."""
    kept = audit.replay(audit.read(str(tmp_path / "audit.jsonl")))
    samples = [s for r in kept for s in r["samples"]]
    assert [r["step"] for r in kept] == list(range(1, steps + 1)) and all(r["members"] == 4 * P for r in kept)
    assert len(samples) == len(set(samples)) == steps * P, samples
    last = tmp_path / "ckpt" / "last.ckpt"  # FSDP2: a folder whose meta.pt holds everything but the tensors
    rollout = torch.load(last / "meta.pt" if last.is_dir() else last, weights_only=False)["molt"]["rollout"]
    assert set(samples) == set(range(rollout["next_prompt"])) | set(rollout["done_beyond"]), (samples, rollout)
    return kept


def check_rows(probe: Path, versions: list[int]) -> None:
    """Each step, the two nodes' ranks trained disjoint groups whose union is the batch."""
    steps0, steps1 = records(probe, 0, "step"), records(probe, 1, "step")
    assert [r["version"] for r in steps0] == [r["version"] for r in steps1] == versions
    for a, b in zip(steps0, steps1):
        assert a["samples"] and b["samples"] and not set(a["samples"]) & set(b["samples"])
        assert sorted(a["samples"] + b["samples"]) == a["all_samples"] == b["all_samples"]
        assert len(a["all_samples"]) == P


def wait_for(what, deadline_s: float, nodes: list[subprocess.Popen], log: Path) -> None:
    deadline = time.time() + deadline_s
    while not what() and time.time() < deadline and all(n.poll() is None for n in nodes):
        time.sleep(0.05)
    assert all(n.poll() is None for n in nodes) and what(), log.read_text()[-3000:]


def served(server, final: dict) -> list[str]:
    """Read the server's weights back (its worker's fingerprints) against the trainer's last weights."""
    import httpx

    body = {"method": "molt_fingerprints", "args": [{k: list(s.shape) for k, s in final.items()}, None], "timeout": 60}
    wire = httpx.post(f"{server.url}/collective_rpc", json=body, timeout=120).json()["results"][0]
    return verify(final, {k: Print.from_wire(w) for k, w in wire.items()}, server.url, -1)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_trainer_nodes_train_on_a_pool_of_servers_and_resume_on_one(strategy, molt_servers, tmp_path):
    config, probe = recipe(tmp_path, strategy, 3, engine=pool(molt_servers), callbacks=audited(tmp_path), devices=1,
                           max_lag=1)
    urls = ",".join(s.url for s in molt_servers)
    finish(launch(config, 3, tmp_path, strategy, urls), tmp_path)

    check_rows(probe, [0, 1, 2])
    assert [r["world"] for r in records(probe, 0, "shares") + records(probe, 1, "shares")] == [2, 2]
    if strategy == "fsdp2":  # each node holds half of every tensor
        assert all(0.4 <= share <= 0.6 for share in records(probe, 1, "shares")[0]["shares"].values())
    steps = metrics(tmp_path, "run").dropna(subset=["reward"])
    assert len(steps) == 3 and (steps["sync/verified"] == 1).all()  # every version verified on both servers
    final = torch.load(probe / "final_weights.pt", weights_only=False)
    for server in molt_servers:  # and both serve the last one: read back from each server's worker
        assert served(server, final) == []
    assert [r["version"] for r in lossless(tmp_path, 3)] == [1, 2, 3]

    # the two nodes' checkpoint (FSDP2: a distributed one, sharded by two ranks) resumes on one process
    resumed, probe1 = recipe(tmp_path, strategy if strategy == "fsdp2" else "auto", 4, name="resumed",
                             engine=pool(molt_servers), callbacks=audited(tmp_path), devices=1, max_lag=1)
    one_node(resumed, "--ckpt_path", str(tmp_path / "ckpt" / "last.ckpt"))
    starts = [r for r in audit.read(str(tmp_path / "audit.jsonl")) if r["event"] == "start"]
    assert [(r["step"], r["version"]) for r in starts] == [(0, 0), (3, 3)]
    assert [r["version"] for r in records(probe1, 0, "step")] == [3]
    lossless(tmp_path, 4)


@pytest.mark.slow
def test_two_trainer_nodes_take_the_steps_one_process_takes(tmp_path):
    """Same seeds, the torch engine on rank 0, max_lag 0: two nodes of one rank each and one process sample the same
    batches and log the same reward, loss and gradient norm (up to float32 reduction order)."""
    two, _ = recipe(tmp_path, "ddp", 3, name="two", devices=1, max_lag=0)
    finish(launch(two, 3, tmp_path, tag="two"), tmp_path, tag="two")
    one, _ = recipe(tmp_path, "auto", 3, name="one", devices=1, max_lag=0)
    one_node(one)
    a, b = (metrics(tmp_path, n).dropna(subset=["reward"]).reset_index() for n in ("two", "one"))
    assert len(a) == len(b) == 3 and (a["reward"] == b["reward"]).all()
    for column in ("loss/total", "grad_norm"):
        assert ((a[column] - b[column]).abs() <= 1e-4 * (1 + b[column].abs())).all(), (column, a[column], b[column])


@pytest.mark.slow
def test_a_dead_trainer_node_stops_the_run_naming_it_and_both_nodes_resume_losslessly(tmp_path):
    """SIGKILL node 1 (its torchrun and its rank) after a checkpoint: node 0 stops within a bounded time with an error
    that names the lost peer, leaves no process and no checkpoint half written; relaunched, the two nodes finish the
    run from the last checkpoint and the audit shows every prompt trained once."""
    steps, marks = 6, tmp_path / "marks"
    config, _ = recipe(tmp_path, "ddp", steps, devices=1, max_lag=1,
                       callbacks=(*audited(tmp_path), {"class_path": "kill_points.Marks"}))
    nodes = launch(config, steps, tmp_path, tag="killed", MOLT_MARKS=str(marks), MOLT_HOLD="1")
    deadline = time.time() + 600  # the event: both ranks held after their second step (the first one checkpointed)
    while time.time() < deadline and all(n.poll() is None for n in nodes) and len(list(marks.glob("held-*"))) < 2:
        time.sleep(0.05)
    assert all(n.poll() is None for n in nodes), (tmp_path / "killed-node0.log").read_text()[-3000:]
    ranks = [next(c.pid for c in psutil.Process(n.pid).children(recursive=True) if (marks / f"held-{c.pid}").exists())
             for n in nodes]
    family = psutil.Process(nodes[0].pid).children(recursive=True)
    for process in [psutil.Process(nodes[1].pid), *psutil.Process(nodes[1].pid).children(recursive=True)]:
        process.kill()  # node 1 dies: its torchrun agent and its rank (torchrun starts it in a session of its own)
    (marks / f"release-{ranks[0]}").touch()  # node 0 goes on to its next collective
    killed_at = time.time()
    nodes[0].wait(STOPS_WITHIN_S)
    stopped_after = time.time() - killed_at
    log = (tmp_path / "killed-node0.log").read_text()
    assert nodes[0].returncode != 0 and "lost contact with" in log, log[-4000:]
    assert not psutil.wait_procs(family, timeout=60)[1]  # nothing of node 0 left running
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False, map_location="cpu")  # whole, loadable
    assert last["global_step"] >= 1, stopped_after  # the held step (2) was cut before its checkpoint

    finish(launch(config, steps, tmp_path, "ddp", "", "--ckpt_path", "last", tag="resumed", MOLT_MARKS=str(marks)),
           tmp_path, tag="resumed")
    kept = lossless(tmp_path, steps)
    assert [r["version"] for r in kept] == list(range(1, steps + 1))


@pytest.mark.slow
def test_an_engine_server_killed_under_two_trainer_nodes_rejoins_with_the_current_weights(molt_servers, tmp_path):
    """Both nodes held after step 2 (max_lag 1: rollouts for the next step may be in flight, and the version-2 load);
    server 1 is killed, what it had in flight fails and is counted, it restarts on its port, and the pool (on node 0's
    rank 0) loads it the current version before it serves; released, the run trains its last step on both and ends
    with both serving its weights."""
    marks = tmp_path / "marks"
    config, probe = recipe(tmp_path, "ddp", 3, engine=pool(molt_servers, health_interval_s=0.5), devices=1,
                           max_lag=1, max_failure_rate=1.0, callbacks=({"class_path": "kill_points.Marks"},))
    nodes = launch(config, 3, tmp_path, "ddp", ",".join(s.url for s in molt_servers), tag="engine",
                   MOLT_MARKS=str(marks), MOLT_HOLD="1")
    log, down = tmp_path / "engine-node0.log", False
    try:
        wait_for(lambda: len(list(marks.glob("held-*"))) == 2, 600, nodes, log)
        molt_servers[1].stop(signal.SIGKILL)  # the server and its engine core die at once
        down = True
        wait_for(lambda: f"{molt_servers[1].url} is down" in log.read_text(), 120, nodes, log)
        molt_servers[1].start()  # the same port
        molt_servers[1].wait_ready(600)
        down = False
        wait_for(lambda: f"{molt_servers[1].url} serves again" in log.read_text(), 120, nodes, log)
        for held in marks.glob("held-*"):
            (marks / f"release-{held.name.split('-')[1]}").touch()
        finish(nodes, tmp_path, tag="engine")
    finally:
        if down:  # leave the session's server up for the tests after this one
            molt_servers[1].start()
            molt_servers[1].wait_ready(600)
    steps = metrics(tmp_path, "run").dropna(subset=["reward"])
    # what the kill cut (if anything was in flight) is counted as failed, each step's counts add up, and a group
    # trains the members that did not fail
    assert len(steps) == 3 and steps["samples/failed_total"].iloc[-1] == steps["samples/failed"].sum()
    assert steps["samples/trained"].sum() == steps["batch/samples"].sum() == steps["samples/trained_total"].iloc[-1]
    assert steps["samples/trained"].sum() + steps["samples/failed"].sum() <= steps["samples/finished_total"].iloc[-1]
    final = torch.load(probe / "final_weights.pt", weights_only=False)
    for server in molt_servers:
        assert served(server, final) == []


@pytest.mark.slow
def test_a_hung_trainer_node_stops_the_run_within_the_strategy_timeout(tmp_path):
    """A node that stops answering without closing its sockets (SIGSTOP: a frozen host, a cut cable) is noticed only
    at the process group's timeout: with the recipe's ``DDPStrategy(timeout=...)`` at 20 s, node 0 stops within it
    (plus its start-up of the collective) and names the lost peer."""
    marks = tmp_path / "marks"
    strategy = {"class_path": "lightning.pytorch.strategies.DDPStrategy", "init_args": {"timeout": "0:00:20"}}
    config, _ = recipe(tmp_path, strategy, 6, devices=1, max_lag=1, callbacks=({"class_path": "kill_points.Marks"},))
    nodes = launch(config, 6, tmp_path, "", tag="hung", MOLT_MARKS=str(marks), MOLT_HOLD="1")
    log = tmp_path / "hung-node0.log"
    node1 = [psutil.Process(nodes[1].pid), *psutil.Process(nodes[1].pid).children(recursive=True)]
    try:
        wait_for(lambda: len(list(marks.glob("held-*"))) == 2, 600, nodes, log)
        node1 = [psutil.Process(nodes[1].pid), *psutil.Process(nodes[1].pid).children(recursive=True)]
        rank0 = next(c.pid for c in psutil.Process(nodes[0].pid).children(recursive=True)
                     if (marks / f"held-{c.pid}").exists())
        for process in node1:
            process.suspend()  # node 1 hangs: its sockets stay open
        (marks / f"release-{rank0}").touch()
        released = time.time()
        nodes[0].wait(STOPS_WITHIN_S)
        stopped_after = time.time() - released
    finally:
        for process in node1:
            process.kill()
    text = log.read_text()
    assert nodes[0].returncode != 0 and "lost contact with" in text, text[-4000:]
    assert 20 <= stopped_after < STOPS_WITHIN_S, stopped_after


def test_a_lost_peer_is_named_and_other_errors_are_not(tmp_path, monkeypatch):
    """``lost_peer``: the backend's words for a gone peer (gloo's, without its boilerplate) with this rank and node;
    other errors, and any error outside a process group, are left alone."""
    import torch.distributed as dist

    from molt_lightning.trainer.parallel import lost_peer

    gone = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.7]:41234. This is "
                        "typically caused by a remote worker crashing. GLHF!")
    assert lost_peer(gone) is None  # no process group
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "4")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        why = lost_peer(gone)
        assert why.startswith("trainer rank 0 of 1 (node 1 of 4) lost contact with another rank: Connection closed by "
                              "peer [10.0.0.7]:41234. A trainer process") and "--ckpt_path last" in why
        assert "GLHF" not in why and lost_peer(RuntimeError("CUDA out of memory")) is None
    finally:
        dist.destroy_process_group()
