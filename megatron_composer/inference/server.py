"""OpenAI-compatible HTTP server over the engine (standard library only).

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions.
Chat requests (`messages`, optional `tools`) are rendered in the server's chat format (`--chat-format`:
the checkpoint's own template with its tool-call parser, else the project's ChatML; data.chat_format) and the
reply is parsed by the same format, so reasoning comes back as `reasoning_content` and tool calls as OpenAI
`tool_calls` (with the ids the model wrote, e.g. Kimi's functions.NAME:IDX). Generation stops at the
tokenizer's end-of-document token and, for chat, at the format's end of turn.

Beyond the OpenAI fields every choice carries what RL training needs: `token_ids`, `token_logprobs`
(temperature-1 log-probabilities), `sampling_logprobs` (under the distribution sampled from),
`routed_experts` ([tokens][moe layers][top_k]), `weight_versions` and `prompt_token_ids`; chat choices also
carry `tool_call_errors`. Extra request fields: `top_k`, `stop_token_ids`, `seed`, `speculative`,
`num_draft_tokens`. Malformed requests get a 4xx JSON error naming the field; the server keeps serving.

    python tools/serve.py --checkpoint DIR [--tokenizer PATH] [--port 8000]     (the command line of `serve`)

Tensor / expert parallel: `torchrun --nproc-per-node 4 tools/serve.py --checkpoint DIR --tp 2 --ep 2`. Every
rank builds the model on the meta device in its layout and reads only its slices of the checkpoint
(inference/loading.py); rank 0 serves HTTP, and before each engine step it broadcasts the requests added since
the last one, so every rank's engine admits the same requests and steps together (inference.lockstep:
`Lockstep` on rank 0, `follow` on the others, over all the engine's ranks).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

import torch.distributed as dist

from megatron_composer.data.chat_format import ChatFormat, load_chat_format, new_call_id
from megatron_composer.data.chat_template import ChatFormatError

from .engine import Engine, EngineError, GenerationResult
from .kv_cache import CacheError
from .lockstep import Lockstep, follow
from .sampling import SamplingError, SamplingParams


class RequestError(ValueError):
    """A request the server refuses; becomes an HTTP 4xx with this message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _field(body: dict, name: str, kind, default, check=None, hint: str = ""):
    value = body.get(name, default)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise RequestError(f"'{name}' must be {kind.__name__ if isinstance(kind, type) else kind}, got {value!r}")
    if check is not None and not check(value):
        raise RequestError(f"'{name}' is out of range: {value!r}{'; ' + hint if hint else ''}")
    return value


