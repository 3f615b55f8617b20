"""The orchestrator: prompts in, complete groups out, each prompt trained exactly once.

Trainer and rollout workers meet only through storage. The trainer's `Orchestrator` draws prompts with the
single-epoch `PromptSampler`, issues one work item per prompt (a *group*: G episodes of that prompt) into a
`WorkQueue`, and collects finished groups. Rollout workers claim items, run the episodes and write the whole
group back at once. The queue is bounded: at most ``max_inflight_groups`` issued-but-unconsumed groups, so
workers run ahead of the trainer by a bounded amount (the first staleness bound).

The queue is a directory (local, or any shared filesystem between clusters) with atomic renames:

    pending/<gid>.json            issued, waiting for a worker
    claimed/<gid>.<worker>.json   a worker runs it; its mtime is the worker's heartbeat (the lease)
    done/<gid>.group              the finished group, a safetensors record file (rl/rollout/records.py; written
                                  to a temporary name, then renamed)
    taken/<gid>.group             a group the trainer took for its current step: every trainer rank reads its own
                                  samples from it; removed once the step is trained
    workers/<worker>.stop         asks one worker to exit; STOP asks all of them
    eval/                         held-out evaluation: a queue of the same layout (`WorkQueue.held_out`)

Held-out evaluation runs on the rollout workers' own engines (sharded as for training): the trainer asks for
weight version v through `OrchestratorRole.evaluate`, which issues one item per held-out task into the eval
queue, tagged with v (``eval_version``) and the samples per task. A worker takes such an item only once its
engine holds a version >= v and runs it with the same episode code as a training group; the results land in
eval/done, which the training `Orchestrator` never reads, so they are never trained on and never dropped as
stale.

Faults: a worker that dies mid-episode stops heartbeating; once its lease expires the orchestrator moves the
claim back to pending and another worker redoes the whole group (a group is never half-trained). A late
result of a group that was already re-issued is ignored because groups are keyed by id and the orchestrator
remembers which ids it consumed. The orchestrator's `state_dict` (sampler position, issued-but-unconsumed
groups, next id) goes into the trainer checkpoint, so a resumed trainer re-issues exactly the groups the
checkpointed model has not trained on and then continues the epoch.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from rl.algorithm import PromptSampler
from rl.rollout.records import RecordError, encode_group, read_group, read_group_index


class QueueError(RuntimeError):
    """The rollout queue cannot make progress (e.g. no worker produced a group within the timeout)."""


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


@dataclass
class WorkItem:
    gid: int  # group id, unique over the run (over the launch for held-out evaluation items)
    prompt_index: int  # into the training tasks, or for an evaluation item into the held-out tasks
    attempt: int = 0  # how many times this group was re-issued (crash or staleness)
    eval_version: Optional[int] = None  # held-out evaluation of this weight version (None: a training group)
    samples: int = 0  # episodes of the group (0: rollout.group_size)
    # a training group: the oldest weight version it may be generated with and still be trained (None: any)
    min_version: Optional[int] = None

    def to_json(self) -> str:
        d = {"gid": self.gid, "prompt_index": self.prompt_index, "attempt": self.attempt}
        if self.eval_version is not None:
            d.update(eval_version=self.eval_version, samples=self.samples)
        if self.min_version is not None:
            d.update(min_version=self.min_version)
        return json.dumps(d)

    @staticmethod
    def from_json(text: str) -> "WorkItem":
        d = json.loads(text)
        v, m = d.get("eval_version"), d.get("min_version")
        return WorkItem(int(d["gid"]), int(d["prompt_index"]), int(d.get("attempt", 0)),
                        None if v is None else int(v), int(d.get("samples", 0)), None if m is None else int(m))

    def runs_on(self, held_version: int) -> bool:
        """Whether an engine holding `held_version` may run this item (an evaluation item: that version or a newer
        one; a training group: not older than its min_version)."""
        need = self.eval_version if self.eval_version is not None else self.min_version
        return need is None or held_version >= need


class WorkQueue:
    """Directory-backed queue of group work items; see the module docstring for the layout."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        for sub in ("pending", "claimed", "done", "taken", "workers"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def held_out(self) -> "WorkQueue":
        """The queue of held-out evaluation items beside this one (stops are asked through this one)."""
        return WorkQueue(self.root / "eval")

    def clear(self) -> None:
        """Remove every item and result (the eval queue at a trainer's start: a previous launch's requests are
        not this one's, and a claim removed here cannot be completed)."""
        for sub in ("pending", "claimed", "done", "taken"):
            for p in (self.root / sub).iterdir():
                p.unlink(missing_ok=True)

    # -- trainer side ---------------------------------------------------------------------------------
    def put(self, item: WorkItem) -> None:
        _atomic_write_bytes(self.root / "pending" / f"{item.gid}.json", item.to_json().encode())

    def done_ids(self) -> list[int]:
        return sorted(int(p.name.split(".")[0]) for p in (self.root / "done").glob("*.group"))

    def load_result(self, gid: int) -> dict:
        """A finished group's whole record."""
        return read_group(self.root / "done" / f"{gid}.group")

    def take(self, gid: int) -> dict:
        """Move a finished group to taken/ and return its record with its segments still in the file
        (`records.StoredSegment`); `record["path"]` is where every trainer rank reads them."""
        group = read_group_index(self.root / "done" / f"{gid}.group")
        path = self.root / "taken" / f"{gid}.group"
        os.replace(self.root / "done" / f"{gid}.group", path)
        for ep in group["episodes"]:
            for seg in ep["segments"]:
                seg.path = str(path)
        group["path"] = str(path)
        return group

    def drop_taken(self, paths: list[str]) -> None:
        """Remove the record files of a trained step."""
        for p in paths:
            Path(p).unlink(missing_ok=True)

    def discard(self, gid: int) -> None:
        """Forget every trace of a group (pending, claimed, done or taken)."""
        for p in [self.root / "pending" / f"{gid}.json", self.root / "done" / f"{gid}.group",
                  self.root / "taken" / f"{gid}.group", *(self.root / "claimed").glob(f"{gid}.*.json")]:
            p.unlink(missing_ok=True)

    def is_known(self, gid: int) -> bool:
        return ((self.root / "pending" / f"{gid}.json").exists() or (self.root / "done" / f"{gid}.group").exists()
                or any((self.root / "claimed").glob(f"{gid}.*.json")))

    def requeue_expired(self, lease_s: float, now: Optional[float] = None) -> list[int]:
        """Move claims whose worker stopped heartbeating for lease_s seconds back to pending."""
        now = time.time() if now is None else now
        moved = []
        for claim in (self.root / "claimed").glob("*.json"):
            try:
                age = now - claim.stat().st_mtime
                if age <= lease_s:
                    continue
                item = WorkItem.from_json(claim.read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                continue  # completed or being written right now
            item.attempt += 1
            self.put(item)
            claim.unlink(missing_ok=True)
            moved.append(item.gid)
        return moved

    def stop_all(self) -> None:
        (self.root / "STOP").write_text("stop\n")

    def clear_stop(self) -> None:
        (self.root / "STOP").unlink(missing_ok=True)

    # -- worker side ----------------------------------------------------------------------------------
    def stop_requested(self, worker: str, since: Optional[float] = None) -> bool:
        """A stop for all workers or for this one; with ``since`` (epoch seconds) only one written at or after it
        counts (a worker started in the same launch as a resuming trainer ignores the previous launch's STOP,
        which that trainer removes at start)."""
        for p in (self.root / "STOP", self.root / "workers" / f"{worker}.stop"):
            try:
                written = p.stat().st_mtime
            except FileNotFoundError:
                continue
            if since is None or written >= since:
                return True
        return False

    def claim(self, worker: str, accept: Optional[Callable[[WorkItem], bool]] = None) -> Optional[WorkItem]:
        """Take the oldest pending item (atomic rename, so two workers never get the same one); with ``accept``
        only one it accepts (e.g. an evaluation item of a version this worker's engine holds)."""
        if "." in worker or "/" in worker:
            raise ValueError(f"worker name {worker!r} may not contain '.' or '/'")
        for p in sorted((self.root / "pending").glob("*.json"), key=lambda q: int(q.stem)):
            if accept is not None:
                try:
                    if not accept(WorkItem.from_json(p.read_text())):
                        continue
                except (FileNotFoundError, json.JSONDecodeError):
                    continue  # taken meanwhile, or being written
            target = self.root / "claimed" / f"{p.stem}.{worker}.json"
            try:
                os.rename(p, target)
            except FileNotFoundError:
                continue  # another worker took it
            os.utime(target)
            return WorkItem.from_json(target.read_text())
        return None

    def heartbeat(self, worker: str, gid: int) -> bool:
        """Renew the lease; False if the claim is gone (the group was re-issued to someone else)."""
        try:
            os.utime(self.root / "claimed" / f"{gid}.{worker}.json")
            return True
        except FileNotFoundError:
            return False

    def complete(self, worker: str, item: WorkItem, result: dict) -> bool:
        """Publish a finished group; False (and nothing written) if the claim was taken away meanwhile."""
        claim = self.root / "claimed" / f"{item.gid}.{worker}.json"
        if not claim.exists():
            return False
        _atomic_write_bytes(self.root / "done" / f"{item.gid}.group", encode_group(result))
        claim.unlink(missing_ok=True)
        return True

    def release(self, worker: str, item: WorkItem) -> None:
        """Give a claimed item back (a worker shutting down in the middle of a group)."""
        claim = self.root / "claimed" / f"{item.gid}.{worker}.json"
        if claim.exists():
            item.attempt += 1
            self.put(item)
            claim.unlink(missing_ok=True)


@dataclass
class OrchestratorStats:
    requeued_crashed: int = 0
    requeued_stale: int = 0
    ignored_duplicates: int = 0
    staleness: dict = field(default_factory=dict)  # versions behind -> token count


class Orchestrator:
    """Trainer-side owner of the epoch: sampler, bounded issue of groups, collection of finished ones."""

    def __init__(self, queue: WorkQueue, num_prompts: int, group_size: int, seed: int,
                 max_inflight_groups: int, max_staleness: int, lease_s: float = 60.0):
        if max_inflight_groups < 1:
            raise ValueError(f"rollout.max_inflight_groups must be >= 1, got {max_inflight_groups}")
        if max_staleness < 0:
            raise ValueError(f"rollout.max_staleness must be >= 0, got {max_staleness}")
        self.queue = queue
        self.sampler = PromptSampler(num_prompts, prompts_per_step=1, group_size=group_size, seed=seed)
        self.group_size = group_size
        self.max_inflight = max_inflight_groups
        self.max_staleness = max_staleness
        self.lease_s = lease_s
        self.next_gid = 0
        self.inflight: dict[int, int] = {}  # gid -> prompt index, issued and not yet consumed
        self.stats = OrchestratorStats()

    @property
    def exhausted(self) -> bool:
        """Every prompt of the epoch has been issued and consumed."""
        return len(self.sampler) == 0 and not self.inflight

    def fill(self, version: Optional[int] = None) -> None:
        """Issue new groups until the bound on in-flight groups or the end of the epoch. With the trainer's
        `version`, each group asks for weights no older than version - max_staleness: a group generated with
        older ones would be dropped on arrival anyway. With max_staleness 0 and as many groups in flight as a step
        takes, this is synchronous RL: every group is generated with the weights that train on it, whatever the
        timing of workers and trainer."""
        min_version = None if version is None else version - self.max_staleness
        while len(self.inflight) < self.max_inflight and len(self.sampler) > 0:
            (prompt,) = self.sampler.next_batch()
            gid = self.next_gid
            self.next_gid += 1
            self.inflight[gid] = prompt
            self.queue.put(WorkItem(gid, prompt, min_version=min_version))

    def next_groups(self, n: int, version: int, timeout_s: float = 600.0,
                    poll_s: float = 0.05, alive: Optional[Callable[[], bool]] = None) -> list[dict]:
        """Block until n finished groups usable at trainer weight version `version` are available.

        A group whose oldest sampled token is more than max_staleness versions behind is dropped and its
        prompt re-issued. Fewer than n groups are returned only at the end of the epoch. ``alive`` (optional)
        is polled and a False aborts the wait (e.g. the embedded worker thread died).
        """
        out: list[dict] = []
        deadline = time.monotonic() + timeout_s
        while len(out) < n:
            self.fill(version)
            if not self.inflight:
                break  # end of epoch
            for gid in self.queue.requeue_expired(self.lease_s):
                self.stats.requeued_crashed += 1
                print(f"orchestrator: group {gid} lost its worker (lease {self.lease_s:.0f}s expired); re-queued",
                      flush=True)
            got_any = False
            for gid in self.queue.done_ids():
                if gid not in self.inflight:
                    self.queue.discard(gid)  # a late duplicate of a group that was consumed or re-issued
                    self.stats.ignored_duplicates += 1
                    continue
                if len(out) >= n:
                    continue
                try:
                    result = self.queue.take(gid)
                except (RecordError, FileNotFoundError):
                    continue  # partially visible on a non-atomic filesystem; retry next poll
                oldest = result.get("min_weight_version")
                if oldest is not None and version - oldest > self.max_staleness:
                    self.stats.requeued_stale += 1
                    print(f"orchestrator: group {gid} has tokens of version {oldest}, trainer is at {version} "
                          f"(max_staleness {self.max_staleness}); re-queued", flush=True)
                    self.queue.drop_taken([result["path"]])
                    self.queue.put(WorkItem(gid, self.inflight[gid], int(result.get("attempt", 0)) + 1,
                                            min_version=version - self.max_staleness))
                    continue
                del self.inflight[gid]
                for v, count in result.get("version_counts", {}).items():
                    lag = version - int(v)
                    self.stats.staleness[lag] = self.stats.staleness.get(lag, 0) + count
                out.append(result)
                got_any = True
            if len(out) >= n:
                break
            if alive is not None and not alive():
                raise QueueError("the rollout workers stopped; see their error above")
            if time.monotonic() > deadline:
                raise QueueError(f"no complete group arrived within {timeout_s:.0f}s ({len(out)}/{n} ready); "
                                 f"check that rollout workers run and read {self.queue.root}")
            if not got_any:
                time.sleep(poll_s)
        return out

    def take_staleness(self) -> dict[int, int]:
        hist, self.stats.staleness = self.stats.staleness, {}
        return dict(sorted(hist.items()))

    # -- checkpointing --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict(), "next_gid": self.next_gid,
                "inflight": {str(g): p for g, p in self.inflight.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Continue the epoch: groups issued but not trained by the checkpointed model are issued again
        unless their item or result is still in the queue; ids the checkpoint never issued are removed."""
        self.sampler.load_state_dict(state["sampler"])
        self.next_gid = int(state["next_gid"])
        self.inflight = {int(g): int(p) for g, p in state["inflight"].items()}
        for p in (self.queue.root / "taken").glob("*.group"):
            p.unlink(missing_ok=True)  # a step the checkpoint does not hold: its groups are in inflight again
        for sub, pattern in (("pending", "*.json"), ("claimed", "*.json"), ("done", "*.group")):
            for p in (self.queue.root / sub).glob(pattern):
                gid = int(p.name.split(".")[0])
                if gid not in self.inflight:  # issued after the checkpoint (or already trained before it)
                    p.unlink(missing_ok=True)
        for gid, prompt in self.inflight.items():
            if not self.queue.is_known(gid):
                self.queue.put(WorkItem(gid, prompt, attempt=1))


class OrchestratorRole:
    """The orchestrator as a role of the RL run: the queue in run_dir/rollouts and the epoch's `Orchestrator`,
    behind what the trainer asks of it -- the next step's groups, the step's queue metrics, its checkpoint
    state, and stopping the workers. It lives in the process of trainer rank 0, which sends the other trainer
    ranks only the record files of the step's groups (each reads its own samples from them); nothing else of
    the trainer reaches into it."""

    def __init__(self, run_dir: str | Path, num_prompts: int, rollout, seed: int, state: Optional[dict] = None):
        """`rollout`: the run's rollout section (group_size, max_inflight_groups, max_staleness, lease_s,
        group_timeout_s); `state`: the orchestrator state of the checkpoint a trainer resumes from."""
        self.queue = WorkQueue(Path(run_dir) / "rollouts")
        self.queue.clear_stop()
        self.eval_queue = self.queue.held_out()
        self.eval_queue.clear()
        self._next_eval_gid = 0
        self.orch = Orchestrator(self.queue, num_prompts, rollout.group_size, seed, rollout.max_inflight_groups,
                                 rollout.max_staleness, rollout.lease_s)
        self.lease_s = rollout.lease_s
        self.timeout_s = rollout.group_timeout_s
        if state is not None:
            self.orch.load_state_dict(state)

    def describe(self) -> str:
        """Where a resumed epoch stands."""
        return (f"{len(self.orch.inflight)} unconsumed groups re-issued, sampler at prompt "
                f"{self.orch.sampler.position}/{self.orch.sampler.num_prompts}")

    def next_groups(self, n: int, version: int, alive: Optional[Callable[[], bool]] = None) -> list[dict]:
        """The step's n finished groups usable at weight version `version` (fewer only at the end of the epoch)."""
        return self.orch.next_groups(n, version, timeout_s=self.timeout_s, alive=alive)

    def evaluate(self, version: int, num_tasks: int, samples: int, alive: Optional[Callable[[], bool]] = None,
                 poll_s: float = 0.05) -> list[dict]:
        """Held-out evaluation of weight version `version` on the rollout workers: one item of `samples`
        episodes per held-out task, run by workers whose engine holds a version >= `version`; blocks until every
        task's group is back and returns them by task index. Crashed claims are re-issued as for training."""
        issued: dict[int, int] = {}
        for task in range(num_tasks):
            gid = self._next_eval_gid
            self._next_eval_gid += 1
            issued[gid] = task
            self.eval_queue.put(WorkItem(gid, task, eval_version=version, samples=samples))
        got: dict[int, dict] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(got) < num_tasks:
            for gid in self.eval_queue.requeue_expired(self.lease_s):
                print(f"orchestrator: evaluation group {gid} lost its worker (lease {self.lease_s:.0f}s expired); "
                      "re-queued", flush=True)
            for gid in self.eval_queue.done_ids():
                try:
                    result = self.eval_queue.load_result(gid)
                except (RecordError, FileNotFoundError):
                    continue  # partially visible on a non-atomic filesystem; retry next poll
                self.eval_queue.discard(gid)
                if gid in issued and result.get("eval_version") == version:
                    got[issued[gid]] = result
                    deadline = time.monotonic() + self.timeout_s  # the bound is on the wait for the next group
            if len(got) == num_tasks:
                break
            if alive is not None and not alive():
                raise QueueError("the rollout workers stopped; see their error above")
            if time.monotonic() > deadline:
                raise QueueError(f"held-out evaluation of v{version}: {len(got)}/{num_tasks} tasks came back within "
                                 f"{self.timeout_s:.0f}s; check that rollout workers run, load eval.tasks and read "
                                 f"{self.eval_queue.root}")
            time.sleep(poll_s)
        return [got[t] for t in range(num_tasks)]

    def step_metrics(self) -> dict:
        """Staleness of the tokens consumed since the last call, and the groups re-queued so far."""
        hist = self.orch.take_staleness()
        return {"staleness_hist": {str(k): v for k, v in hist.items()},
                "staleness_mean": (sum(k * v for k, v in hist.items()) / max(sum(hist.values()), 1)),
                "staleness_max": float(max(hist, default=0)),
                "requeued_crashed": float(self.orch.stats.requeued_crashed),
                "requeued_stale": float(self.orch.stats.requeued_stale)}

    def state_dict(self) -> dict:
        return self.orch.state_dict()

    def step_trained(self, groups: list[dict]) -> None:
        """The step on these groups is trained (every trainer rank has read its samples): drop their files."""
        self.queue.drop_taken([g["path"] for g in groups if "path" in g])

    def stop(self) -> None:
        """Ask every rollout worker of the run to exit."""
        self.queue.stop_all()
