#!/bin/bash
# Verifier: the task's tests decide the reward (1 when all pass, 0 otherwise).
mkdir -p /logs/verifier
cd /app
if node /tests/test_semver.js; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
