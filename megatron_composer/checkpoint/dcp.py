"""Distributed training checkpoints with torch.distributed.checkpoint (DCP).

Layout under a run directory::

    checkpoints/step_<N>/     DCP shards of {"model", "optim"}, trainer_state.json, meta.json, rng/rank_<r>.pt
    latest                    text file naming the newest *complete* checkpoint (e.g. "checkpoints/step_200")

A save writes into checkpoints/.step_<N>.tmp, renames it to step_<N> once every rank has finished, and only
then atomically replaces `latest`; a process killed mid-save leaves the previous `latest` valid, and the
stale .tmp directory is removed by the next save. An asynchronous save (`async_save`) copies the state to host
memory, writes it in a background thread, and is published the same way by `PendingCheckpoint.finish()` (the
training core calls it at the next save and at the end of the run). DCP stores parameters by fully-qualified
name with their global shapes, so a checkpoint loads into a different parallel layout or world size.

Every parameter and AdamW moment is stored as chunks of its FULL tensor, whatever the layout: a tensor- or
expert-parallel shard (labelled with a ShardSpec) as a DTensor over its tp/ep group; an FSDP2 shard (a DTensor
over the FSDP mesh whose own "global" shape is only the tp/ep-local shape) as a DTensor over the tp/ep group x
the FSDP mesh with placements [Shard(spec.dim), *FSDP's placements], i.e. FSDP's torch.chunk piece (uneven or
empty included) of the tp/ep piece; HSDP's replicated pieces are written once. No rank gathers anything to
save. Loading builds the same views for the current layout, so DCP reads exactly the boxes each rank owns,
into the live tensors. ZeRO-1 optimizer state (megatron_composer.parallel.data_parallel.DistributedAdamW) is
stored in the same per-parameter form: gathered to full (tp/ep-local) moments on save, re-sharded over the new
replicas on load.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megatron_composer.checkpoint.errors import CheckpointError


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def find_latest(run_dir: str | Path) -> Path | None:
    """The checkpoint named by run_dir/latest, or None for a fresh run."""
    run_dir = Path(run_dir)
    marker = run_dir / "latest"
    if not marker.is_file():
        return None
    ckpt = run_dir / marker.read_text().strip()
    if not (ckpt / "trainer_state.json").is_file():
        raise CheckpointError(f"{marker} names '{ckpt}', which is not a complete checkpoint; "
                              "restore it or start a fresh run.dir")
    return ckpt


def resolve_checkpoint(path: str | Path) -> Path:
    """A run directory (its latest checkpoint) or a checkpoint directory."""
    path = Path(path)
    if (path / "trainer_state.json").is_file():
        return path
    latest = find_latest(path) if path.is_dir() else None
    if latest is None:
        raise CheckpointError(f"'{path}' is neither a checkpoint directory "
                              "nor a run directory with a 'latest' checkpoint")
    return latest


class _Views:
    """DTensor views that make DCP store every parameter (and AdamW moment) as chunks of its FULL tensor.

    A tensor- or expert-parallel shard (ShardSpec kind tp_sharded / expert) becomes a DTensor over its tp / ep
    group, Shard(spec.dim). An FSDP-sharded parameter is already a DTensor, over the FSDP mesh, whose "global"
    shape is only the tp/ep-local shape; its view puts the spec's group in front of the FSDP mesh dims:
    placements [Shard(spec.dim), *fsdp placements] over a (spec group x FSDP mesh) mesh, i.e. the FSDP chunk
    of the tp/ep chunk, with torch.chunk's uneven (and empty) chunks, as FSDP shards."""

    def __init__(self, groups):
        self.groups = groups
        self._flat: dict = {}
        self._composed: dict = {}

    def flat(self, kind: str, device_type: str):
        from torch.distributed.device_mesh import DeviceMesh

        if kind not in self._flat:
            group = self.groups.tp_group if kind == "tp_sharded" else self.groups.ep_group
            self._flat[kind] = DeviceMesh.from_group(group, device_type)
        return self._flat[kind]

    def composed(self, kind: str, spec, fsdp_mesh):
        """Collective over the world, once per (kind, FSDP mesh): the (spec group x FSDP mesh) device mesh."""
        from torch.distributed.device_mesh import DeviceMesh

        key = (kind, tuple(fsdp_mesh.mesh.flatten().tolist()), tuple(fsdp_mesh.mesh.shape))
        if key not in self._composed:
            group = self.groups.tp_group if kind == "tp_sharded" else self.groups.ep_group
            mine = (spec.rank, *fsdp_mesh.get_coordinate())
            coords = [None] * dist.get_world_size()
            dist.all_gather_object(coords, mine)
            ranks = torch.full((spec.size, *fsdp_mesh.mesh.shape), -1, dtype=torch.long)
            for r, c in enumerate(coords):
                ranks[c] = r
            if (ranks < 0).any() or len(set(map(tuple, coords))) != len(coords):
                raise CheckpointError(f"the {kind} group and the FSDP mesh {tuple(fsdp_mesh.mesh.shape)} "
                                      f"do not tile the {dist.get_world_size()} ranks; "
                                      "this layout cannot be checkpointed")
            fsdp_groups = [fsdp_mesh.get_group(i) for i in range(fsdp_mesh.ndim)]
            names = (kind, *(f"fsdp{i}" for i in range(fsdp_mesh.ndim)))
            self._composed[key] = DeviceMesh.from_group([group, *fsdp_groups], fsdp_mesh.device_type, mesh=ranks,
                                                        mesh_dim_names=names)
        return self._composed[key]

    def view(self, t: torch.Tensor, spec):
        """`t` (a parameter or an AdamW moment of it) as a chunk of the full tensor."""
        from torch.distributed.tensor import DTensor, Shard

        sharded = spec is not None and spec.kind in ("tp_sharded", "expert") and spec.size > 1
        if sharded and spec.blocks != 1:
            raise CheckpointError(f"cannot checkpoint a parameter sharded in {spec.blocks} interleaved blocks; "
                                  "save with parallel.tp=1")
        if not sharded:
            return t  # a plain tensor, or an FSDP DTensor whose global shape is the full shape
        if isinstance(t, DTensor):
            full = list(t.shape)
            full[spec.dim] *= spec.size
            mesh = self.composed(spec.kind, spec, t.device_mesh)
            return DTensor.from_local(t.to_local(), mesh, [Shard(spec.dim), *t.placements], run_check=False,
                                      shape=torch.Size(full), stride=_contiguous_strides(full))
        flat = self.flat(spec.kind, "cuda" if t.is_cuda else "cpu")
        return DTensor.from_local(t, flat, [Shard(spec.dim)], run_check=False)


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def _is_distributed(optimizer) -> bool:
    from megatron_composer.parallel.data_parallel import DistributedAdamW

    return isinstance(optimizer, DistributedAdamW)


