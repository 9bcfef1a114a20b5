#!/usr/bin/env bash
# The worked examples of molt_lightning/bench/README.md ("molt-bench on real logs"): import every run in
# ../shared/real-logs (or $MOLT_REAL_LOGS), check each run set, and compare where the files allow it.
# Writes runs/real-logs/<name> (run sets) and bench-reports/real-logs/<name> (reports). About 20 s.
set -uo pipefail
cd "$(dirname "$0")/.."
L=${MOLT_REAL_LOGS:-../shared/real-logs}
B=${MOLT_BENCH:-.venv/bin/molt-bench}
R=runs/real-logs
P=bench-reports/real-logs
rm -rf "$R" && mkdir -p "$R" "$P"
set -x
# 1. verl: five PPO repeats (data parallel, 2 GPUs) against two sequence-parallel runs: a real seed-to-seed comparison
$B import "$L"/verl/dp_sp_repeats/dp_2_gpu_*.csv --protocol verl-gsm8k-ppo-qwen2.5-0.5b --source-stack verl \
    --label "verl PPO, DP on 2 GPUs" --out $R/verl-dp
$B import "$L"/verl/dp_sp_repeats/uly_sp2_*.csv --protocol verl-gsm8k-ppo-qwen2.5-0.5b --source-stack verl \
    --label "verl PPO, Ulysses SP2 x DP2" --out $R/verl-sp
$B check $R/verl-dp $R/verl-sp
$B compare $R/verl-sp $R/verl-dp --report $P/verl-sp-vs-dp
# 2. verl: Megatron against FSDP (and Megatron one-step off-policy), one run each
$B import "$L"/verl/q3b_mcore_base --protocol verl-gsm8k-qwen2.5-3b --source-stack verl --label "verl Megatron" \
    --out $R/verl-mcore
$B import "$L"/verl/q3b_fsdp_base --protocol verl-gsm8k-qwen2.5-3b --source-stack verl --label "verl FSDP" \
    --out $R/verl-fsdp
$B import "$L"/verl/q3b_mcore_off_ppl --protocol verl-gsm8k-qwen2.5-3b --set max_lag=1 --source-stack verl \
    --label "verl Megatron, one-step off-policy" --out $R/verl-mcore-offpolicy
$B check $R/verl-mcore $R/verl-fsdp $R/verl-mcore-offpolicy
$B compare $R/verl-mcore $R/verl-fsdp --report $P/verl-megatron-vs-fsdp
$B compare $R/verl-mcore-offpolicy $R/verl-mcore --allow-diff max_lag --by wall --report $P/verl-offpolicy-vs-sync
# 3. the other real files: what the check finds
$B import "$L"/nemo-rl/grpo-qwen2.5-7b-2n8g-megatron-sglang-noncolo-nccl.metrics.json \
    --protocol nemo-rl-grpo-qwen2.5-7b-smoke --source-stack nemo-rl --label "NeMo-RL Megatron 7B" --out $R/nemo-7b
$B import "$L"/nemo-rl/grpo-nanov3-30BA3B-2n8g-fsdp2.metrics.json --protocol nemo-rl-grpo-nanov3-30b-a3b \
    --source-stack nemo-rl --label "NeMo-RL FSDP2 30B-A3B" --out $R/nemo-30b-a3b
$B import "$L"/areal/logs_1xA100_fastest_completed.txt --protocol areal-gsm8k-fastest --source-stack areal \
    --seed-ids 0,1 --label "AReaL (a run and its relaunch)" --out $R/areal
# it finds errors here on purpose (NeMo-RL 7B collapses and its engine/trainer mismatch is far out of range): check
# exits 1 for "errors found", and the script succeeds when that is why (any other failure still fails it)
$B check $R/nemo-7b $R/nemo-30b-a3b $R/areal || [ $? -eq 1 ]
