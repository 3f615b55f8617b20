"""A verifier's harness that never loads the code under test into its own process.

Each case of a task's `tests/cases.json` runs in its own child under `judge` (the local backend's sandbox nested in
the verifier's, where /tests holds only what the task lets the code read): the child prints what the code under
test computes, and this process, which holds the expected outputs, compares. A case passes when its child exits 0
and prints exactly the expected text (trailing newlines aside); the task passes when every case of the file ran
and passed. A backend without `judge` runs the children directly (docs/SANDBOX.md).

    python3 -I /tests/harness.py /tests/cases.json

cases.json: {"cases": [{"name": ..., "argv": [...], "stdin": "..." (optional), "expect": "..."}, ...]}. The
bundled tasks hold a copy of this file as tests/harness.py; `tools/make_task_cases.py` fills each case's "expect"
from the task's reference solution.
"""

import json
import os
import subprocess
import sys

JUDGE = "/opt/verifier/bin/judge"
TIMEOUT_S = 60
OUTPUT_SLACK = 4096  # read this much past the expected output, so that a flood is cut short


def run_case(case: dict, judge: list[str]) -> tuple[bool, str]:
    """(passed, what the child printed), the child started in this process's working directory."""
    expect = case["expect"]
    limit = len(expect.encode()) + OUTPUT_SLACK
    proc = subprocess.Popen(judge + case["argv"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        proc.stdin.write(case.get("stdin", "").encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    out = proc.stdout.read(limit + 1)
    proc.stdout.close()
    try:
        code = proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return False, "(timed out)"
    got = out.decode("utf-8", "replace")
    return code == 0 and len(out) <= limit and got.rstrip("\n") == expect.rstrip("\n"), got


def main(path: str) -> int:
    with open(path) as f:
        cases = json.load(f)["cases"]
    judge = [JUDGE] if os.access(JUDGE, os.X_OK) else []
    passed = 0
    for case in cases:
        ok, got = run_case(case, judge)
        passed += ok
        print(f"{'PASS' if ok else 'FAIL'} {case['name']}" + ("" if ok else f": printed {got[:200]!r}"))
    print(f"passed {passed} of {len(cases)} cases")
    return 0 if cases and passed == len(cases) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
