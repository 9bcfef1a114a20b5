#!/bin/bash
# The verifier: reward 1 when the check passes, else 0.
mkdir -p /logs/verifier
reward=0
cd /app && [ ! -e /app/draft.txt ] && [ "$(cat /app/final.txt)" = "version one" ] && reward=1
echo $reward > /logs/verifier/reward.txt