def layout_text(model: torch.nn.Module, optimizer, groups=None) -> str:
    """The parallel layout a model and optimizer are in, as one short phrase (recorded in meta.json, named in
    load errors), e.g. "4 ranks: tp2 x ep2, FSDP" or "1 rank"."""
    from megatron_composer.parallel.fsdp import is_fsdp

    world = dist.get_world_size() if dist.is_initialized() else 1
    parts = []
    if groups is not None:
        dims = groups.dims
        parts = [f"{k}{v}" for k, v in (("tp", dims.tp), ("cp", dims.cp), ("ep", dims.ep), ("dp", dims.dp)) if v > 1]
        if dims.sequence_parallel:
            parts.append("sp")
    text = f"{world} rank{'s' if world > 1 else ''}" + (f": {' x '.join(parts)}" if parts else "")
    if is_fsdp(model):
        r = model._mc_fsdp.dp_replicate
        text += f", HSDP ({r} replicas)" if r > 1 else ", FSDP"
    elif _is_distributed(optimizer) and optimizer.zero1:
        text += ", ZeRO-1"
    return text


def _check_stored(ckpt: Path, state: dict, layout: str) -> None:
    """Every tensor `state` loads is in the checkpoint with the same global shape; else one CheckpointError
    naming the tensor, both layouts and the fix, before anything is read."""
    try:
        stored = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint '{ckpt}': {str(e).splitlines()[0][:300]}") from None
    meta_path = ckpt / "meta.json"
    saved_layout = json.loads(meta_path.read_text()).get("layout") if meta_path.is_file() else None
    saved_layout = saved_layout or "a layout it does not record"
    for section, tensors in state.items():
        for name, t in tensors.items():
            key = f"{section}.{name}"
            have = getattr(stored.get(key), "size", None)
            if have is None:
                what = "AdamW state" if section == "optim" else "weights"
                raise CheckpointError(
                    f"checkpoint '{ckpt}' (saved under {saved_layout}) has no {what} '{key}', which this run "
                    f"({layout}) loads; it was saved for another model (model.preset / model.overrides / "
                    "model.num_mtp_layers) -- load it with the model config it was trained with")
            if tuple(have) != tuple(t.shape):
                raise CheckpointError(
                    f"checkpoint '{ckpt}' (saved under {saved_layout}) stores '{key}' as {tuple(have)}, but this run "
                    f"({layout}) needs the full tensor {tuple(t.shape)}; load it with the model config it was "
                    "trained with (model.vocab_size / model.overrides), or re-save it from a run of that config")


