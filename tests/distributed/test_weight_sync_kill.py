"""An owner SIGKILLed mid-publish (workers/weight_sync_kill_worker.py): the version stays invisible, a rollout
subscriber keeps reading the last whole version, and the restarted trainer's next publish succeeds."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch

from rl.weight_sync import ObjectStore, WeightSubscriber
from rl.weight_sync import manifest as mf
from rl.weight_sync.codec import to_bits

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


from tests.distributed import torchrun  # noqa: E402

KILL_WORKER = ROOT / "tests" / "distributed" / "workers" / "weight_sync_kill_worker.py"
kill_worker = _load("weight_sync_kill_worker", KILL_WORKER)


def _launch(out: Path, phase: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(torchrun.free_port()), str(KILL_WORKER), "--out", str(out), "--phase", phase]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _holds(update, full: dict) -> bool:
    return all(torch.equal(to_bits(update.read(name, box)), to_bits(full[name][tuple(slice(*r) for r in box)]))
               for name, (_, boxes) in update.subscriber.wants.items() for box in boxes)


def test_owner_killed_mid_publish_leaves_the_version_invisible_and_the_next_publish_succeeds(tmp_path):
    killed = _launch(tmp_path, "kill")
    assert killed.returncode != 0, killed.stdout[-3000:]
    assert (tmp_path / "killed").exists(), f"rank 1 was not killed mid-publish:\n{killed.stderr[-4000:]}"
    store = ObjectStore(str(tmp_path / "store"))
    assert store.exists((tmp_path / "killed").read_text())   # its first object of version 3 landed...
    assert not store.exists(mf.manifest_key(3))                # ...but no manifest: version 3 does not exist

    # a rollout rank holding half the rows of every tensor (a tp2 / ep2 box) reads version 2, whole and exact
    full2 = kill_worker.full_weights(2)
    wants = {name: (t.dtype, [((0, max(1, t.shape[0] // 2)),) + tuple((0, n) for n in t.shape[1:])] if t.dim()
                    else [()]) for name, t in full2.items()}
    sub = WeightSubscriber(store, wants)
    assert sub.latest_version() == 2
    update = sub.prepare()
    assert update.version == 2 and _holds(update, full2)
    update.commit()

    resumed = _launch(tmp_path, "resume")
    assert resumed.returncode == 0 and (tmp_path / "resumed").exists(), resumed.stderr[-4000:]
    keys = [p.rsplit("/", 1)[-1] for p in store.fs.find(store.path(mf.version_dir(3)))]
    assert not any(k == (tmp_path / "killed").read_text().rsplit("/", 1)[-1]
                   for k in keys)   # the dead run's objects are gone
    assert sub.latest_version() == 3
    update = sub.prepare()
    assert update.version == 3 and not update.delta   # a new lineage: its snapshot, not a delta on the held v2
    assert _holds(update, kill_worker.full_weights(3))
