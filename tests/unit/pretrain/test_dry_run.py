"""The planner's FSDP estimate (hand-computed small cases) and the dry run (pretrain/dry_run.py): one rank of a
world on fake tensors and the fake process group, measured by torch's memory tracker against the estimate;
and every shipped Kimi K2.5 example layout dry-run at its world size."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_composer.config import ConfigError
from megatron_composer.model import Transformer, get_preset
from megatron_composer.parallel.cost import (
    StepPlan,
    activation_bytes,
    backward_peak,
    comm_per_step,
    fsdp_comm_per_microbatch,
    fsdp_units,
    fsdp_working_set,
    memory_per_rank,
)
from megatron_composer.parallel.dims import ParallelConfig, ParallelDims

ROOT = Path(__file__).resolve().parents[3]
GiB = 2**30


def _numels(cfg, ep: int) -> tuple[int, int, dict]:
    """(dense, routed-expert elements on one rank, elements per FSDP unit) counted from the model itself."""
    model = Transformer(cfg)
    dense = expert = 0
    units: dict[str, int] = {}
    for name, p in model.named_parameters():
        n = p.numel() // ep if ".experts." in name and "shared" not in name else p.numel()
        if ".experts." in name and "shared" not in name:
            expert += n
        else:
            dense += n
        parts = name.split(".")
        unit = (".".join(parts[:2]) if parts[0] == "layers" else
                ".".join(parts[:3]) if parts[0] == "mtp" and parts[2] == "block" else "root")
        units[unit] = units.get(unit, 0) + n
    return dense, expert, units


def test_fsdp_shards_parameters_gradients_and_moments_over_dp_cp_and_expert_data_parallel():
    cfg = get_preset("tiny-kimi-k2.5")
    dense, expert, _ = _numels(cfg, ep=2)
    dims = ParallelDims(16, cp=2, ep=2)  # dense replicas dp*cp = 16, expert-data-parallel 8
    replicated = memory_per_rank(cfg, StepPlan(dims, seq_len=64, micro_batch=1))
    sharded = memory_per_rank(cfg, StepPlan(dims, seq_len=64, micro_batch=1, fsdp=True))
    n = math.ceil(dense / 16) + math.ceil(expert / 8)
    assert sharded["params"] == sharded["grads"] == 4 * n and sharded["optimizer"] == 8 * n
    assert replicated["params"] == 4 * (dense + expert)
    # HSDP: two replicas of each shard hold twice as much
    hsdp = memory_per_rank(cfg, StepPlan(ParallelDims(16, cp=2, ep=2, dp_replicate=2), 64, 1, fsdp=True,
                                       dp_replicate=2))
    assert hsdp["params"] == 4 * (math.ceil(dense / 8) + math.ceil(expert / 4))


def test_fsdp_units_working_set_and_collectives_by_hand():
    cfg = get_preset("tiny-kimi-k2.5")
    _, _, units = _numels(cfg, ep=2)
    dims = ParallelDims(8, ep=2)
    lay = StepPlan(dims, seq_len=64, micro_batch=1, fsdp=True, gather_bytes=2)
    got = {k: sum(v) for k, v in fsdp_units(cfg, lay).items()}
    assert got == units
    dense, experts = fsdp_units(cfg, lay)["mtp.0.block"]  # backward reaches the MTP block first; it prefetches none
    att, ffn = fsdp_working_set(cfg, lay, phase="attention"), fsdp_working_set(cfg, lay, phase="ffn")
    assert att["root"] == ffn["root"] == 2 * units["root"]
    assert att["block"] == ffn["block"] == 2 * dense and att["prefetch"] == ffn["prefetch"] == 0
    assert ffn["block_experts"] == 2 * experts and att["block_experts"] == 0
    assert att["reduce_scatter"] == 4 * experts and ffn["reduce_scatter"] == 0  # the experts' fp32 reduce-scatter input
    embedding = cfg.vocab_size * cfg.hidden_size  # the root's gradients before the blocks': all but the embedding's
    assert att["root_grads"] == lay.act_bytes * (units["root"] - embedding)  # in the compute dtype
    # without MTP the last layer is first and prefetches the one before it
    lay_main = StepPlan(dims, seq_len=64, micro_batch=1, fsdp=True, gather_bytes=2, mtp=False)
    work = fsdp_working_set(cfg, lay_main, phase="attention")
    last, prev = cfg.num_layers - 1, cfg.num_layers - 2
    assert work["prefetch"] == 2 * units[f"layers.{prev}"]
    assert work["block"] == 2 * fsdp_units(cfg, lay)[f"layers.{last}"][0]
    assert fsdp_working_set(cfg, lay, phase="loss")["total"] == 2 * units["root"]
    # per micro-batch: every block gathered twice (forward, backward), the root once, all reduce-scattered in fp32
    vol = fsdp_comm_per_microbatch(cfg, lay)
    total = sum(units.values())
    assert vol["all_gather"] == 2 * (2 * (total - units["root"]) + units["root"])
    assert vol["reduce_scatter"] == 4 * total and vol["all_reduce"] == 0
    # in a step, FSDP replaces ZeRO-1's once-per-step gradient reduce-scatter and parameter all-gather
    two = comm_per_step(cfg, lay, micro_batches=2)
    assert two["reduce_scatter"] == 2 * vol["reduce_scatter"]


def _plan(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "plan_parallel.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)


def test_planner_says_by_how_much_a_layout_misses_and_what_to_change():
    r = _plan("--preset", "kimi-k2.5", "--gpus", "512", "--gpu-mem", "288", "--tp", "1", "--ep", "8", "--cp", "8",
              "--seq", "262144")
    assert r.returncode == 0, r.stderr
    assert "does NOT fit (over by" in r.stdout and "fits with --fsdp" in r.stdout
    r = _plan("--preset", "kimi-k2.5", "--gpus", "512", "--gpu-mem", "288", "--ep", "8", "--cp", "8", "--fsdp",
              "--seq", "262144")
    assert r.returncode == 0, r.stderr
    assert "total (full recompute)" in r.stdout and "fsdp reduce_scatter" in r.stdout


@pytest.mark.parametrize("args, needle", [
    (("--ep", "8", "--cp", "8", "--fsdp", "--dp-replicate", "3"), "parallel.dp_replicate"),
    (("--ep", "8", "--dp-replicate", "2"), "needs --fsdp"),
    (("--ep", "7", "--fsdp"), "parallel.ep"),
])
def test_planner_rejects_sizes_that_do_not_divide_in_one_line(args, needle):
    r = _plan("--preset", "kimi-k2.5", "--gpus", "512", "--gpu-mem", "288", "--seq", "262144", *args)
    assert r.returncode != 0
    err = r.stderr.strip()
    assert "\n" not in err and needle in err, err


def _analytic_peak(cfg, dims: ParallelDims, seq: int, fsdp: bool) -> float:
    lay = StepPlan(dims, seq_len=seq, micro_batch=1, param_bytes=4, act_bytes=2, fsdp=fsdp,
                 mtp=cfg.num_mtp_layers > 0)
    return backward_peak(cfg, lay, activation_bytes(cfg, lay, "flash", loss="trainer"))["total"]


def _sim_pcfg(**kw) -> ParallelConfig:
    return ParallelConfig(activation_checkpointing="full", fsdp=True, fsdp_param_dtype="bfloat16", **kw)


def test_dry_run_measures_parameters_exactly_and_the_peak_near_the_estimate():
    from pretrain.dry_run import simulate

    cfg = get_preset("tiny-kimi-k2.5")
    r = simulate(cfg, _sim_pcfg(cp=2, ep=2), 8, 256, mtp_weight=0.0)
    dims = ParallelDims(8, cp=2, ep=2)
    lay = StepPlan(dims, seq_len=256, micro_batch=1, fsdp=True, mtp=False)
    assert r.by_kind["params"] == pytest.approx(memory_per_rank(cfg, lay)["params"], rel=0.01)
    # the planner's FSDP units are the ones parallel/fsdp.py made (the MTP projections and norms in the root)
    assert r.units == fsdp_units(cfg, lay) and "mtp.0.block" in r.units
    assert any("balanced" in a for a in r.assumptions)
    est = _analytic_peak(cfg.replace(num_mtp_layers=0), dims, 256, True)
    # tiny widths: ids, masks and norms' 1/rms weigh more than at full size
    assert 0.7 <= r.peak_bytes / est <= 1.3, (r.by_kind, est)


@pytest.mark.e2e  # make test checks the peak against the estimate at tiny widths (the test above)
def test_dry_run_peak_agrees_with_the_estimate_at_real_widths():
    """Kimi K2.5's widths, layout (EP 8, CP 8, FSDP over 512 ranks) and full recompute with 3 layers (one dense,
    two MoE) at a 32k sequence: the backward peak (the last block's context-parallel attention backward, with
    the FSDP working set of that moment) agrees with cost.backward_peak within 15%."""
    from pretrain.dry_run import simulate

    cfg = get_preset("kimi-k2.5").replace(num_layers=3)
    seq = 32768
    r = simulate(cfg, _sim_pcfg(cp=8, ep=8), 512, seq, mtp_weight=0.0)
    est = _analytic_peak(cfg, ParallelDims(512, cp=8, ep=8), seq, True)
    assert abs(r.peak_bytes / est - 1) <= 0.15, (r.peak_bytes / GiB, est / GiB, r.by_kind)


@pytest.mark.e2e  # two more dry runs at real widths
def test_dry_run_peak_is_affine_in_the_number_of_layers():
    """What simulate_scaled's extrapolation rests on: with identical blocks each added layer adds the same bytes
    to the peak (its sharded state and one more saved block input), once the peak sits in the same block at
    every depth (for this tiny model from 4 layers on: at 3 the peak is elsewhere)."""
    from pretrain.dry_run import simulate

    cfg = get_preset("tiny-kimi-k2.5").replace(num_mtp_layers=0)
    peaks = [simulate(cfg.replace(num_layers=n), _sim_pcfg(cp=2, ep=2), 8, 256, mtp_weight=0.0).peak_bytes
             for n in (4, 5, 6)]
    assert peaks[2] - peaks[1] == peaks[1] - peaks[0] > 0, peaks


def test_dry_run_rejects_a_layout_that_does_not_divide():
    from pretrain.dry_run import simulate

    with pytest.raises(ConfigError, match="parallel.ep"):
        simulate(get_preset("tiny-kimi-k2.5"), ParallelConfig(ep=3, fsdp=True), 6, 64)


def _example_layouts() -> dict[tuple, list[str]]:
    """Each distinct parallel section of the shipped Kimi K2.5 examples -> the examples that use it."""
    import yaml

    out: dict[tuple, list[str]] = {}
    for path in sorted((ROOT / "examples" / "kimi_k25").glob("*.yaml")):
        section = yaml.safe_load(path.read_text())["parallel"]
        out.setdefault(tuple(sorted(section.items())), []).append(path.stem)
    return out


LAYOUTS = _example_layouts()


@pytest.mark.parametrize("section", list(LAYOUTS), ids=["+".join(v) for v in LAYOUTS.values()])
def test_every_kimi_example_layout_dry_runs_at_512_ranks(section):
    """Each example's parallel section at its 512-rank world, the real layer widths, two layers (one dense, one
    MoE) and a short sequence; the full-size run is test_kimi_long_context_dry_run_fits_e2e."""
    from pretrain.dry_run import simulate

    pcfg = ParallelConfig(**dict(section))
    pcfg.validate()
    assert pcfg.fsdp, "the Kimi examples shard with FSDP (the layout the planner checks)"
    pcfg.fsdp_param_dtype = "bfloat16"  # what "auto" picks on the GPUs the examples are for
    cfg = get_preset("kimi-k2.5").replace(num_layers=2, num_mtp_layers=0)
    r = simulate(cfg, pcfg, 512, 2 * pcfg.cp * 8, mtp_weight=0.0)
    lay = StepPlan(ParallelDims.from_config(pcfg, 512), seq_len=2 * pcfg.cp * 8, micro_batch=1, fsdp=True)
    assert r.by_kind["params"] == pytest.approx(memory_per_rank(cfg, lay)["params"], rel=0.01)


@pytest.mark.e2e
@pytest.mark.parametrize("seq", [262144, 131072])
def test_kimi_long_context_dry_run_fits_e2e(seq):
    r = _plan("--preset", "kimi-k2.5", "--gpus", "512", "--gpu-mem", "288", "--tp", "1", "--ep", "8", "--cp", "8",
              "--fsdp", "--seq", str(seq), "--simulate", "--sim-layers", "3")
    assert r.returncode == 0, r.stderr
    assert "measured peak" in r.stdout and "of 288 GiB: fits" in r.stdout
    assert "estimate and dry run agree within 15%" in r.stdout, r.stdout


@pytest.mark.e2e  # a subprocess dry run at real widths
def test_planner_simulate_prints_the_comparison_and_its_assumptions():
    r = _plan("--preset", "tiny-kimi-k2.5", "--gpus", "8", "--gpu-mem", "1", "--ep", "2", "--cp", "2", "--fsdp",
              "--seq", "256", "--simulate")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "measured peak" in out and "estimate and dry run" in out and "15%" in out
    assumptions = out[out.index("assumptions:"):].splitlines()[1:]
    assert any("routing balanced" in a for a in assumptions) and any("allocator" in a for a in assumptions)


def test_fsdp_tp_partial_gradients_all_reduce_only_the_shard():
    """Under FSDP x TP, finish_fsdp_gradients all-reduces each tp_partial gradient's local FSDP shard (dim 0 split
    over the dp x cp ranks) over tp, not the whole tensor as the replicated layout does."""
    from megatron_composer.parallel.cost import param_kinds

    cfg = get_preset("tiny-kimi-k2.5")
    dims = ParallelDims(8, tp=2, ep=2, sequence_parallel=True)  # dense FSDP shards: dp 4
    zero1 = comm_per_step(cfg, StepPlan(dims, seq_len=64, micro_batch=1))
    fsdp = comm_per_step(cfg, StepPlan(dims, seq_len=64, micro_batch=1, fsdp=True))
    shapes = [tuple(p.shape) for n, p in Transformer(cfg).named_parameters()
              if param_kinds(cfg, dims)[n] == "tp_partial"]
    assert shapes
    whole = sum(math.prod(s) for s in shapes)
    shard = sum(-(-s[0] // 4) * math.prod(s[1:]) for s in shapes)
    assert zero1["all_reduce"] - fsdp["all_reduce"] == 4 * (whole - shard)