def training_state(model: torch.nn.Module, optimizer, groups=None, *, for_load: bool = False) -> dict:
    """{"model": {fqn: tensor}, "optim": {fqn.exp_avg / .exp_avg_sq / .step}} aliasing the live tensors, so
    dcp.save writes them and dcp.load fills them in place. AdamW state is created (zeros) if absent.

    A DistributedAdamW (bucketed, possibly ZeRO-1 sharded over data-parallel replicas) contributes the same
    per-parameter entries, gathered to full tensors (collective; skipped with for_load, which gives zeros that
    load_checkpoint hands back to the optimizer), so its checkpoints load into any layout and optimizer."""
    from megatron_composer.parallel.layers import spec_of
    from megatron_composer.parallel.slices import reshard

    views = _Views(groups)
    params = dict(reshard(model).named_parameters())
    model_sd = {}
    for name, t in model.state_dict(keep_vars=True).items():
        spec = spec_of(params[name]) if name in params else None
        model_sd[name] = views.view(t.detach(), spec)
    state = {"model": model_sd}
    if optimizer is not None and _is_distributed(optimizer):
        moments = optimizer.named_param_states(gather=not for_load)
        optim_sd = {}
        for name, p in params.items():
            if not p.requires_grad:
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                optim_sd[f"{name}.{key}"] = views.view(moments[name][key], spec_of(p))
            optim_sd[f"{name}.step"] = torch.tensor(float(optimizer.step_count), device=p.device)
        state["optim"] = optim_sd
    elif optimizer is not None:
        optim_sd = {}
        for name, p in params.items():
            if not p.requires_grad:
                continue
            st = optimizer.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            for key in ("exp_avg", "exp_avg_sq"):
                optim_sd[f"{name}.{key}"] = views.view(st[key], spec_of(p))
            optim_sd[f"{name}.step"] = st["step"]
        state["optim"] = optim_sd
    return state


class PendingCheckpoint:
    """An asynchronous save in flight: its shards are being written into checkpoints/.step_<N>.tmp by DCP's
    background thread. `finish()` (collective) waits for every rank's writes, then renames the directory into
    place and moves `latest` to it; until then the checkpoint is invisible, so a process killed meanwhile
    resumes from the previous one."""

    def __init__(self, future, tmp: Path, final: Path, run_dir: Path, keep_last: int):
        self.future, self.tmp, self.final, self.run_dir, self.keep_last = future, tmp, final, run_dir, keep_last

    def finish(self) -> Path:
        self.future.result()  # re-raises a failed write
        _barrier()
        _publish(self.tmp, self.final, self.run_dir, self.keep_last)
        return self.final


def _publish(tmp: Path, final: Path, run_dir: Path, keep_last: int) -> None:
    """Every rank has written into `tmp`: rename it to `final`, then point `latest` at it (atomically)."""
    ckpt_root = final.parent
    if _rank() == 0:
        os.replace(tmp, final)
        marker_tmp = run_dir / "latest.tmp"
        marker_tmp.write_text(str(final.relative_to(run_dir)))
        with open(marker_tmp) as fh:
            os.fsync(fh.fileno())
        os.replace(marker_tmp, run_dir / "latest")
        if keep_last > 0:
            steps = sorted(int(p.name.split("_")[1]) for p in ckpt_root.glob("step_*")
                           if p.name.split("_")[1].isdigit())
            for old in steps[:-keep_last]:
                shutil.rmtree(ckpt_root / f"step_{old}", ignore_errors=True)
    _barrier()


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    trainer_state: dict,
    meta: dict,
    keep_last: int = 0,
    groups=None,
    async_save: bool = False,
    async_group=None,
) -> Path | PendingCheckpoint:
    """Collective: every rank calls it. Returns the final checkpoint directory.

    With `async_save` (on several ranks give `async_group`, a gloo process group of all ranks used only by
    checkpoint writes, so the writer thread's collectives never interleave with training's), DCP copies the
    state to host memory and writes it in the background; the call returns a PendingCheckpoint once the copy
    is taken, and training may change the weights. Call its finish() before the next save and before the
    process ends."""
    run_dir = Path(run_dir)
    ckpt_root = run_dir / "checkpoints"
    final = ckpt_root / f"step_{step}"
    tmp = ckpt_root / f".step_{step}.tmp"
    if _rank() == 0:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        for stale in ckpt_root.glob(".step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # a re-run of the same step after a crash between rename and `latest`
            shutil.rmtree(final)
        tmp.mkdir()
    _barrier()
    state = training_state(model, optimizer, groups)
    layout = layout_text(model, optimizer, groups)
    future = None
    if async_save:
        if dist.is_initialized() and dist.get_world_size() > 1 and async_group is None:
            raise ValueError("an asynchronous save on several ranks needs async_group (a gloo group of its own)")
        future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=async_group)
        future = getattr(future, "upload_completion", future)  # an AsyncSaveResponse with a staging stager
    else:
        dcp.save(state, checkpoint_id=str(tmp))
    del state
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(rng_state(), tmp / "rng" / f"rank_{_rank()}.pt")
    if _rank() == 0:
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
        (tmp / "meta.json").write_text(json.dumps({**meta, "layout": layout}, indent=2))
    if future is not None:
        return PendingCheckpoint(future, tmp, final, run_dir, keep_last)
    _barrier()
    _publish(tmp, final, run_dir, keep_last)
    return final


