"""Rollout worker: the inference engine, live weights from the weight-sync store, and the episode runners.

A worker claims a group from the `rl.orchestrator.WorkQueue`, runs its G episodes and writes the whole group
back. Generation never waits for the trainer: a `ShardSubscriber` fetches and decodes this rank's boxes of each
new version in the background (only the stored chunks overlapping them), and the engine applies the ready update
between two decode steps -- an XOR delta into its own slices --, so one response can hold tokens of versions v
and v+1; each token records the version it was sampled under.

Episodes:
* single-turn tasks: the G samples of the prompt are generated as one batch and scored by the task's check;
* agent tasks: `rl.envs.run_episode` in forks of the task's sandbox (`SandboxPool`), the policy being this
  engine. Token in, token out: the policy keeps the exact token ids it generated and appends only the tokens of
  what the environment added after them (`ChatFormat.continuation`: the rest of the turn's closing, the tool
  results, the next generation prompt) as context tokens (loss mask 0); nothing already in the context is
  re-rendered or re-tokenised, so the trainer sees the very tokens that were sampled, in the context they were
  sampled in (earlier turns keep their reasoning even where the template, re-rendering, would drop it).

Conversations are rendered in the run's chat format (`data.chat_format`: the model's own template or ChatML).

Several threads may generate at once (one per sandbox of a group): each adds its requests and then helps
stepping the engine under one lock until its own requests finish, so concurrent episodes share decode steps.

Held-out evaluation runs on the same engine and episode code: the worker takes an item of the eval queue
(`WorkQueue.held_out`; ``eval_version`` v, ``samples`` episodes of a held-out task) before training groups, but
only once its engine holds a version >= v, and writes the group back there (never trained on).

A sandbox that fails (crash, setup error) is retried up to ``rollout.episode_retries`` times; after that the
group is handed back to the queue. A verifier that hangs is killed by the task's verifier timeout and scores 0.

Tensor and expert parallelism (``rollout.tp`` x ``rollout.ep`` > 1): the engine's model is sharded over a group
of processes. The worker runs on the group's first rank and calls the engine only through
`megatron_composer.inference.Lockstep`, which replays its requests, steps and weight updates on the other ranks
(`run_follower`, built on `inference.follow`). A weight update sends only the version: each follower prepares its
own boxes of the same version from the store itself (prefetched in the background like the worker's). When the
worker stops, so do they.
"""

from __future__ import annotations

import threading
import time
import traceback
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_composer.data.chat_format import ChatFormat, load_chat_format
from megatron_composer.inference import Engine, Lockstep, follow
from megatron_composer.inference.lockstep import WeightsRefused
from megatron_composer.inference.sampling import SamplingParams
from rl.orchestrator import WorkItem, WorkQueue
from rl.rollout.tasks import RLTask


