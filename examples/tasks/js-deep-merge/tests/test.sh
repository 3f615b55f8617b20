#!/bin/bash
# Verifier: 1 when every case of cases.json passes, 0 otherwise. Each case runs in its own child under `judge` (the
# local backend's sandbox nested in this one, where /tests is empty) and prints what the code under test computes;
# the harness, which never loads that code, compares it with the expected output (tools/case_harness.py).
mkdir -p /logs/verifier
cd /app
if python3 -I /tests/harness.py /tests/cases.json; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