class InferenceServer:
    """Runs the engine loop in one thread and an HTTP server in another; `start()`, `url`, `stop()`."""

    def __init__(self, engine: Engine, tokenizer, model_name: str = "megatron-composer", host: str = "127.0.0.1",
                 port: int = 0, request_timeout_s: float = 600.0, group=None, chat_format: Optional[ChatFormat] = None):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.format = chat_format or load_chat_format("auto", tokenizer)
        if engine.detokenize is None:
            engine.detokenize = tokenizer.decode
        self.request_timeout_s = request_timeout_s
        self._wake = threading.Condition()
        self._done: dict[int, threading.Event] = {}
        self._errors: dict[int, str] = {}
        self._stop = threading.Event()
        self._fatal = ""
        self._lockstep = Lockstep(engine, group=group)
        self._httpd = ThreadingHTTPServer((host, port), self._handler_class())
        self._httpd.daemon_threads = True
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "InferenceServer":
        for target in (self._engine_loop, self._httpd.serve_forever):
            t = threading.Thread(target=target, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        self._httpd.shutdown()
        self._httpd.server_close()
        for t in self._threads:
            t.join(timeout=10)

    def serve_forever(self) -> None:
        """Serve until interrupted, or until the engine loop ends (a tensor-parallel engine whose step failed:
        its ranks may no longer agree, so the server stops instead of serving from a broken engine)."""
        self.start()
        try:
            self._wait_for_stop()
        except KeyboardInterrupt:
            self._stop.set()
        self.stop()
        if self._fatal:
            raise SystemExit(self._fatal)

    def _wait_for_stop(self) -> None:
        while not self._stop.wait(1.0):  # a timed wait, so Ctrl-C reaches the main thread
            continue

    # ---- engine side -------------------------------------------------------------------------------
    def _engine_loop(self) -> None:
        try:
            self._run_engine()
        finally:
            self._lockstep.stop()  # the other tensor-parallel ranks leave follow()
            self._stop.set()

    def _run_engine(self) -> None:
        while not self._stop.is_set():
            with self._wake:
                if not self.engine.has_unfinished() and not self._stop.is_set():
                    self._wake.wait(timeout=1.0)
            if self._stop.is_set():
                return
            if not self.engine.has_unfinished():
                self._lockstep.heartbeat()
                continue
            try:
                finished = self._lockstep.step()
            except Exception as e:  # an engine failure fails the requests in flight, not the server
                message = f"engine step failed: {type(e).__name__}: {e}"
                pending = [s.rid for s in list(self.engine._running) + list(self.engine._waiting)]
                for s in list(self.engine._running):
                    self.engine.cache.release(s.blocks)
                self.engine._running.clear()
                self.engine._waiting.clear()
                for rid in pending:
                    self._errors[rid] = message
                    self._signal(rid)
                if self._lockstep.group is not None:
                    # the other ranks still hold those requests (or failed themselves): they cannot be
                    # brought back in step, so the server stops and says why
                    self._fatal = f"tensor-parallel {message}; the server stopped"
                    print(self._fatal, flush=True)
                    return
                continue
            for r in finished:
                self._signal(r.request_id)

    def update_weights(self, weights, version: int, *, delta: bool = False, recompute_cache: bool = False) -> None:
        """Engine.update_weights between two steps (on every tensor-parallel rank); requests in flight go on."""
        self._lockstep.update_weights(weights, version, delta=delta, recompute_cache=recompute_cache)

    def _signal(self, rid: int) -> None:
        event = self._done.get(rid)
        if event is not None:
            event.set()

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationResult]:
        events = {}
        rids = []
        for prompt in prompts:
            rid = self._lockstep.add_request(prompt, params)
            events[rid] = self._done.setdefault(rid, threading.Event())
            if rid in self.engine._finished or rid in self._errors:  # finished before the event existed
                events[rid].set()
            rids.append(rid)
        with self._wake:
            self._wake.notify_all()
        results = []
        for rid in rids:
            if not events[rid].wait(self.request_timeout_s):
                raise RequestError(f"generation did not finish within {self.request_timeout_s:.0f}s", status=504)
            self._done.pop(rid, None)
            if rid in self._errors:
                raise RuntimeError(self._errors.pop(rid))
            results.append(self.engine.pop_result(rid))
        return results

    # ---- request parsing ---------------------------------------------------------------------------
    def _sampling(self, body: dict, extra_stop_ids: list[int]) -> tuple[SamplingParams, int]:
        if body.get("stream"):
            raise RequestError("'stream' is not supported; send stream=false")
        for unsupported in ("echo", "best_of", "suffix", "logit_bias"):
            if body.get(unsupported):
                raise RequestError(f"'{unsupported}' is not supported by this server")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise RequestError(f"model '{model}' is not served here; GET /v1/models lists '{self.model_name}'", 404)
        max_tokens = _field(body, "max_tokens", int, None, lambda v: v >= 1, "must be >= 1")
        max_tokens = _field(body, "max_completion_tokens", int, max_tokens or 16, lambda v: v >= 1, "must be >= 1")
        stop = body.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError("'stop' must be a non-empty string or a list of them")
        stop_ids = _field(body, "stop_token_ids", list, [])
        if not all(isinstance(t, int) for t in stop_ids):
            raise RequestError("'stop_token_ids' must be a list of integers")
        n = _field(body, "n", int, 1, lambda v: 1 <= v <= 64, "must be in 1..64")
        params = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=_field(body, "temperature", float, 1.0, lambda v: 0 <= v <= 100, "must be in [0, 100]"),
            top_p=_field(body, "top_p", float, 1.0),
            top_k=_field(body, "top_k", int, 0, lambda v: v >= 0, "0 disables top-k"),
            stop_token_ids=sorted(set(stop_ids) | set(extra_stop_ids)),
            stop_strings=stop,
            seed=_field(body, "seed", int, None),
            speculative=_field(body, "speculative", bool, False),
            num_draft_tokens=_field(body, "num_draft_tokens", int, 2, lambda v: 1 <= v <= 16, "must be in 1..16"),
        )
        params.validate(self.engine.cfg.vocab_size)
        return params, n

    def _prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.tokenizer.encode(prompt)]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [prompt]
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            return [q for p in prompt for q in self._prompts(p)]
        raise RequestError("'prompt' must be a string, a list of token ids, or a list of those")

    def _stop_ids(self, chat: bool) -> list[int]:
        return self.format.stop_token_ids(self.tokenizer) if chat else [self.tokenizer.eod]

    @staticmethod
    def _extras(r: GenerationResult) -> dict:
        return {
            "prompt_token_ids": r.prompt_token_ids,
            "token_ids": r.token_ids,
            "token_logprobs": r.logprobs,
            "sampling_logprobs": r.sampling_logprobs,
            "routed_experts": None if r.routed_experts is None else r.routed_experts.tolist(),
            "weight_versions": r.weight_versions,
            "num_draft_tokens": r.num_draft_tokens,
            "num_accepted_tokens": r.num_accepted_tokens,
        }

    def _usage(self, results: list[GenerationResult]) -> dict:
        prompt = sum(len(r.prompt_token_ids) for r in results)
        completion = sum(len(r.token_ids) for r in results)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def completions(self, body: dict) -> dict:
        if "prompt" not in body:
            raise RequestError("'prompt' is required")
        params, n = self._sampling(body, self._stop_ids(chat=False))
        prompts = self._prompts(body["prompt"])
        results = self._generate([p for p in prompts for _ in range(n)], params)
        want_logprobs = body.get("logprobs") is not None
        choices = []
        for i, r in enumerate(results):
            choice = {"index": i, "text": r.text or "", "finish_reason": r.finish_reason, "logprobs": None}
            if want_logprobs:
                choice["logprobs"] = {"tokens": [self.tokenizer.decode([t]) for t in r.token_ids],
                                      "token_logprobs": r.logprobs}
            choice.update(self._extras(r))
            choices.append(choice)
        return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": self._usage(results)}

    def chat_completions(self, body: dict) -> dict:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError("'messages' must be a non-empty list of message objects")
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise RequestError("'tools' must be a list of function schemas "
                               "({\"type\": \"function\", \"function\": {...}})")
        params, n = self._sampling(body, self._stop_ids(chat=True))
        try:
            text = self.format.render(messages, tools=tools or None, add_generation_prompt=True)
            prompt = self.tokenizer.encode(text)
        except (ChatFormatError, KeyError, TypeError) as e:
            raise RequestError(f"bad 'messages': {e}") from None
        results = self._generate([prompt] * n, params)
        choices = []
        for i, r in enumerate(results):
            parsed = self.format.parse(self.tokenizer.decode(r.token_ids))
            ids = [(parsed.ids[j] if j < len(parsed.ids) and parsed.ids[j] else new_call_id())
                   for j in range(len(parsed.tool_calls))]
            tool_calls = [{"id": call_id, "type": "function",
                           "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                          for call_id, c in zip(ids, parsed.tool_calls)]
            message = {"role": "assistant", "content": parsed.content}
            if parsed.reasoning:
                message["reasoning_content"] = parsed.reasoning
            if tool_calls:
                message["tool_calls"] = tool_calls
            finish = "tool_calls" if tool_calls and r.finish_reason == "stop" else r.finish_reason
            choice = {"index": i, "message": message, "finish_reason": finish, "tool_call_errors": parsed.errors}
            if body.get("logprobs"):
                choice["logprobs"] = {"content": [{"token": self.tokenizer.decode([t]), "logprob": lp}
                                                  for t, lp in zip(r.token_ids, r.logprobs)]}
            choice.update(self._extras(r))
            choices.append(choice)
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": self._usage(results)}

    # ---- HTTP --------------------------------------------------------------------------------------
    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format, *args):  # keep test and server logs quiet
                pass

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _error(self, status: int, message: str) -> None:
                kind = "invalid_request_error" if status < 500 else "server_error"
                self._send(status, {"error": {"message": message, "type": kind, "code": status}})

            def do_GET(self):
                if self.path == "/health":
                    self._send(200, {"status": "ok", "weight_version": server.engine.weight_version})
                elif self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [
                        {"id": server.model_name, "object": "model", "created": 0, "owned_by": "megatron-composer"}]})
                else:
                    self._error(404, f"no route GET {self.path}; try /health or /v1/models")

            def do_POST(self):
                routes = {"/v1/completions": server.completions, "/v1/chat/completions": server.chat_completions}
                if self.path not in routes:
                    self._error(404, f"no route POST {self.path}; use /v1/completions or /v1/chat/completions")
                    return
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                    raw = self.rfile.read(length)
                    try:
                        body = json.loads(raw or b"null")
                    except (json.JSONDecodeError, UnicodeDecodeError) as e:
                        raise RequestError(f"request body is not valid JSON: {e}") from None
                    if not isinstance(body, dict):
                        raise RequestError("request body must be a JSON object")
                    self._send(200, routes[self.path](body))
                except RequestError as e:
                    self._error(e.status, str(e))
                except (EngineError, SamplingError, CacheError) as e:
                    self._error(400, str(e))
                except Exception as e:
                    self._error(500, f"{type(e).__name__}: {e}")

        return Handler


