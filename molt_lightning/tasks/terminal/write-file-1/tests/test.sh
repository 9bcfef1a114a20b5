#!/bin/bash
# The verifier: reward 1 when the check passes, else 0.
mkdir -p /logs/verifier
reward=0
cd /app && [ "$(cat /app/greeting.txt)" = "hello" ] && reward=1
echo $reward > /logs/verifier/reward.txt
