"""s/step of the pool recipe with 1 vs 2 trainer "nodes" and 1 vs 2 engine servers, on this one machine.

Two ``molt serve`` servers start once (server i on core i) and serve every configuration; each configuration runs
``recipes/pool.yaml`` for ``--steps`` steps: one trainer node is ``molt fit`` (one process), two are two launches of
``scripts/multinode.sh trainer`` (``torchrun --nnodes 2``, a rendezvous on 127.0.0.1, DDP over gloo, one process
each). The table gives the median s/step (the first two steps left out: start-up), its ratio to the first row
(measured in the same run), and where a step's time went (generation throughput, the trainer's compute and its idle
share, the weight sync). On 2 cores the trainer processes and the servers share the same two cores, so this measures
the cost of the multi-node machinery (the broadcast of each batch, the gradient all-reduce, the rendezvous), not a
speed-up: see docs/scale.md, "Past one machine".

    python benchmarks/multinode_scaling.py [--steps 20] [--policy molt_lightning.models.tiny.arithmetic_policy]
        [--out benchmarks/results/multinode_scaling_cpu2.md]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from molt_lightning.engines.vllm.server import LocalServer, free_port  # noqa: E402
from molt_lightning.trainer.policy import policy_folder  # noqa: E402

CONFIGS = [(1, 1), (1, 2), (2, 1), (2, 2)]  # (trainer nodes, engine servers)
COLUMNS = {"perf/step_time_s": "s/step", "perf/gen_tokens_per_s": "gen tok/s", "perf/train_compute_s": "train s",
           "perf/trainer_idle_frac": "trainer idle", "perf/weight_sync_s": "sync s"}


def run(nodes: int, urls: list[str], steps: int, policy: str, out: Path) -> pd.DataFrame:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    args = ["--model.policy", policy, "--trainer.logger.init_args.save_dir", str(out),
            "--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "false"]
    if nodes == 1:
        cmds = [[sys.executable, "-m", "molt_lightning.commands.cli", "fit", "--config", "recipes/pool.yaml",
                 "--model.engine.init_args.servers", "0", "--model.engine.init_args.urls", f"[{','.join(urls)}]",
                 "--model.engine.init_args.channel", "http", "--trainer.max_steps", str(steps), *args]]
        envs = [env]
    else:
        cmds = [["bash", "scripts/multinode.sh", "trainer", *args]] * nodes
        common = {**env, "PYTHON": sys.executable, "NNODES": str(nodes), "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": str(free_port()), "ENGINES": ",".join(urls), "CHANNEL": "http", "STEPS": str(steps),
                  "ACCELERATOR": "cpu", "RECIPE": "recipes/pool.yaml"}
        envs = [{**common, "NODE_RANK": str(k)} for k in range(nodes)]
    procs = [subprocess.Popen(c, cwd=ROOT, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for c, e in zip(cmds, envs)]
    for p in procs:
        _, err = p.communicate(timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"{nodes} node(s), {len(urls)} server(s) failed:\n{err[-3000:]}")
    [csv] = list(out.glob("pool/*/metrics.csv"))
    return pd.read_csv(csv).dropna(subset=["reward"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--policy", default="molt_lightning.models.tiny.arithmetic_policy")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    folder = policy_folder(a.policy)
    servers = [LocalServer(folder, cpu_threads=str(i)) for i in range(2)]
    rows = []
    try:
        for s in servers:
            s.wait_ready(900)
        for nodes, n_servers in CONFIGS:
            with tempfile.TemporaryDirectory() as tmp:
                df = run(nodes, [s.url for s in servers[:n_servers]], a.steps, folder, Path(tmp)).iloc[2:]
            row = {"trainer nodes x processes": f"{nodes} x 1", "engine servers": n_servers}
            row.update({name: df[col].median() for col, name in COLUMNS.items() if col in df})
            rows.append(row)
            print(row, flush=True)
    finally:
        for s in servers:
            s.stop()
    table = pd.DataFrame(rows)
    table.insert(3, "vs first", table["s/step"].iloc[0] / table["s/step"])
    text = (f"# Multi-node scaling on this machine ({os.cpu_count()} cores; `{a.policy}`, `recipes/pool.yaml`, "
            f"{a.steps} steps, median of steps 2-{a.steps - 1}; 'vs first' is speed against the first row)\n\n"
            + table.to_markdown(index=False, floatfmt=".3f") + "\n")
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
