"""OpenAI-compatible server on localhost, driven with plain HTTP: completions, chat with a tool call in the
project's format, the extra RL fields, concurrency, and 4xx answers to bad requests."""

import json
import threading
import urllib.error
import urllib.request

import pytest
import torch

from megatron_composer.data.chat_template import IM_END, IM_START, TOOL_CALL_END, TOOL_CALL_START
from megatron_composer.data.tokenizer import load_tokenizer
from megatron_composer.inference import Engine
from megatron_composer.inference.server import InferenceServer

TOOL_JSON = '{"name": "ls", "arguments": {"path": "."}}'


pytestmark = pytest.mark.usefixtures("one_thread")


def _tokenizer(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", IM_START, IM_END, TOOL_CALL_START, TOOL_CALL_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["user assistant system tool list the files hello world"] * 10, trainer)
    tok.add_tokens([TOOL_JSON])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return load_tokenizer(tmp_path)


def _scripted_model(tok):
    """Logits depend on the current token only; the head maps 'assistant\\n' -> <tool_call> -> tool JSON ->
    </tool_call> -> <|im_end|> (a real model, scripted weights: tests/chat_assets.scripted_model)."""
    from tests.chat_assets import scripted_model

    newline = tok.encode("assistant\n")[-1]
    script = [newline, tok.token_to_id(TOOL_CALL_START), tok._tok.token_to_id(TOOL_JSON),
              tok.token_to_id(TOOL_CALL_END), tok.token_to_id(IM_END)]
    return scripted_model(tok.vocab_size, script, 5.0), script


@pytest.fixture
def served(tmp_path):
    tok = _tokenizer(tmp_path)
    model, script = _scripted_model(tok)
    server = InferenceServer(Engine(model, max_batch_size=8, cache_memory_bytes=8 << 20), tok, "tiny").start()
    yield server, tok, model, script
    server.stop()


def _call(server, path, body=None, raw=None):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_health_models_and_completions(served):
    server, tok, model, _ = served
    assert _call(server, "/health") == (200, {"status": "ok", "weight_version": 0})
    status, models = _call(server, "/v1/models")
    assert status == 200 and models["data"][0]["id"] == "tiny"
    prompt = "hello world"
    status, out = _call(server, "/v1/completions",
                        {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1})
    assert status == 200, out
    choice = out["choices"][0]
    want = Engine(model).generate([tok.encode(prompt)], max_new_tokens=6, stop_token_ids=[tok.eod])[0]
    assert choice["token_ids"] == want.token_ids
    assert choice["text"] == tok.decode(want.token_ids)
    assert choice["token_logprobs"] == pytest.approx(want.logprobs, abs=1e-5)
    assert choice["logprobs"]["token_logprobs"] == choice["token_logprobs"]
    assert choice["weight_versions"] == [0] * len(want.token_ids)
    T = len(want.token_ids)
    assert torch.tensor(choice["routed_experts"]).shape == (T, len(model.moe_layers), model.config.num_experts_per_tok)
    assert out["usage"]["completion_tokens"] == T


def test_chat_tool_call_roundtrip_and_concurrency(served):
    server, _, _, script = served
    body = {"messages": [{"role": "system", "content": "You run tools."},
                         {"role": "user", "content": "list the files"}],
            "max_tokens": 10, "temperature": 0}
    results = [None] * 4

    def ask(i):
        results[i] = _call(server, "/v1/chat/completions", body)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for status, out in results:
        assert status == 200, out
        choice = out["choices"][0]
        assert choice["token_ids"] == script[1:]  # stops at <|im_end|>
        assert choice["finish_reason"] == "tool_calls"
        call = choice["message"]["tool_calls"][0]["function"]
        assert call["name"] == "ls" and json.loads(call["arguments"]) == {"path": "."}
        assert choice["message"]["content"] == "" and choice["tool_call_errors"] == []


@pytest.mark.parametrize("path,body,status,needle", [
    ("/v1/completions", {"max_tokens": 3}, 400, "'prompt' is required"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "'temperature'"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "'max_tokens'"),
    ("/v1/completions", {"prompt": [1, 10 ** 6]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "stream": True}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "not served"),
    ("/v1/completions", {"prompt": "hi", "speculative": True}, 400, "MTP"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "'messages'"),
    ("/v1/embeddings", {"input": "x"}, 404, "no route"),
])
def test_bad_requests_get_4xx_and_server_survives(served, path, body, status, needle):
    server = served[0]
    got, out = _call(server, path, body)
    assert got == status and needle in out["error"]["message"], out
    got, out = _call(server, "/v1/completions", raw=b"{not json")
    assert got == 400 and "JSON" in out["error"]["message"]
    assert _call(server, "/health")[0] == 200


def test_chat_in_the_models_own_format(tmp_path):
    """A checkpoint with Kimi K2.5's template: the request's messages and tools render with it (prompt_token_ids),
    and the model's Kimi-format reply comes back as reasoning_content and tool_calls with the model's own ids."""
    from megatron_composer.data.chat_format import load_chat_format
    from tests.chat_assets import KIMI_ARGS, KIMI_REASONING, kimi_scripted_model, kimi_tokenizer

    tok = kimi_tokenizer(tmp_path)
    fmt = load_chat_format("auto", tok)
    model, turn_ids = kimi_scripted_model(tok)
    server = InferenceServer(Engine(model, max_batch_size=4, cache_memory_bytes=8 << 20), tok, "kimi").start()
    try:
        tools = [{"type": "function",
                  "function": {"name": "edit_file", "parameters": {"type": "object", "properties": {}}}}]
        messages = [{"role": "user", "content": "Make hello.py say goodbye."}]
        status, out = _call(server, "/v1/chat/completions", {"messages": messages, "tools": tools, "max_tokens": 20,
                                                              "temperature": 0})
        assert status == 200, out
        choice = out["choices"][0]
        assert choice["prompt_token_ids"] == tok.encode(fmt.render(messages, tools=tools, add_generation_prompt=True))
        assert choice["token_ids"] == turn_ids  # stops at (and includes) Kimi's <|im_end|>
        message = choice["message"]
        assert message["reasoning_content"] == KIMI_REASONING and message["content"] == ""
        (call,) = message["tool_calls"]
        assert call["id"] == "functions.edit_file:0" and call["function"]["name"] == "edit_file"
        assert json.loads(call["function"]["arguments"]) == json.loads(KIMI_ARGS)
        assert choice["finish_reason"] == "tool_calls"
        status, out = _call(server, "/v1/chat/completions", {"messages": messages, "tools": "edit_file"})
        assert status == 400 and "'tools'" in out["error"]["message"]
    finally:
        server.stop()


def test_the_command_line_serves_a_hugging_face_checkpoint(tmp_path):
    """tools/serve.py: a saved checkpoint with its tokenizer answers /health and a completion over HTTP; a
    layout the launch cannot hold is a one-line error with status 2."""
    import subprocess
    import sys
    from pathlib import Path

    from megatron_composer.checkpoint.hf import save_hf_checkpoint
    from megatron_composer.model import Transformer, get_preset

    serve = Path(__file__).resolve().parents[3] / "tools" / "serve.py"
    (tmp_path / "tok").mkdir()
    tok = _tokenizer(tmp_path / "tok")
    torch.manual_seed(0)
    mc = get_preset("tiny-deepseek-v3").replace(num_layers=2, vocab_size=tok.vocab_size, num_mtp_layers=0)
    save_hf_checkpoint(Transformer(mc), tmp_path / "hf", progress=False)
    bad = subprocess.run([sys.executable, str(serve), "--checkpoint", str(tmp_path / "hf"), "--tp", "2"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "--nproc-per-node 2" in bad.stderr
    proc = subprocess.Popen([sys.executable, str(serve), "--checkpoint", str(tmp_path / "hf"), "--tokenizer",
                             str(tmp_path / "tok"), "--port", "0", "--cache-memory-gb", "0.01"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving megatron-composer on http://"), (line, proc.stderr.read())
        url = line.split(" on ")[1].split()[0]
        with urllib.request.urlopen(url + "/health", timeout=60) as r:
            assert r.status == 200
        body = json.dumps({"prompt": "hello world", "max_tokens": 3, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            choice = json.loads(r.read())["choices"][0]
        assert len(choice["token_ids"]) == 3
    finally:
        proc.terminate()
        proc.wait(timeout=60)
