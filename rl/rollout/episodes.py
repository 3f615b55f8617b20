"""Episodes: a group's G episodes of a task, run on a rollout engine, as the queue stores them.

* single-turn tasks: the G samples of the prompt are generated as one batch and scored by the task's check;
* agent tasks: `rl.envs.run_episode` in forks of the task's sandbox (`SandboxPool`), the policy being the
  engine (`EnginePolicy`). Token in, token out: the policy keeps the exact token ids it generated and appends
  only the tokens of what the environment added after them (`ChatFormat.continuation`: the rest of the turn's
  closing, the tool results, the next generation prompt) as context tokens (loss mask 0); nothing already in
  the context is re-rendered or re-tokenised, so the trainer sees the very tokens that were sampled, in the
  context they were sampled in (earlier turns keep their reasoning even where the template, re-rendering,
  would drop it). A `TokenLedger` holds one context window's stream.

Conversations are rendered in the run's chat format (`data.chat_format`: the model's own template or ChatML).
Each episode's record (`episode_record`) carries the training reward: the verifier's plus the objective's
shaping terms.

Faults of the infrastructure and failures of the policy are kept apart (#57). A fault of the host -- a sandbox
that could not be forked or started before the agent acted (each episode's sandbox is started with a no-op command
before the model's first turn), the host short of disk or memory (`rl.envs.verdict.HostFault`), the engine failing
-- is retried up to ``rollout.episode_retries`` times, counted in the group's ``infra_faults``; after that the group
raises `EpisodeCrash` (the claim loop, rl/rollout/worker.py, hands it back to the queue). An episode that ends in an
error its own actions caused (a command that broke its sandbox; a verifier phase that could not run, which every
verifier turns into a void verdict) scores 0 with the reason in ``meta["error"]``: it is kept, trained on, counted
(``policy_errors`` of rl.metrics.group_metrics), and its group is not re-queued. A verifier that hangs is killed by
the task's verifier timeout and scores 0.

`EpisodeRunner` needs only an engine that generates (``engines.generate(prompts, sampling_params)``, as
`rl.rollout.engines.EngineLeader` does); it knows nothing of queues or weight versions.
"""

from __future__ import annotations

import time
import zlib
from collections import Counter
from typing import Optional

import torch

from megatron_composer.data.chat_format import ChatFormat, load_chat_format
from megatron_composer.inference.sampling import SamplingParams
from rl.orchestrator import WorkItem
from rl.rollout.config import RolloutConfig
from rl.rollout.tasks import RLTask


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
    """The infrastructure failed an episode (its sandbox, the host, the engine); the episode (not its reward) is lost
    and is rerun."""


def start_sandbox(sandbox) -> None:
    """Start a forked sandbox (its episode, and the image's ENTRYPOINT) with a no-op before the agent acts, so that
    one that cannot start is the infrastructure's fault (EpisodeCrash), never mistaken for the agent's doing."""
    try:
        res = sandbox.exec("true", timeout=120)
    except Exception as e:
        raise EpisodeCrash(f"the sandbox could not start: {type(e).__name__}: {e}") from e
    if not res.ok:
        raise EpisodeCrash(f"the sandbox could not start: `true` gave {res.describe()}: {res.output.strip()[-200:]}")


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