def serve(checkpoint: str, tokenizer: str | None = None, host: str = "127.0.0.1", port: int = 8000,
          model_name: str = "megatron-composer", chat_format: str = "auto", max_batch_size: int = 64,
          cache_memory_gb: float = 4.0, batch_invariant: bool = False, tp: int | None = None, ep: int = 1) -> None:
    """Serve a Hugging Face checkpoint until interrupted, on every rank of a torchrun launch (rank 0 answers HTTP,
    the others follow its engine steps). A layout or chat format that cannot serve raises ValueError."""
    import torch

    from megatron_composer.data.tokenizer import load_tokenizer
    from megatron_composer.training.core import local_device

    from .loading import HFWeights, engine_model, hf_config

    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = tp or max(world // ep, 1)
    if tp * ep != world:
        raise ValueError(f"--tp {tp} x --ep {ep} needs as many processes; launch with torchrun "
                         f"--nproc-per-node {tp * ep}")
    tok = load_tokenizer(tokenizer or checkpoint)
    try:
        fmt = load_chat_format(chat_format, tok)
    except ChatFormatError as e:
        raise ValueError(f"--chat-format: {e}") from None
    cfg, dtype = hf_config(checkpoint)
    tok.check_fits_model(cfg.vocab_size)
    groups = None
    if world > 1:
        from megatron_composer.parallel.dims import ParallelDims

        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        groups = ParallelDims(world, tp=tp, ep=ep).build()
    model = engine_model(cfg, HFWeights(checkpoint), groups, dtype=dtype, device=local_device(),
                         float32_router=True)
    engine = Engine(model, max_batch_size=max_batch_size, cache_memory_bytes=int(cache_memory_gb * 2**30),
                    batch_invariant=batch_invariant, detokenize=tok.decode)
    group = dist.group.WORLD if world > 1 else None  # every rank of the engine makes the same calls
    if world > 1 and dist.get_rank() != 0:
        follow(engine, group=group)
        return
    try:
        server = InferenceServer(engine, tok, model_name, host, port, group=group, chat_format=fmt)
    except BaseException:
        if world > 1:
            Lockstep(engine, group=group).stop()  # release the ranks already waiting in follow()
        raise
    where = f" (tensor-parallel over {world} ranks)" if world > 1 else ""
    print(f"serving {model_name} on {server.url}{where}", flush=True)
    server.serve_forever()
