#!/bin/bash
# Verifier: the task's tests decide the reward (1 when all pass, 0 otherwise).
mkdir -p /logs/verifier
cd /app
if gcc -std=c11 -Wall -O1 -o /tmp/run_tests /tests/test_strutil.c /app/strutil.c -I/app  && /tmp/run_tests; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