@dataclass
class RolloutConfig:
    group_size: int = field(default=8, metadata={"help": "episodes per prompt (G); advantages are relative to the group"})
    max_new_tokens: int = field(default=16, metadata={"help": "single-turn: tokens per response"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature of rollouts; the trainer's log-probs use the same"})
    top_p: float = field(default=1.0, metadata={"help": "must be 1: a truncated sampling distribution is not what the trainer's log-probs measure"})
    max_inflight_groups: int = field(default=4, metadata={"help": "bounded queue: groups issued to workers and not yet trained"})
    max_staleness: int = field(default=2, metadata={"help": "a group whose oldest token is more versions behind the trainer is redone"})
    lease_s: float = field(default=60.0, metadata={"help": "a claimed group whose worker stops heartbeating this long is re-queued"})
    heartbeat_s: float = field(default=2.0, metadata={"help": "how often a worker renews the lease of its group"})
    embedded_workers: int = field(default=1, metadata={"help": "rollout worker threads inside the trainer when the run has one process"})
    max_batch_size: int = 64
    backend: str = field(default="engine", metadata={"help": "engine: the project's inference engine (CPU, CI, the bit-exact reference); "
                                                             "vllm: an in-process vLLM (megatron_composer/inference/vllm_engine.py) "
                                                             "whose weights come from the same store"})
    tp: int = field(default=1, metadata={"help": "tensor-parallel size of each rollout engine (heads, FFN columns, vocabulary)"})
    ep: int = field(default=1, metadata={"help": "expert-parallel size of each rollout engine (the routed experts); rollout ranks "
                                                 "form consecutive engines of tp x ep processes, whose first rank runs the worker"})
    dcp: int = field(default=1, metadata={"help": "vllm: split each sequence's KV cache over this many of the engine's GPUs (vLLM's "
                                                   "decode context parallelism; MLA's latent cache is otherwise on every one)"})
    quantize_experts: str = field(default="none", metadata={"help": "vllm: none, or int4: serve the routed experts in Kimi K2.5's "
                                                                    "pack-quantized INT4 (each update quantised as the INT4 export does)"})
    max_seq_len: int = field(default=1024, metadata={"help": "engine context: prompt + all turns of an agent episode"})
    cache_memory_mb: int = 256
    agent_max_turns: int = field(default=4, metadata={"help": "agent tasks: turns per episode"})
    agent_max_new_tokens: int = field(default=96, metadata={"help": "agent tasks: tokens per turn"})
    agent_command_timeout_s: float = 30.0
    agent_profile: str = field(default="full", metadata={"help": "agent tasks: the system prompt and tools the agent is given "
                                                               "(rl/envs/agent.py PROFILES: full, or compact for small models)"})
    summary_trigger_tokens: int = field(default=0, metadata={"help": "agent tasks: once an episode's context reaches this many tokens the model "
                                                                     "summarises it and continues in a new segment (system + task + summary); 0 = off"})
    summary_max_new_tokens: int = field(default=0, metadata={"help": "tokens a summary may take (it may think first); 0 = agent_max_new_tokens"})
    sandbox_concurrency: int = field(default=2, metadata={"help": "sandboxes a worker runs at once"})
    sandbox_unisolated: bool = field(default=False, metadata={"help": "run sandboxes without bubblewrap (trusted code only)"})
    episode_retries: int = field(default=2, metadata={"help": "a crashed sandbox episode is rerun this often before the group is re-queued"})
    group_timeout_s: float = field(default=1800.0, metadata={"help": "the trainer's wait for the next finished group before it gives up"})

    def episode_token_budget(self, agent_tasks: bool) -> int:
        """The most tokens an episode may generate: max_new_tokens (single-turn), or agent_max_turns x
        agent_max_new_tokens when the task set has agent tasks (run_episode's generation budget)."""
        single = self.max_new_tokens
        return max(single, self.agent_max_turns * self.agent_max_new_tokens) if agent_tasks else single

    @property
    def engine_ranks(self) -> int:
        """Processes per rollout engine launched by us (a vLLM engine is one process that starts its own tp x ep
        workers)."""
        return 1 if self.backend == "vllm" else self.tp * self.ep

    def validate(self) -> "RolloutConfig":
        from megatron_composer.config import ConfigError

        if self.group_size < 1:
            raise ConfigError(f"rollout.group_size must be >= 1, got {self.group_size}")
        if self.backend not in ("engine", "vllm"):
            raise ConfigError(f"rollout.backend={self.backend!r}: use engine (the project's) or vllm")
        if self.tp < 1 or self.ep < 1:
            raise ConfigError(f"rollout.tp and rollout.ep must be >= 1 (an engine has tp x ep processes), got "
                              f"{self.tp} and {self.ep}")
        if self.quantize_experts not in ("none", "int4"):
            raise ConfigError(f"rollout.quantize_experts={self.quantize_experts!r}: use none or int4")
        if self.backend != "vllm" and (self.dcp != 1 or self.quantize_experts != "none"):
            raise ConfigError("rollout.dcp and rollout.quantize_experts are vLLM's (rollout.backend=vllm); the "
                              "project's engine keeps each sequence's cache on its rank and serves the trained weights")
        if self.dcp < 1 or (self.tp * self.ep) % self.dcp:
            raise ConfigError(f"rollout.dcp={self.dcp} must divide the engine's tp x ep = {self.tp * self.ep} GPUs")
        from rl.envs.agent import PROFILES

        if self.agent_profile not in PROFILES:
            raise ConfigError(f"rollout.agent_profile={self.agent_profile!r}: choose one of {sorted(PROFILES)}")
        if self.max_new_tokens < 1 or self.agent_max_new_tokens < 1:
            raise ConfigError("rollout.max_new_tokens and rollout.agent_max_new_tokens must be >= 1")
        if self.temperature <= 0:
            raise ConfigError(f"rollout.temperature must be > 0 for RL sampling, got {self.temperature}")
        if self.top_p != 1.0:
            raise ConfigError(f"rollout.top_p={self.top_p}: the trainer's log-probs (softmax(logits / temperature), "
                              "untruncated) cannot reproduce a top-p truncated sampling distribution, so importance "
                              "ratios would be biased; set rollout.top_p=1 and control sampling with rollout.temperature")
        if self.max_inflight_groups < 1 or self.max_staleness < 0:
            raise ConfigError("rollout.max_inflight_groups must be >= 1 and rollout.max_staleness >= 0")
        if self.summary_trigger_tokens < 0 or self.summary_max_new_tokens < 0:
            raise ConfigError("rollout.summary_trigger_tokens and rollout.summary_max_new_tokens must be >= 0 (0 = off / default)")
        if self.summary_trigger_tokens >= self.max_seq_len:
            raise ConfigError(f"rollout.summary_trigger_tokens={self.summary_trigger_tokens} must be below rollout.max_seq_len="
                              f"{self.max_seq_len} (the summary is generated inside that context); lower it or 0 = off")
        if self.heartbeat_s >= self.lease_s:
            raise ConfigError(f"rollout.heartbeat_s ({self.heartbeat_s}) must be shorter than rollout.lease_s ({self.lease_s})")
        return self


def episode_record(verifier_reward: float, transcript: list[dict], segments: list[dict], meta: dict,
                   objective=None) -> dict:
    """One episode as the queue stores it: ``reward`` is the training reward (the verifier reward plus the
    shaping terms of ``objective``, an RLObjectiveConfig, once per episode; see rl.algorithm.episode_reward),
    ``verifier_reward`` and ``reward_terms`` its parts. ``transcript`` is every segment's messages and
    ``meta["tokens"]`` the sampled tokens of all segments (the length penalty's default x). Without an
    objective (evaluation) the reward is the verifier's."""
    reward, terms = float(verifier_reward), {}
    if objective is not None:
        from rl.algorithm import episode_reward

        reward, terms = episode_reward(verifier_reward, transcript, objective, num_output_tokens=meta["tokens"])
    return {"reward": reward, "verifier_reward": float(verifier_reward), "reward_terms": terms,
            "segments": segments, "meta": meta}


class EpisodeCrash(RuntimeError):
    """The episode's sandbox failed; the episode (not its reward) is lost and is rerun."""


def rollout_engine(model: torch.nn.Module, cfg: RolloutConfig, seed: int = 0) -> Engine:
    """The engine of a rollout worker; every rank of a tensor-parallel group builds it identically (the
    scheduler's batches and cache blocks must match). rollout.backend=vllm: a vLLM engine for `model`'s config
    and dtype (`model` then only names the weights the subscriber fetches: rl.model.rollout_model builds it on
    the meta device)."""
    if cfg.backend == "vllm":
        from megatron_composer.inference.vllm_engine import VLLMEngine

        return VLLMEngine(model.config, dtype=next(model.parameters()).dtype, max_batch_size=cfg.max_batch_size,
                          max_seq_len=cfg.max_seq_len, cache_memory_bytes=cfg.cache_memory_mb << 20, seed=seed,
                          tp=cfg.tp, ep=cfg.ep, dcp=cfg.dcp,
                          quantize_experts=None if cfg.quantize_experts == "none" else cfg.quantize_experts)
    return Engine(model, max_batch_size=cfg.max_batch_size, max_seq_len=cfg.max_seq_len,
                  cache_memory_bytes=cfg.cache_memory_mb << 20, seed=seed)


def _seed(*parts: int) -> int:
    return zlib.crc32(repr(parts).encode()) & 0x3FFFFFFF


class TokenLedger:
    """The exact token stream of one context window: sampled tokens (mask 1) and context tokens (mask 0)."""

    def __init__(self, prompt_ids: list[int]):
        self.prompt_ids = list(prompt_ids)
        self.response_ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.routes: list[torch.Tensor] = []  # per position p: experts of the forward at p (predicting p + 1)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def add_context(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def add_generation(self, result) -> None:
        start = len(self.ids)
        self.response_ids += result.token_ids
        self.mask += [1] * len(result.token_ids)
        # the behaviour policy is the distribution the token was drawn from (temperature applied); the trainer
        # applies the same temperature (rollout.top_p < 1 is refused: its truncation is not in the objective)
        self.logprobs += list(result.sampling_logprobs)
        self.versions += list(result.weight_versions)
        routing = result.routing_for_training()  # [L, start + T - 1, K]
        if routing is not None:
            # positions before start - 1 were routed when they were generated or first read
            self.routes += list(routing[:, len(self.routes):].unbind(1))
        assert routing is None or len(self.routes) == start + len(result.token_ids) - 1

    def segment(self) -> dict:
        routed = None
        if self.routes:
            routes = self.routes + [self.routes[-1]] * (len(self.ids) - len(self.routes))  # last: never trained
            routed = torch.stack(routes, dim=1)
        return {"prompt_ids": self.prompt_ids, "response_ids": self.response_ids, "response_logprobs": self.logprobs,
                "response_mask": self.mask, "routed_experts": routed, "weight_versions": self.versions}


class RolloutWorker:
    def __init__(self, name: str, cfg: RolloutConfig, model: torch.nn.Module, tokenizer, tasks: list[RLTask],
                 queue: WorkQueue, subscriber, seed: int = 0, sandbox_backend=None, poll_seconds: float = 1.0,
                 stops_since: Optional[float] = None, objective=None, engine_group=None,
                 eval_tasks: Optional[list[RLTask]] = None, chat_format: Optional[ChatFormat] = None):
        self.name, self.cfg, self.tokenizer, self.tasks, self.queue = name, cfg, tokenizer, tasks, queue
        # how prompts are rendered and turns parsed (data.chat_format; default: the tokenizer's template, else ChatML)
        self.format = chat_format or load_chat_format("auto", tokenizer)
        # held-out tasks (eval.tasks) and their queue; None: this worker takes no evaluation items
        self.eval_tasks = eval_tasks
        self.eval_queue = queue.held_out() if queue is not None and eval_tasks else None
        self.objective = objective  # RLObjectiveConfig: the training reward's shaping terms (None: verifier reward)
        self.stops_since = stops_since  # ignore stop markers older than this (see WorkQueue.stop_requested)
        self.subscriber = subscriber  # a ShardSubscriber of this rank's boxes (None: fixed weights)
        self.poll_seconds = poll_seconds  # weight_sync.poll_seconds
        self.seed = seed
        self.engine = rollout_engine(model, cfg, seed)
        if subscriber is not None and hasattr(self.engine, "subscription"):
            # vLLM: its workers subscribe themselves (the given subscriber's store and settings), per worker box
            self.subscriber = self.engine.subscription(subscriber)
        # every call that changes the engine goes through here (the engine's other ranks replay it); engine_group:
        # all of the engine's ranks (default its tensor-parallel group; an expert-parallel engine passes its own)
        self.drive = Lockstep(self.engine, group=engine_group)
        self.stop_ids = self.format.stop_token_ids(tokenizer)
        self.end_of_turn_id = tokenizer.token_to_id(self.format.end_of_turn)
        self._drive_lock = threading.Lock()
        self._backend = sandbox_backend
        self._pool = None
        self.applied: list[tuple[int, float]] = []  # (version, seconds the engine paused to apply it)
        self.error: Optional[BaseException] = None

    # -- weights --------------------------------------------------------------------------------------
    def wait_for_weights(self, timeout_s: float = 600.0) -> int:
        deadline = time.monotonic() + timeout_s
        while (v := self.subscriber.latest_version()) is None:
            if self.queue.stop_requested(self.name, self.stops_since) or time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.name}: no weights were published within {timeout_s:.0f}s")
            time.sleep(self.poll_seconds)
        # the first version: every rank reads only its boxes of it (the followers through `fetch`)
        self._apply(self.subscriber.prepare(v))
        self.subscriber.start(self.poll_seconds)
        return v

    def _apply(self, update) -> None:
        """Apply a prepared BoxUpdate of this rank's boxes (an XOR delta on the held weights, or the values);
        the engine's other ranks apply their own update of the same version (followers fetch it themselves)."""
        t0 = time.perf_counter()
        try:
            self.drive.update_weights(update, update.version, delta=update.delta, broadcast=False)
        except WeightsRefused as e:  # another rank of the engine could not prepare it: no rank applied it
            print(f"worker {self.name}: {e}; the engine keeps v{self.engine.weight_version}", flush=True)
            return
        update.commit()
        dt = time.perf_counter() - t0
        self.applied.append((update.version, dt))
        print(f"worker {self.name}: applied weights v{update.version} in {dt * 1e3:.1f} ms "
              f"({'delta' if update.delta else 'values'}, {update.bytes_read / 2**20:.1f} MiB fetched of "
              f"{update.version_bytes / 2**20:.1f} MiB; running requests continue, their next tokens are "
              f"v{update.version})", flush=True)

    def apply_ready(self) -> None:
        if self.subscriber is None:  # fixed weights (evaluation)
            return
        ready = self.subscriber.pop_ready()
        if ready is not None and ready.version > self.engine.weight_version:
            self._apply(ready)

    # -- generation -----------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_new_tokens: int, seeds: list[int]):
        params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                                 stop_token_ids=self.stop_ids, seed=s) for s in seeds]
        with self._drive_lock:
            rids = [self.drive.add_request(p, sp) for p, sp in zip(prompts, params)]
        results: dict[int, object] = {}
        while len(results) < len(rids):
            with self._drive_lock:
                self.apply_ready()  # between decode steps: the only pause new weights cause
                for rid in rids:
                    if rid not in results and (r := self.engine.pop_result(rid)) is not None:
                        results[rid] = r
                if len(results) < len(rids):
                    self.drive.step()
        return [results[r] for r in rids]

    def _prompt_ids(self, messages: list[dict], tools: Optional[list[dict]] = None) -> list[int]:
        return self.tokenizer.encode(self.format.render(messages, tools=tools, add_generation_prompt=True))

    def _text(self, token_ids: list[int]) -> str:
        ids = token_ids[:-1] if token_ids and token_ids[-1] in self.stop_ids else token_ids
        return self.tokenizer.decode(ids)

    # -- episodes -------------------------------------------------------------------------------------
    def run_single_turn(self, task: RLTask, item: WorkItem, group_size: int) -> list[dict]:
        prompt = self._prompt_ids([{"role": "user", "content": task.prompt}])
        seeds = [_seed(self.seed, item.gid, item.attempt, i) for i in range(group_size)]
        episodes = []
        for result in self.generate([prompt] * group_size, self.cfg.max_new_tokens, seeds):
            ledger = TokenLedger(prompt)
            ledger.add_generation(result)
            text = self._text(result.token_ids)
            reward, reason = task.score(text, self._sandbox_factory)
            transcript = [{"role": "user", "content": task.prompt}, {"role": "assistant", "content": text}]
            episodes.append(self.episode(reward, transcript, [ledger.segment()], {
                "turns": 1, "tokens": len(result.token_ids), "stop_reason": result.finish_reason, "verdict": reason,
                "transcript": text}))
        return episodes

    def episode(self, verifier_reward: float, transcript: list[dict], segments: list[dict], meta: dict) -> dict:
        return episode_record(verifier_reward, transcript, segments, meta, self.objective)

    def _sandbox_factory(self):
        return self._get_backend().create(None)

    def _get_backend(self):
        if self._backend is None:
            from rl.sandbox import LocalBackend

            self._backend = LocalBackend(unisolated=self.cfg.sandbox_unisolated)
        return self._backend

    def _get_pool(self):
        if self._pool is None:
            from rl.envs.task import prepare_task
            from rl.sandbox import SandboxPool

            self._pool = SandboxPool(self._get_backend(), prepare_task, concurrency=self.cfg.sandbox_concurrency)
        return self._pool

    def run_agent_episode(self, task: RLTask, sandbox, seed: int) -> dict:
        """One agent episode; with rollout.summary_trigger_tokens it may be a chain of segments, each a training
        sample of the episode (the summary that ends a segment is sampled and trained like any turn)."""
        from rl.envs import EpisodeConfig, run_episode

        policy = EnginePolicy(self, seed)
        trigger = self.cfg.summary_trigger_tokens
        cfg = EpisodeConfig(max_turns=self.cfg.agent_max_turns, command_timeout_s=self.cfg.agent_command_timeout_s,
                            max_generated_tokens=self.cfg.agent_max_turns * self.cfg.agent_max_new_tokens,
                            summary_trigger_tokens=trigger or None, profile=self.cfg.agent_profile)
        try:
            ep = run_episode(task.harbor, sandbox, policy, cfg,
                             count_tokens=lambda text: len(self.tokenizer.encode(text)),
                             summarize=policy.summarize if trigger else None, context_tokens=policy.context_tokens,
                             chat_format=self.format)
        except Exception as e:  # the sandbox or the verifier's machinery broke, not the model
            raise EpisodeCrash(f"{type(e).__name__}: {e}") from e
        segments = policy.all_segments()
        if not segments:  # the episode ended before the model was asked anything
            raise EpisodeCrash("episode ended before the first model turn")
        verify = ep.verify
        transcript = [m for seg in ep.segments for m in seg]  # the whole chain
        return self.episode(ep.reward, transcript, segments, {
            "turns": ep.turns, "tokens": sum(sum(seg["response_mask"]) for seg in segments),
            "segments": len(segments), "summaries": len(ep.summaries), "stop_reason": ep.stop_reason,
            "tool_calls": sum(ep.tool_calls.values()), "malformed_tool_calls": ep.malformed_tool_calls,
            "verifier_timeout": bool(verify is not None and "timed out" in verify.output.lower()),
            "context_overflow": policy.overflowed,
            "verdict": (verify.output[-500:] if verify is not None else ""),
            "transcript": ep.messages})

    def run_agent(self, task: RLTask, item: WorkItem, group_size: int) -> tuple[list[dict], int]:
        pool = self._get_pool()
        failures = 0

        def one(i: int) -> dict:
            nonlocal failures
            for attempt in range(self.cfg.episode_retries + 1):
                try:
                    with pool.fork(task.harbor) as sandbox:
                        return self.run_agent_episode(task, sandbox, _seed(self.seed, item.gid, item.attempt, i, attempt))
                except Exception as e:  # EpisodeCrash, SandboxError from fork, ...
                    failures += 1
                    print(f"worker {self.name}: group {item.gid} episode {i} sandbox failure "
                          f"({attempt + 1}/{self.cfg.episode_retries + 1}): {str(e)[:300]}", flush=True)
            raise EpisodeCrash(f"episode {i} of group {item.gid} failed {self.cfg.episode_retries + 1} times")

        futures = [pool._executor.submit(one, i) for i in range(group_size)]
        return [f.result() for f in futures], failures

    def run_group(self, item: WorkItem) -> dict:
        """The item's group: a training group of a training task, or (``item.eval_version`` set) a held-out
        task's ``item.samples`` episodes, tagged with that version."""
        task = (self.tasks if item.eval_version is None else self.eval_tasks)[item.prompt_index]
        group_size = item.samples or self.cfg.group_size
        t0 = time.perf_counter()
        failures = 0
        if task.kind == "single_turn":
            episodes = self.run_single_turn(task, item, group_size)
        else:
            episodes, failures = self.run_agent(task, item, group_size)
        versions = Counter(v for ep in episodes for seg in ep["segments"] for v in seg["weight_versions"])
        return {"gid": item.gid, "prompt_index": item.prompt_index, "attempt": item.attempt, "task": task.name,
                "kind": task.kind, "worker": self.name, "episodes": episodes, "sandbox_failures": failures,
                "version_counts": dict(versions), "min_weight_version": min(versions) if versions else None,
                "eval_version": item.eval_version, "seconds": time.perf_counter() - t0}

    def _claim(self) -> tuple[Optional[WorkItem], Optional[WorkQueue]]:
        """The next item and its queue: a held-out evaluation item of a version the engine holds (the trainer
        may be waiting for it), else a training group."""
        if self.eval_queue is not None:
            held = self.engine.weight_version
            item = self.eval_queue.claim(self.name, accept=lambda it: it.eval_version <= held)
            if item is not None:
                return item, self.eval_queue
        return self.queue.claim(self.name), self.queue

    # -- main loop ------------------------------------------------------------------------------------
    def run(self) -> None:
        """Claim and run groups until the queue says stop (then the tensor-parallel followers stop too)."""
        lockstep_beat = _LockstepHeartbeat(self.drive) if self.drive.group is not None else None
        beat = None
        try:
            self.wait_for_weights()
            while not self.queue.stop_requested(self.name, self.stops_since):
                with self._drive_lock:
                    self.apply_ready()
                item, queue = self._claim()
                if item is None:
                    time.sleep(0.02)
                    continue
                beat = _Heartbeat(queue, self.name, item.gid, self.cfg.heartbeat_s)
                try:
                    result = self.run_group(item)
                except EpisodeCrash as e:
                    print(f"worker {self.name}: giving group {item.gid} back to the queue: {e}", flush=True)
                    queue.release(self.name, item)
                    continue
                finally:
                    beat.stop()
                if not queue.complete(self.name, item, result):
                    print(f"worker {self.name}: group {item.gid} was re-issued meanwhile; result dropped", flush=True)
        except BaseException as e:
            self.error = e
            traceback.print_exc()
            raise
        finally:
            for b in (beat, lockstep_beat):
                if b is not None:
                    b.stop()
            self.drive.stop()
            self.subscriber.stop() if hasattr(self.subscriber, "stop") else None
            if self._pool is not None:
                self._pool.close()


