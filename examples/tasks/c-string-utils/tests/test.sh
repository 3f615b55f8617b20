#!/bin/bash
# Verifier: the task's tests decide the reward (1 when all pass, 0 otherwise). They run inside `judge`, the local
# backend's sandbox nested in this one (rl/sandbox/local.py), where the code under test cannot reach this script,
# its processes or its reward folder; a backend without it runs them here.
mkdir -p /logs/verifier
cd /app
judge=/opt/verifier/bin/judge; [ -x "$judge" ] || judge=
build='gcc -std=c11 -Wall -O1 -o /tmp/run_tests /tests/test_strutil.c /app/strutil.c -I/app'
if $judge sh -c "$build && /tmp/run_tests"; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
