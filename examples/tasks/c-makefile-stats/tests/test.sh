#!/bin/bash
# Verifier: 1 when every case of cases.json passes and the C sources are as given, 0 otherwise. Each case runs in
# its own child under `judge` (the local backend's sandbox nested in this one, where /tests is empty) and prints
# what the build does; the harness, which never loads that code, compares it with the expected output
# (tools/case_harness.py). The sources are compared here, as the agent's own regular files.
mkdir -p /logs/verifier
cd /app
unchanged() { [ -f "$1" ] && [ ! -L "$1" ] && cmp -s "$1" "$2"; }
if python3 -I /tests/harness.py /tests/cases.json && unchanged main.c /tests/orig_main.c &&
   unchanged util.c /tests/orig_util.c; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