class _LockstepHeartbeat:
    """Between engine steps (waiting for work or weights, running sandbox commands) no broadcast reaches the
    followers; a beat every `every_s` for the whole run keeps their wait within the process group's timeout."""

    def __init__(self, drive: Lockstep, every_s: float = 30.0):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(drive, every_s), name="lockstep-beat", daemon=True)
        self._thread.start()

    def _run(self, drive: Lockstep, every_s: float):
        while not self._stop.wait(every_s):
            drive.heartbeat()

    def stop(self):
        self._stop.set()
        self._thread.join()


class _PrefetchedVersions:
    """A follower's weights: its own ShardSubscriber prepares new versions of its boxes in the background (as
    the worker's does); `fetch(version)` hands over the one the worker applied, or prepares it if it is not
    there (or was prepared on another version than the one now held)."""

    def __init__(self, subscriber, keep: int = 2):
        self.subscriber, self.keep = subscriber, keep
        self._states: dict[int, dict] = {}
        self._applied = -1
        self._lock = threading.Lock()

    def on_ready(self, _version: int) -> None:
        ready = self.subscriber.pop_ready()
        with self._lock:
            if ready is not None and ready.version > self._applied:
                self._states[ready.version] = ready
                for v in sorted(self._states)[:-self.keep]:
                    del self._states[v]

    def fetch(self, version: int) -> dict:
        with self._lock:
            state = self._states.pop(version, None)
            self._applied = max(self._applied, version)
            for v in [v for v in self._states if v < version]:
                del self._states[v]  # the worker never goes back
        if state is not None and state.delta and state.base_id != self.subscriber.held_id:
            state = None  # a delta on a version this rank no longer holds
        return state if state is not None else self.subscriber.prepare(version)


