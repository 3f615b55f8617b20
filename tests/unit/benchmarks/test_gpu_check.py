"""The one-command GPU check runs reduced on the CPU (what CI can run) and its report has every section and
part, with the verdicts that need CUDA marked skipped with the reason; a part past its budget is stopped."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402
import gpu_check_parts  # noqa: E402
import pytest  # noqa: E402


@pytest.mark.e2e  # the whole reduced check: minutes on 2 cores
def test_reduced_check_report_has_every_section_and_cuda_parts_skipped(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(out), "--reduced"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:] + (out / "log.txt").read_text()[-6000:]
    report = json.loads((out / "report.json").read_text())
    # a lent machine returns 8 files at most
    assert sorted(p.name for p in out.iterdir()) == ["log.txt", "report.json", "summary.txt"]
    assert report["schema"] == gpu_check.SCHEMA and report["mode"] == "reduced" and report["device"] == "cpu"
    assert set(report["sections"]) == set(gpu_check.SECTIONS)
    assert [name for name, *_ in gpu_check.PARTS] == list(report["parts"])
    for name, part in report["parts"].items():
        assert part["status"] in ("pass", "skipped"), (name, part["status"], part.get("reason"))
        assert part["section"] in gpu_check.SECTIONS and part["wall_s"] <= part["budget_s"] + 15
        if part["status"] == "skipped":
            assert part["reason"], name
        for c in part["checks"]:
            assert c["status"] in ("pass", "skipped") and c["name"], (name, c)
            if c["status"] == "skipped":
                assert c["reason"], (name, c)
            if c.get("reason") == gpu_check_parts.NOT_CUDA:
                assert c["computed_status"] == "pass", (name, c)  # the CPU run of a CUDA verdict agreed too
    parts = report["parts"]
    assert parts["fp8_kernels"]["status"] == "skipped" and "CUDA" in parts["fp8_kernels"]["reason"]
    parity = parts["model_parity"]["checks"]
    assert sum(c.get("reason") == gpu_check_parts.NOT_CUDA for c in parity) == 6  # fp32 + free routing, 3 presets
    assert sum(c["status"] == "pass" and "bfloat16" in c["name"] for c in parity) == 3
    assert [c["status"] for c in parts["engine_greedy"]["checks"]] == ["pass", "pass"]
    steps = parts["train_steps"]["checks"]
    assert steps[0]["status"] == "pass" and "3/3 steps" in steps[0]["detail"]
    assert any("FSDP" in c["name"] and c["status"] == "skipped" for c in steps)
    ours = parts["train_speed"]["figures"]["ours"]
    assert set(ours) == {"bf16"} | {label for label, _ in gpu_check_parts.fp8_recipes()}
    assert all(row["tokens_per_s"] > 0 and 0 < row["mfu"] for row in ours.values())
    hf = parts["train_speed_hf"]["figures"]
    assert hf["fastest"] in hf["transformers"]
    decode = parts["decode"]["figures"]
    assert {r["batch"] for r in decode["decode"] if r["contender"] == "ours (Engine)"} == {1, 4}
    assert {(r["batch"], r["draft_tokens"]) for r in decode["speculative"]} == {(1, 0), (1, 2), (4, 0), (4, 2)}
    summary = (out / "summary.txt").read_text()
    assert summary.strip() in r.stdout and all(name in summary for name, *_ in gpu_check.PARTS)


def test_part_past_its_budget_is_stopped_and_reported(tmp_path):
    with open(tmp_path / "log.txt", "w") as log:
        data = gpu_check.run_part("env", 0.3, True, tmp_path, log)
    assert data["status"] == "timeout" and data["wall_s"] < 15, data
    assert gpu_check.part_status({"checks": [{"name": "a", "status": "fail"}]}, 0, False)[0] == "fail"
    assert gpu_check.part_status({"checks": [{"name": "a", "status": "pass"}]}, 1, False)[0] == "error"
    assert gpu_check.part_status({"checks": [], "skipped": "why"}, 0, False) == ("skipped", "why")
