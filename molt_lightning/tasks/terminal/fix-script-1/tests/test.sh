#!/bin/bash
# The verifier: reward 1 when the check passes, else 0.
mkdir -p /logs/verifier
reward=0
cd /app && timeout 10 bash run.sh && [ "$(cat /app/out.txt)" = "hello" ] && reward=1
echo $reward > /logs/verifier/reward.txt
