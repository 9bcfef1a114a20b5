#!/bin/bash
# The verifier: reward 1 when the check passes, else 0.
mkdir -p /logs/verifier
reward=0
cd /app && [ "$(tr -d ' \n' < /app/count.txt)" = "5" ] && reward=1
echo $reward > /logs/verifier/reward.txt