def saved_architecture(ckpt: str | Path) -> dict | None:
    """The model architecture recorded in a checkpoint's meta.json (None when there is none)."""
    meta_path = Path(ckpt) / "meta.json"
    return json.loads(meta_path.read_text()).get("model", {}) if meta_path.is_file() else None


def _rope_text(rope: dict | None) -> str:
    if not rope:
        return "no rope scaling"
    return f"YaRN factor {rope.get('factor')} over {rope.get('original_max_position_embeddings')} original positions"


def _rope_extends(want: dict | None, saved: dict | None) -> bool:
    """Whether rope `want` deliberately extends the context of weights trained with `saved`: they had none, or
    it reaches further (factor x original positions) -- the stages that megatron_composer.model.args.
    stage_rope_scaling lets run with their own configured scaling."""
    if not want:
        return False
    if not saved:
        return True
    reach = lambda r: r.get("factor", 1.0) * r.get("original_max_position_embeddings", 0)  # noqa: E731
    return reach(want) > reach(saved)


def check_meta(ckpt: Path, expected: dict) -> None:
    """Raise if the checkpoint was written for a different architecture than `expected['model']`, rope
    scaling included (a checkpoint written before rope scaling was recorded is not checked for it; a rope that
    deliberately extends the weights' context, as a long-context or SFT stage does, is accepted)."""
    meta_path = ckpt / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(f"checkpoint '{ckpt}' has no meta.json; it was not written by this trainer")
    saved = json.loads(meta_path.read_text()).get("model", {})
    want = expected.get("model", {})
    if ("rope_scaling" in saved and "rope_scaling" in want and saved["rope_scaling"] != want["rope_scaling"]
            and not _rope_extends(want["rope_scaling"], saved["rope_scaling"])):
        raise CheckpointError(
            f"checkpoint '{ckpt}' was trained with {_rope_text(saved['rope_scaling'])} but this stage runs "
            f"{_rope_text(want['rope_scaling'])}; keep the weights' rope (model.yarn_original_length and "
            "data.seq_length of their stage) or extend it deliberately beyond their context")
    checked_above = "rope_scaling" not in saved or "rope_scaling" in want
    keys = (set(saved) | set(want)) - ({"rope_scaling"} if checked_above else set())
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs config {want.get(k)!r}"
             for k in sorted(keys) if saved.get(k) != want.get(k)]
    if diffs:
        raise CheckpointError(
            f"checkpoint '{ckpt}' was saved for a different model architecture ({'; '.join(diffs[:3])}); "
            "use a fresh run.dir or the model config it was trained with"
        )


def load_checkpoint(ckpt: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    expected_meta: dict | None = None, restore_rng: bool = True, groups=None) -> dict:
    """Load model (+ optimizer, RNG) in place; returns the trainer_state dict saved with it."""
    ckpt = Path(ckpt)
    if expected_meta is not None:
        check_meta(ckpt, expected_meta)
    distributed = optimizer is not None and _is_distributed(optimizer)
    state = training_state(model, optimizer, groups, for_load=distributed)
    _check_stored(ckpt, state, layout_text(model, optimizer, groups))
    try:
        with torch.no_grad():
            dcp.load(state, checkpoint_id=str(ckpt))
    except Exception as e:  # DCP wraps per-rank failures in CheckpointException
        raise CheckpointError(f"cannot load checkpoint '{ckpt}': {str(e).splitlines()[0][:300]}") from None
    if distributed:  # hand the loaded full moments to the optimizer, which keeps its shard of them
        optim_sd = state["optim"]
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        moments = {n: {k: local(optim_sd[f"{n}.{k}"]) for k in ("exp_avg", "exp_avg_sq")} for n in names}
        # a torch AdamW checkpoint keeps a step per parameter (untouched ones lag); the optimizer has one
        step = max((float(optim_sd[f"{n}.step"]) for n in names), default=0.0)
        optimizer.load_named_param_states(moments, int(round(step)))
    rng_file = ckpt / "rng" / f"rank_{_rank()}.pt"
    if restore_rng and rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return json.loads((ckpt / "trainer_state.json").read_text())