class _Replica:
    """A follower's engine as `follow` drives it, logging each weight version it applies."""

    def __init__(self, engine: Engine, name: str):
        self.engine, self.tp_group, self.name = engine, engine.tp_group, name

    def add_request(self, prompt, params) -> int:
        return self.engine.add_request(prompt, params)

    def step(self):
        return self.engine.step()

    def pop_result(self, rid: int):
        return self.engine.pop_result(rid)

    def update_weights(self, weights, version: int, **kw) -> None:
        if hasattr(weights, "commit"):  # this rank's own BoxUpdate: values or an XOR delta, as it was prepared
            kw["delta"] = weights.delta
        self.engine.update_weights(weights, version, **kw)
        if hasattr(weights, "commit"):
            weights.commit()
        print(f"{self.name}: applied weights v{version}", flush=True)


def run_follower(name: str, cfg: RolloutConfig, model: torch.nn.Module, subscriber, poll_seconds: float = 1.0,
                 engine_group=None) -> None:
    """A rank of an engine other than its first: replay the worker's engine calls, with this rank's boxes of
    each weight version read from the store by its own ShardSubscriber, until the worker stops. engine_group:
    as RolloutWorker's."""
    engine = rollout_engine(model, cfg)
    versions = _PrefetchedVersions(subscriber)
    subscriber.start(poll_seconds, on_ready=versions.on_ready)
    try:
        follow(_Replica(engine, name), versions.fetch, group=engine_group)
    finally:
        subscriber.stop()