class EpisodeRunner:
    """The episodes of a task's group on `engines` (anything with ``generate(prompts, sampling_params)`` that
    returns the engine's results in order): prompts rendered in the chat format, tokens sampled at the rollout
    temperature, sandboxes from ``sandbox_backend`` (default: a local one, made when first needed)."""

    def __init__(self, name: str, cfg: RolloutConfig, tokenizer, tasks: list[RLTask], engines, seed: int = 0,
                 objective=None, sandbox_backend=None, eval_tasks: Optional[list[RLTask]] = None,
                 chat_format: Optional[ChatFormat] = None):
        self.name, self.cfg, self.tokenizer, self.tasks, self.engines = name, cfg, tokenizer, tasks, engines
        # how prompts are rendered and turns parsed (data.chat_format; default: the tokenizer's template, else ChatML)
        self.format = chat_format or load_chat_format("auto", tokenizer)
        self.eval_tasks = eval_tasks  # held-out tasks (eval.tasks) of items with an eval_version
        self.objective = objective  # RLObjectiveConfig: the training reward's shaping terms (None: verifier reward)
        self.seed = seed
        self.stop_ids = self.format.stop_token_ids(tokenizer)
        self.end_of_turn_id = tokenizer.token_to_id(self.format.end_of_turn)
        self._backend = sandbox_backend
        self._pool = None

    # -- generation -----------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_new_tokens: int, seeds: list[int]):
        params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                                 stop_token_ids=self.stop_ids, seed=s) for s in seeds]
        return self.engines.generate(prompts, params)

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

            self._backend = LocalBackend(unisolated=self.cfg.sandbox_unisolated,
                                         build_images=self.cfg.sandbox_build_images,
                                         network=None if self.cfg.sandbox_network == "task" else "none",
                                         egress_hosts=tuple(self.cfg.egress_hosts))
        return self._backend

    def _get_pool(self):
        if self._pool is None:
            from rl.envs.task import prepare_task
            from rl.sandbox import SandboxPool

            self._pool = SandboxPool(self._get_backend(), prepare_task, concurrency=self.cfg.sandbox_concurrency)
        return self._pool

    def close(self) -> None:
        """Close the sandbox pool, if one was opened."""
        if self._pool is not None:
            self._pool.close()

    def run_agent_episode(self, task: RLTask, sandbox, seed: int) -> dict:
        """One agent episode; with rollout.summary_trigger_tokens it may be a chain of segments, each a training
        sample of the episode (the summary that ends a segment is sampled and trained like any turn). Raises
        `EpisodeCrash` for a fault of the infrastructure (retried); an error of the episode's own is its 0."""
        from rl.envs import EpisodeConfig, run_episode
        from rl.envs.verdict import HostFault, host_shortage, one_line

        start_sandbox(sandbox)
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
        except Exception as e:
            why = f"{type(e).__name__}: {one_line(str(e))}"
            if isinstance(e, HostFault) or policy.engine_error is not None:
                raise EpisodeCrash(why) from e  # the host or the engine failed, not the episode
            if (short := host_shortage()) is not None:
                raise EpisodeCrash(f"{short}: {why}") from e
            if not policy.all_segments():
                raise EpisodeCrash(f"the episode failed before the first model turn: {why}") from e
            return self.failed_episode(policy, f"the episode ended in an error of its own: {why}")
        segments = policy.all_segments()
        if not segments:  # the episode ended before the model was asked anything
            raise EpisodeCrash("episode ended before the first model turn")
        verify = ep.verify
        transcript = [m for seg in ep.segments for m in seg]  # the whole chain
        meta = {"turns": ep.turns, "tokens": sum(sum(seg["response_mask"]) for seg in segments),
                "segments": len(segments), "summaries": len(ep.summaries), "stop_reason": ep.stop_reason,
                "tool_calls": sum(ep.tool_calls.values()), "malformed_tool_calls": ep.malformed_tool_calls,
                "verifier_timeout": bool(verify is not None and "timed out" in verify.output.lower()),
                "context_overflow": policy.overflowed,
                "verdict": (verify.output[-500:] if verify is not None else ""),
                "transcript": ep.messages}
        if verify is not None and "error" in verify.details:  # a void verdict: no decision, scored 0
            meta["error"] = verify.details["error"]
        return self.episode(ep.reward, transcript, segments, meta)

    def failed_episode(self, policy: "EnginePolicy", why: str) -> dict:
        """An episode its own actions ended in an error: its tokens as sampled, a verifier reward of 0, the reason."""
        segments = policy.all_segments()
        transcript = policy.transcript()
        return self.episode(0.0, transcript, segments, {
            "turns": policy.turn, "tokens": sum(sum(seg["response_mask"]) for seg in segments),
            "segments": len(segments), "summaries": len(policy.finished), "stop_reason": "error",
            "tool_calls": sum(len(m.get("tool_calls") or []) for m in transcript if m.get("role") == "assistant"),
            "malformed_tool_calls": 0, "verifier_timeout": False, "context_overflow": policy.overflowed,
            "verdict": "", "error": why, "transcript": transcript})

    def run_agent(self, task: RLTask, item: WorkItem, group_size: int) -> tuple[list[dict], int]:
        """The group's episodes and how many faults of the infrastructure were retried on the way."""
        pool = self._get_pool()
        faults = 0

        def one(i: int) -> dict:
            nonlocal faults
            for attempt in range(self.cfg.episode_retries + 1):
                try:
                    with pool.fork(task.harbor) as sandbox:
                        return self.run_agent_episode(task, sandbox,
                                                      _seed(self.seed, item.gid, item.attempt, i, attempt))
                except Exception as e:  # EpisodeCrash, SandboxError from fork, ...: the infrastructure's
                    faults += 1
                    print(f"worker {self.name}: group {item.gid} episode {i} infrastructure fault "
                          f"({attempt + 1}/{self.cfg.episode_retries + 1}): {str(e)[:300]}", flush=True)
            raise EpisodeCrash(f"episode {i} of group {item.gid} failed {self.cfg.episode_retries + 1} times")

        futures = [pool._executor.submit(one, i) for i in range(group_size)]
        return [f.result() for f in futures], faults

    def run_group(self, item: WorkItem) -> dict:
        """The item's group: a training group of a training task, or (``item.eval_version`` set) a held-out
        task's ``item.samples`` episodes, tagged with that version."""
        task = (self.tasks if item.eval_version is None else self.eval_tasks)[item.prompt_index]
        group_size = item.samples or self.cfg.group_size
        t0 = time.perf_counter()
        faults = 0
        if task.kind == "single_turn":
            episodes = self.run_single_turn(task, item, group_size)
        else:
            episodes, faults = self.run_agent(task, item, group_size)
        versions = Counter(v for ep in episodes for seg in ep["segments"] for v in seg["weight_versions"])
        return {"gid": item.gid, "prompt_index": item.prompt_index, "attempt": item.attempt, "task": task.name,
                "kind": task.kind, "worker": self.name, "episodes": episodes, "infra_faults": faults,
                "version_counts": dict(versions), "min_weight_version": min(versions) if versions else None,
                "eval_version": item.eval_version, "seconds": time.perf_counter() - t0}


