#!/usr/bin/env bash
# Multi-node runs: N vLLM engine servers (`molt serve`) and a trainer spread over nodes by Lightning (DDP), the
# trainer's rank 0 owning the rollout source and an EnginePool over the servers (molt_lightning/trainer/parallel.py).
#
#   scripts/multinode.sh local            one machine: 2 servers on loopback + 2 trainer processes (ddp), 3 steps
#   scripts/multinode.sh server           on each engine node: one server on 0.0.0.0:${PORT:-8000} (needs MOLT_API_KEY)
#   scripts/multinode.sh trainer          on each trainer node, under torchrun (NODE_RANK, MASTER_ADDR, ENGINES)
#   (SLURM: scripts/molt.sbatch starts the servers and the trainer nodes of one allocation; docs/scale.md)
#
# Environment: PYTHON (default python), POLICY (a folder or dotted path; default the tiny arithmetic policy; every
# node needs the same), MOLT_API_KEY (the shared token: servers on other hosts refuse weight and control requests
# without it), ENGINES (comma-separated server URLs, e.g. http://engine-1:8000,http://engine-2:8000), NNODES,
# GPUS_PER_NODE (trainer processes per node, default 1), STEPS, CHANNEL, STRATEGY (ddp, fsdp2; empty: the recipe's,
# e.g. DDPStrategy with a timeout), MASTER_PORT, RECIPE (its engine is used when ENGINES is empty). Weights cross machines in the HTTP body
# (CHANNEL=http, the default; the shared-memory channel needs the servers on the trainer's rank-0 machine). On GPU
# clusters CHANNEL=nccl (on the servers and the trainer) broadcasts them over NCCL instead: servers start with
# `molt serve --nccl`, and each server's workers dial the trainer's rank 0 on port 29600 + its index in ENGINES.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
STRATEGY=${STRATEGY-ddp}
POLICY=${POLICY:-molt_lightning.models.tiny.arithmetic_policy}
STEPS=${STEPS:-3}
RECIPE=${RECIPE:-recipes/pool.yaml}

pool_args() {  # the recipe's engine: a pool over $ENGINES (none: the recipe's own engine, on the trainer's rank 0)
  [ -n "${ENGINES:-}" ] || return 0
  echo --model.engine.init_args.servers 0 --model.engine.init_args.urls "[${ENGINES}]" \
       --model.engine.init_args.channel "${CHANNEL:-http}"
}

case "${1:-}" in
  local)
    export MOLT_API_KEY=${MOLT_API_KEY:-local-$RANDOM$RANDOM}
    export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
    pids=()
    cleanup() { for pid in "${pids[@]}"; do kill -- "-$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
    trap cleanup EXIT
    for i in 0 1; do  # each in its own process group (setsid): the cleanup stops vLLM's engine core with it
      setsid "$PYTHON" -m molt_lightning.commands.serve --policy "$POLICY" --port $((18100 + i)) --cpu-threads "$i" \
        > "/tmp/molt-multinode-server-$i.log" 2>&1 &
      pids+=($!)
    done
    for i in 0 1; do
      for _ in $(seq 300); do curl -sf "http://127.0.0.1:$((18100 + i))/health" > /dev/null && break; sleep 1; done
    done
    export ENGINES=http://127.0.0.1:18100,http://127.0.0.1:18101 CHANNEL=shm  # one machine: files in /dev/shm
    "$PYTHON" -m molt_lightning.commands.cli fit --config "$RECIPE" $(pool_args) --trainer.strategy ddp \
      --trainer.devices 2 --trainer.max_steps "$STEPS" --trainer.logger false --trainer.enable_checkpointing false \
      --model.rollout.group_size 4 \
      --model.rollout.prompts_per_step 4 --model.torch_threads 1
    ;;
  server)
    : "${MOLT_API_KEY:?set MOLT_API_KEY, the token the trainer will send}"
    nccl=(); [ "${CHANNEL:-http}" = nccl ] && nccl=(--nccl)
    exec "$PYTHON" -m molt_lightning.commands.serve --policy "$POLICY" --host 0.0.0.0 --port "${PORT:-8000}" "${nccl[@]}"
    ;;
  trainer)
    : "${MASTER_ADDR:?}" "${NODE_RANK:?}" "${NNODES:?}"
    exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "${GPUS_PER_NODE:-1}" \
      --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}" \
      -m molt_lightning.commands.cli fit --config "$RECIPE" $(pool_args) ${STRATEGY:+--trainer.strategy "$STRATEGY"} \
      --trainer.num_nodes "$NNODES" --trainer.devices "${GPUS_PER_NODE:-1}" \
      --trainer.accelerator "${ACCELERATOR:-auto}" --trainer.max_steps "$STEPS" "${@:2}"
    ;;
  *)
    sed -n 2,17p "$0"
    exit 2
    ;;
esac