class _Heartbeat:
    def __init__(self, queue: WorkQueue, worker: str, gid: int, every_s: float):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(queue, worker, gid, every_s), daemon=True)
        self._thread.start()

    def _run(self, queue, worker, gid, every_s):
        while not self._stop.wait(every_s):
            if not queue.heartbeat(worker, gid):
                return

    def stop(self):
        self._stop.set()
        self._thread.join()


def continuation_ids(worker: RolloutWorker, history: list[dict], new: list[dict], tools, held: list[int]) -> list[int]:
    """The tokens a rollout appends after its sampled turn `history[-1]` (whose tokens end `held`) when the messages
    `new` arrive: markup encoded as such, tool outputs with `encode_plain`."""
    closed = bool(held) and held[-1] == worker.end_of_turn_id
    ids: list[int] = []
    for text, outside in worker.format.continuation_segments(history, new, tools=tools, closed=closed):
        ids += worker.tokenizer.encode_plain(text) if outside else worker.tokenizer.encode(text)
    return ids


class EnginePolicy:
    """`rl.envs.agent.Policy` backed by the worker's engine, recording the exact token stream.

    One `TokenLedger` per segment: its prompt is the rendered start of the conversation; after that it only
    grows, by the tokens sampled (mask 1) and by the tokens of `ChatFormat.continuation` for what run_episode
    appended since (mask 0). ``summarize`` (run_episode's self-summarisation hook) samples the summary as the
    last turn of the current segment, closes it, and the next call starts a new ledger from the condensed
    context run_episode hands over (system + task + summary)."""

    def __init__(self, worker: RolloutWorker, seed: int):
        from rl.envs.agent import agent_profile

        self.worker = worker
        self.tools = agent_profile(worker.cfg.agent_profile).schemas
        self.seed = seed
        self.ledger: Optional[TokenLedger] = None
        self.finished: list[dict] = []  # closed segments, each ending with its summary
        self.seen = 0  # messages already in the ledger (the last one: our own sampled turn)
        self.turn = 0
        self.overflowed = False

    def _continuation_ids(self, messages: list[dict]) -> list[int]:
        """Tokens of what run_episode appended after our last sampled turn (messages[seen - 1]); the tool
        outputs in it are encoded as plain text (a control token's spelling in them stays text)."""
        return continuation_ids(self.worker, messages[:self.seen], messages[self.seen:], self.tools,
                                self.ledger.response_ids)

    def _read(self, messages: list[dict]) -> None:
        """Bring the ledger up to `messages`: a new segment's prompt, or the messages since the last turn."""
        if self.ledger is None:
            self.ledger = TokenLedger(self.worker._prompt_ids(messages, self.tools))
        else:
            self.ledger.add_context(self._continuation_ids(messages))
        self.seen = len(messages)

    def _sample(self, max_new_tokens: int) -> Optional[str]:
        """Sample one turn into the ledger; None when the context has no room left."""
        w = self.worker
        budget = min(max_new_tokens, w.cfg.max_seq_len - len(self.ledger.ids))
        if budget < 1:
            self.overflowed = True
            return None
        (result,) = w.generate([self.ledger.ids], budget, [_seed(self.seed, self.turn)])
        self.turn += 1
        self.ledger.add_generation(result)
        return w._text(result.token_ids)

    def __call__(self, messages: list[dict]) -> str:
        self._read(messages)
        text = self._sample(self.worker.cfg.agent_max_new_tokens)
        if text is None:
            return ""  # no tool call: the episode ends and is verified as it stands
        self.seen += 1  # the assistant message run_episode is about to append
        return text

    def context_tokens(self, messages: list[dict]) -> int:
        """Size of the context `messages` makes: the ledger plus what run_episode appended since our last turn
        (only that tail is tokenised)."""
        if self.ledger is None:
            return len(self.worker._prompt_ids(messages, self.tools))
        return len(self.ledger.ids) + (len(self._continuation_ids(messages)) if len(messages) > self.seen else 0)

    def summarize(self, messages: list[dict]) -> str:
        self._read(messages)  # ends with the summary request
        w = self.worker
        text = self._sample(w.cfg.summary_max_new_tokens or w.cfg.agent_max_new_tokens)
        self.finished.append(self.ledger.segment())
        self.ledger, self.seen = None, 0
        return text or ""

    def all_segments(self) -> list[dict]:
        return self.finished + ([self.ledger.segment()] if self.ledger is not None else [])
