"""One prepared GPU check: the CUDA paths proven against the CPU reference, then training MFU, FP8 speed and
decode speed, in one command under a hard time limit (8 minutes by default).

    bash benchmarks/gpu_check.sh OUT_DIR        (or: make gpu-check OUT=OUT_DIR)

Parts, in order of value, each its own process with its own time budget (a part that hangs is stopped at its
budget and the next one starts; time a part leaves unused passes to the parts after it):
  1. correctness: env (versions, optional packages, bf16 matmul peak, copy bandwidth); model_parity (tiny
     presets forward/MTP/backward on CUDA vs the CPU float32 reference, float32 and bfloat16; router replay);
     fp8_kernels (benchmarks/fp8_gpu.py's checks); engine_greedy (engine greedy == transformers generate,
     speculative == plain); train_steps (pretrain_composer.py under torchrun, one rank, NCCL);
  2. training speed: train_speed (ours, bf16 and each FP8 recipe) and train_speed_hf (transformers'
     DeepseekV3, each experts implementation): forward+backward tokens/s and MFU against the bf16 matmul peak
     measured in the same process, for a DeepSeek-V3-shaped MoE of 2.4B parameters at sequence 4096;
  3. decode: engine vs transformers generate at batch 1, 16, 64; speculative decoding with the MTP head;
then vllm (rollout.backend=vllm against our engine, where vLLM is installed) and xor_apply (a weight update's
XOR delta applied in place on the GPU, dense and sparse, against the reference; its bandwidth).

Writes OUT_DIR/report.json (after every part), OUT_DIR/log.txt (every part's output) and OUT_DIR/summary.txt
(the table printed last). Without CUDA it runs reduced (small sizes, CPU): every section is in the report
and the verdicts that need CUDA are marked skipped with the reason. Exit status 1 if any verdict failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "megatron-composer/gpu-check/1"
SECTIONS = ("environment", "correctness", "training_speed", "decode")
STATUSES = ("pass", "fail", "skipped", "error", "timeout")
# name, section, title, budget seconds on CUDA, budget reduced (CPU)
PARTS = [
    ("env", "environment", "versions, optional packages, bf16 matmul peak", 20, 30),
    ("model_parity", "correctness", "tiny presets fwd/MTP/bwd on the device vs CPU fp32; router replay", 40, 60),
    ("fp8_kernels", "correctness", "FP8 quantisation / GEMM / linear kernels vs reference", 65, 20),
    ("engine_greedy", "correctness", "engine greedy == transformers generate; speculative == plain", 35, 60),
    ("train_steps", "correctness", "pretrain_composer.py steps under torchrun, 1 rank", 55, 90),
    ("train_speed", "training_speed", "ours fwd+bwd tokens/s and MFU, bf16 and FP8 recipes", 80, 60),
    ("train_speed_hf", "training_speed", "transformers DeepseekV3 fwd+bwd tokens/s and MFU", 55, 60),
    ("decode", "decode", "decode tokens/s vs transformers generate; speculative (MTP)", 70, 60),
    ("vllm", "correctness", "rollout.backend=vllm vs our engine, a weight update (skipped without vLLM)", 45, 20),
    ("xor_apply", "correctness", "weight-update XOR applied on the device, dense and sparse, vs reference", 15, 10),
]


def part_status(data: dict | None, rc: int | None, timed_out: bool) -> tuple[str, str | None]:
    """(status, reason) of a part from its JSON and how its process ended."""
    if data is None:
        why = " before its budget ran out" if timed_out else f" (exit {rc})"
        return ("timeout" if timed_out else "error"), "the part wrote no report" + why
    checks = data.get("checks", [])
    if timed_out:
        return "timeout", f"stopped at its budget after {len(checks)} verdict(s)"
    if data.get("skipped"):
        return "skipped", data["skipped"]
    if any(c["status"] == "fail" for c in checks):
        return "fail", "; ".join(c["name"] for c in checks if c["status"] == "fail")[:500]
    if rc != 0:
        return "error", f"exit {rc}"
    if checks and all(c["status"] == "skipped" for c in checks):
        return "skipped", "; ".join(sorted({c.get("reason", "") for c in checks}))
    return "pass", None


def run_part(name: str, budget: float, reduced: bool, parts_dir: Path, log) -> dict:
    part_json = parts_dir / f"{name}.json"
    part_json.unlink(missing_ok=True)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check_parts.py"), name, "--out", str(part_json),
           "--budget", f"{budget:.1f}"] + (["--reduced"] if reduced else [])
    log.write(f"\n===== {name} (budget {budget:.0f} s): {' '.join(cmd)}\n")
    log.flush()
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    timed_out = False
    try:
        rc = proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        timed_out = True
        _stop(proc)
        rc = proc.returncode
    seconds = time.time() - t0
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything the part left running (it would hold the GPU)
    except ProcessLookupError:
        pass
    try:
        data = json.loads(part_json.read_text())
    except (OSError, ValueError):
        data = None
    status, reason = part_status(data, rc, timed_out)
    data = data or {"checks": [], "figures": {}, "notes": []}
    data.update(status=status, reason=reason, budget_s=round(budget, 1), wall_s=round(seconds, 1), exit_code=rc)
    log.write(f"===== {name}: {status} in {seconds:.1f} s{': ' + reason if reason else ''}\n")
    log.flush()
    return data


def _stop(proc: subprocess.Popen) -> None:
    """End the part's whole process group (it may have started torchrun and its workers)."""
    for sig, wait in ((signal.SIGTERM, 3), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def summary_table(report: dict) -> str:
    """The table printed last: one line per part, the failed verdicts, then the figures that matter."""
    counts = ", ".join(f"{v} {k}" for k, v in report["counts"].items())
    lines = [f"GPU check ({report['mode']}, {report.get('device_name', report['device'])}): parts {counts}; "
             f"{report['wall_s']:.0f} s of {report['limit_s']:.0f}",
             f"{'part':16} {'status':8} {'time':>6}  {'verdicts p/f/s':15} what"]
    for name, _, title, *_ in PARTS:
        d = report["parts"].get(name)
        if d is None:
            lines.append(f"{name:16} {'-':8} {'':>6}  {'':15} not run")
            continue
        c = d.get("checks", [])
        n = {s: sum(x["status"] == s for x in c) for s in ("pass", "fail", "skipped")}
        lines.append(f"{name:16} {d['status']:8} {d['wall_s']:5.0f}s  "
                     f"{n['pass']:>3}/{n['fail']}/{n['skipped']:<9} {title}")
        if d["status"] in ("skipped", "error", "timeout") and d.get("reason"):
            lines.append(f"{'':16}   reason: {d['reason'][:150]}")
    failed = [(name, x) for name, d in report["parts"].items() for x in d.get("checks", []) if x["status"] == "fail"]
    if failed:
        lines.append("FAILED:")
        lines += [f"  {name}: {x['name']}: {x.get('detail', '')[:200]}" for name, x in failed]
    env = report["parts"].get("env", {}).get("figures", {})
    if "bf16_matmul_tflops" in env:
        lines.append(f"bf16 matmul {env['bf16_matmul_tflops']:.1f} TFLOP/s (n={env.get('bf16_matmul_n')})"
                     + (f"; copy {env['copy_tb_per_s']:.2f} TB/s" if "copy_tb_per_s" in env else ""))
    ours = report["parts"].get("train_speed", {}).get("figures", {})
    hf = report["parts"].get("train_speed_hf", {}).get("figures", {})
    if ours.get("config"):
        c = ours["config"]
        lines.append(f"training fwd+bwd, {c['total_params'] / 1e9:.2f}B total / "
                     f"{c['active_params'] / 1e9:.2f}B active, batch {c['batch']} x seq {c['seq']}, "
                     f"MFU vs bf16 peak {c['bf16_matmul_peak_tflops']:.0f} TFLOP/s:")
    hf_best = hf.get("transformers", {}).get(hf.get("fastest")) if hf.get("fastest") else None
    for label, row in ours.get("ours", {}).items():
        extra = (f"  x{row['speedup_vs_bf16']:.2f} vs ours bf16 ({row.get('backend')})"
                 if "speedup_vs_bf16" in row else "")
        if hf_best:
            extra += f"  x{row['tokens_per_s'] / hf_best['tokens_per_s']:.2f} vs transformers[{hf['fastest']}]"
        lines.append(f"  ours {label:30} {row['tokens_per_s']:10.0f} tok/s  MFU {row['mfu']:6.1%}{extra}")
    for impl, row in hf.get("transformers", {}).items():
        lines.append(f"  transformers[{impl}]{'':{max(0, 22 - len(impl))}} "
                     f"{row['tokens_per_s']:10.0f} tok/s  MFU {row['mfu']:6.1%}")
    dec = report["parts"].get("decode", {}).get("figures", {})
    for r in dec.get("decode", []):
        if r["contender"] == "ours (Engine)":
            ratio = dec.get(f"decode_ratio_batch{r['batch']}", {})
            vs = f"  x{ratio['ratio']:.2f} vs {ratio['vs']}" if ratio else ""
            lines.append(f"decode batch {r['batch']:3}: ours {r['tokens_per_s']:9.1f} tok/s{vs}")
    for r in dec.get("speculative", []):
        if r["draft_tokens"]:
            lines.append(f"speculative batch {r['batch']:3}, {r['draft_tokens']} draft(s): "
                         f"acceptance {r['acceptance']:.1%}, x{r['speedup']:.2f} vs plain, "
                         f"{r['same_tokens']}/{r['batch']} equal to plain")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--limit", type=float, default=465.0, help="seconds for the whole check (the shell wrapper "
                    "kills it at 480)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--reduced", action="store_true", help="small sizes even on a GPU")
    mode.add_argument("--full", action="store_true", help="full sizes even without CUDA (slow)")
    ap.add_argument("--parts", default=",".join(p[0] for p in PARTS), help="comma-separated subset of the parts")
    ap.add_argument("--pretrain-run", help="run dir of pretrain_composer.py whose trained MTP head the decode part "
                    "uses (default: the 2.4B model with random weights)")
    args = ap.parse_args(argv)
    wanted = args.parts.split(",")
    unknown = sorted(set(wanted) - {p[0] for p in PARTS})
    if unknown:
        ap.error(f"unknown part(s) {unknown}; choose from {[p[0] for p in PARTS]}")
    import torch  # only to choose the mode; each part initialises the device itself

    cuda = torch.cuda.is_available()
    reduced = args.reduced or (not cuda and not args.full)
    # The CPU's C++ kernels would compile on first use (about 20 s each); the Python references define the
    # same numerics and are what the CPU reference needs. On CUDA the C++ kernels are not used at all.
    os.environ.setdefault("MEGATRON_COMPOSER_CPP", "0")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.pretrain_run:
        os.environ["GPU_CHECK_PRETRAIN_RUN"] = str(Path(args.pretrain_run).resolve())
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = {"schema": SCHEMA, "mode": "reduced" if reduced else "full", "device": "cuda" if cuda else "cpu",
              "limit_s": args.limit, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "sections": {s: [p[0] for p in PARTS if p[1] == s] for s in SECTIONS}, "parts": {}}
    t_start = time.time()
    selected = [p for p in PARTS if p[0] in wanted]
    # Each part's own JSON lives outside OUT_DIR (merged into report.json): the folder a lent GPU machine sends
    # back holds at most 8 files, and this one holds three (report.json, log.txt, summary.txt).
    parts_dir = Path(tempfile.mkdtemp(prefix="gpu_check_parts_"))
    with (args.out_dir / "log.txt").open("w") as log:
        for i, (name, section, title, budget_full, budget_reduced) in enumerate(selected):
            later = sum((p[4] if reduced else p[3]) for p in selected[i + 1:])
            remaining = args.limit - (time.time() - t_start)
            budget = min(remaining - later, remaining)  # its own budget plus what earlier parts left unused
            print(f"[{time.time() - t_start:5.0f} s] {name}: {title} (budget {budget:.0f} s)", flush=True)
            if budget < 3:
                data = {"status": "skipped", "reason": "no time left in the check's limit", "checks": [], "figures": {},
                        "notes": [], "budget_s": round(budget, 1), "wall_s": 0.0}
            else:
                data = run_part(name, budget, reduced, parts_dir, log)
            data.update(section=section, title=title)
            report["parts"][name] = data
            gpu = data.get("figures", {}).get("environment", {}).get("gpu")
            if gpu:  # read by the env part: this process never initialises CUDA (it would hold a context)
                report["device_name"] = gpu
            print(f"[{time.time() - t_start:5.0f} s] {name}: {data['status']}"
                  + (f" ({data['reason'][:200]})" if data.get("reason") else ""), flush=True)
            _write(report, t_start, args.out_dir)
    shutil.rmtree(parts_dir, ignore_errors=True)
    _write(report, t_start, args.out_dir)
    try:
        table = summary_table(report)
    except Exception as e:  # noqa: BLE001 - report.json is written already; say why the table is missing
        table = f"summary table failed ({type(e).__name__}: {e}); the figures are in {args.out_dir / 'report.json'}"
    (args.out_dir / "summary.txt").write_text(table + "\n")
    print("\n" + table)
    return 1 if any(d["status"] in ("fail", "error") for d in report["parts"].values()) else 0


def _write(report: dict, t_start: float, out_dir: Path) -> None:
    report["wall_s"] = round(time.time() - t_start, 1)
    counts = {s: 0 for s in STATUSES}
    for d in report["parts"].values():
        counts[d["status"]] += 1
    report["counts"] = {k: v for k, v in counts.items() if v}
    tmp = out_dir / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(out_dir / "report.json")


if __name__ == "__main__":
    sys.exit(main())