def continuation_ids(runner: EpisodeRunner, history: list[dict], new: list[dict], tools,
                     held: list[int]) -> list[int]:
    """The tokens a rollout appends after its sampled turn `history[-1]` (whose tokens end `held`) when the messages
    `new` arrive: markup encoded as such, tool outputs with `encode_plain`."""
    closed = bool(held) and held[-1] == runner.end_of_turn_id
    ids: list[int] = []
    for text, outside in runner.format.continuation_segments(history, new, tools=tools, closed=closed):
        ids += runner.tokenizer.encode_plain(text) if outside else runner.tokenizer.encode(text)
    return ids


class EnginePolicy:
    """`rl.envs.agent.Policy` backed by the runner's engine, recording the exact token stream.

    One `TokenLedger` per segment: its prompt is the rendered start of the conversation; after that it only
    grows, by the tokens sampled (mask 1) and by the tokens of `ChatFormat.continuation` for what run_episode
    appended since (mask 0). ``summarize`` (run_episode's self-summarisation hook) samples the summary as the
    last turn of the current segment, closes it, and the next call starts a new ledger from the condensed
    context run_episode hands over (system + task + summary)."""

    def __init__(self, worker: EpisodeRunner, seed: int):
        from rl.envs.agent import agent_profile

        self.worker = worker
        self.tools = agent_profile(worker.cfg.agent_profile).schemas
        self.seed = seed
        self.ledger: Optional[TokenLedger] = None
        self.finished: list[dict] = []  # closed segments, each ending with its summary
        self.seen = 0  # messages already in the ledger (the last one: our own sampled turn)
        self.turn = 0
        self.overflowed = False
        self.engine_error: Optional[BaseException] = None  # what the engine raised, if it did: not the episode's
        self.messages: list[dict] = []  # the current segment's conversation, as run_episode holds it
        self.earlier_messages: list[dict] = []  # the closed segments' conversations

    def _continuation_ids(self, messages: list[dict]) -> list[int]:
        """Tokens of what run_episode appended after our last sampled turn (messages[seen - 1]); the tool
        outputs in it are encoded as plain text (a control token's spelling in them stays text)."""
        return continuation_ids(self.worker, messages[:self.seen], messages[self.seen:], self.tools,
                                self.ledger.response_ids)

    def _read(self, messages: list[dict]) -> None:
        """Bring the ledger up to `messages`: a new segment's prompt, or the messages since the last turn."""
        self.messages = messages  # run_episode's own list: what it appends after this call shows in it too
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
        try:
            (result,) = w.generate([self.ledger.ids], budget, [_seed(self.seed, self.turn)])
        except Exception as e:
            self.engine_error = e
            raise
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
        self.earlier_messages += messages
        self.ledger, self.seen, self.messages = None, 0, []
        return text or ""

    def all_segments(self) -> list[dict]:
        return self.finished + ([self.ledger.segment()] if self.ledger is not None else [])

    def transcript(self) -> list[dict]:
        """Every message of the episode so far (all segments), for an episode that ended before run_episode
        returned its own."""
        return self.earlier_messages + self.messages
