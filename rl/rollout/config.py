"""The rollout section of the RL config (``rollout.*``) and its checks.

A schema only: it imports no engine, model or worker, so `rl.config` (and anything that only reads a config) can
use it without loading the inference stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_composer.config import ConfigError


@dataclass
class RolloutConfig:
    group_size: int = field(default=8, metadata={
        "help": "episodes per prompt (G); advantages are relative to the group"})
    max_new_tokens: int = field(default=16, metadata={"help": "single-turn: tokens per response"})
    temperature: float = field(default=1.0, metadata={
        "help": "sampling temperature of rollouts; the trainer's log-probs use the same"})
    top_p: float = field(default=1.0, metadata={
        "help": "must be 1: a truncated sampling distribution is not what the trainer's log-probs measure"})
    max_inflight_groups: int = field(default=4, metadata={
        "help": "bounded queue: groups issued to workers and not yet trained"})
    max_staleness: int = field(default=2, metadata={
        "help": "a group whose oldest token is more versions behind the trainer is redone"})
    lease_s: float = field(default=60.0, metadata={
        "help": "a claimed group whose worker stops heartbeating this long is re-queued"})
    heartbeat_s: float = field(default=2.0, metadata={"help": "how often a worker renews the lease of its group"})
    embedded_workers: int = field(default=1, metadata={
        "help": "rollout worker threads inside the trainer when the run has one process"})
    max_batch_size: int = 64
    backend: str = field(default="engine", metadata={
        "help": "engine: the project's inference engine (CPU, CI, the bit-exact reference); "
                "vllm: an in-process vLLM (megatron_composer/inference/vllm_engine.py) "
                "whose weights come from the same store"})
    tp: int = field(default=1, metadata={
        "help": "tensor-parallel size of each rollout engine (heads, FFN columns, vocabulary)"})
    ep: int = field(default=1, metadata={
        "help": "expert-parallel size of each rollout engine (the routed experts); rollout ranks "
                "form consecutive engines of tp x ep processes, whose first rank runs the worker"})
    vllm_layout: str = field(default="tp", metadata={
        "help": "vllm: tp (one engine process; vLLM tensor parallelism over its tp x ep GPUs, experts spread with "
                "EP) or dp_attention (vLLM's DP + EP: ep engine processes on one node, one per GPU, each with its "
                "own requests and cache, the experts spread over all of them; tp = dcp = 1; what plan_parallel "
                "--rollout recommends for Kimi K2.5)"})
    dp_port: int = field(default=29650, metadata={
        "help": "vllm_layout=dp_attention: the port an engine's ranks meet at on their node (+ the engine's index)"})
    dcp: int = field(default=1, metadata={
        "help": "vllm: split each sequence's KV cache over this many of the engine's GPUs (vLLM's "
                "decode context parallelism; MLA's latent cache is otherwise on every one)"})
    quantize_experts: str = field(default="none", metadata={
        "help": "vllm: none, or int4: serve the routed experts in Kimi K2.5's "
                "pack-quantized INT4 (each update quantised as the INT4 export does)"})
    max_seq_len: int = field(default=1024, metadata={"help": "engine context: prompt + all turns of an agent episode"})
    cache_memory_mb: int = 256
    agent_max_turns: int = field(default=4, metadata={"help": "agent tasks: turns per episode"})
    agent_max_new_tokens: int = field(default=96, metadata={"help": "agent tasks: tokens per turn"})
    agent_command_timeout_s: float = 30.0
    agent_profile: str = field(default="full", metadata={
        "help": "agent tasks: the system prompt and tools the agent is given "
                "(rl/envs/agent.py PROFILES: full, or compact for small models)"})
    summary_trigger_tokens: int = field(default=0, metadata={
        "help": "agent tasks: once an episode's context reaches this many tokens the model "
                "summarises it and continues in a new segment (system + task + summary); 0 = off"})
    summary_max_new_tokens: int = field(default=0, metadata={
        "help": "tokens a summary may take (it may think first); 0 = agent_max_new_tokens"})
    sandbox_concurrency: int = field(default=2, metadata={"help": "sandboxes a worker runs at once"})
    sandbox_unisolated: bool = field(default=False, metadata={
        "help": "run sandboxes without bubblewrap (trusted code only)"})
    sandbox_build_images: bool = field(default=False, metadata={
        "help": "build every task's Dockerfile into an image (rl/sandbox/image.py), even where the host's system "
                "could stand in (a task whose steps reach past /app is built either way)"})
    sandbox_network: str = field(default="task", metadata={
        "help": "the agents' network: task (what each task declares: none, or public through the run's egress "
                "proxy to this host's package registries) or none (no agent has one, whatever its task declares: "
                "RL on tasks whose fix is published upstream)"})
    egress_hosts: list = field(default_factory=list, metadata={
        "help": "hosts the egress proxy allows beyond this host's package registries (host, *.domain, host:port)"})
    episode_retries: int = field(default=2, metadata={
        "help": "a crashed sandbox episode is rerun this often before the group is re-queued"})
    group_timeout_s: float = field(default=1800.0, metadata={
        "help": "the trainer's wait for the next finished group before it gives up"})

    def episode_token_budget(self, agent_tasks: bool) -> int:
        """The most tokens an episode may generate: max_new_tokens (single-turn), or agent_max_turns x
        agent_max_new_tokens when the task set has agent tasks (run_episode's generation budget)."""
        single = self.max_new_tokens
        return max(single, self.agent_max_turns * self.agent_max_new_tokens) if agent_tasks else single

    @property
    def engine_ranks(self) -> int:
        """Processes per rollout engine launched by us (a vLLM engine is one process that starts its own tp x ep
        workers, or with vllm_layout=dp_attention one process per GPU)."""
        if self.backend == "vllm":
            return self.ep if self.vllm_layout == "dp_attention" else 1
        return self.tp * self.ep

    def validate(self) -> "RolloutConfig":
        if self.sandbox_network not in ("task", "none"):
            raise ConfigError(f"rollout.sandbox_network={self.sandbox_network!r}: use task (as each task declares) "
                              "or none")
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
        if self.vllm_layout not in ("tp", "dp_attention"):
            raise ConfigError(f"rollout.vllm_layout={self.vllm_layout!r}: use tp or dp_attention")
        if self.vllm_layout == "dp_attention" and (self.backend != "vllm" or self.tp != 1 or self.dcp != 1
                                                   or self.ep < 2):
            raise ConfigError("rollout.vllm_layout=dp_attention is vLLM's data-parallel attention: "
                              "rollout.backend=vllm, tp=1, dcp=1 and ep >= 2 engine processes (got "
                              f"backend={self.backend}, tp={self.tp}, dcp={self.dcp}, ep={self.ep})")
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
                              "ratios would be biased; set rollout.top_p=1 and control sampling with "
                              "rollout.temperature")
        if self.max_inflight_groups < 1 or self.max_staleness < 0:
            raise ConfigError("rollout.max_inflight_groups must be >= 1 and rollout.max_staleness >= 0")
        if self.summary_trigger_tokens < 0 or self.summary_max_new_tokens < 0:
            raise ConfigError("rollout.summary_trigger_tokens and rollout.summary_max_new_tokens must be >= 0 "
                              "(0 = off / default)")
        if self.summary_trigger_tokens >= self.max_seq_len:
            raise ConfigError(f"rollout.summary_trigger_tokens={self.summary_trigger_tokens} must be below "
                              f"rollout.max_seq_len={self.max_seq_len} (the summary is generated inside that "
                              "context); lower it or 0 = off")
        if self.heartbeat_s >= self.lease_s:
            raise ConfigError(f"rollout.heartbeat_s ({self.heartbeat_s}) must be shorter than rollout.lease_s "
                              f"({self.lease_s})")
        return self
