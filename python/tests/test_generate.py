"""Generation from Python: the same tokens, log-probabilities and answers as the command line
and `kiln-run serve`, streamed and whole, constrained by a JSON schema, from two threads, and
interrupted by Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import urllib.request

import pytest

import kiln
from conftest import THREADS, binary, model_path, run_cli

PROMPT = "The three primary colors are"
QUESTION = "What is the capital of France? Answer in one sentence."


def cli_generate(model, *args):
    out = run_cli(
        "kiln-run", "generate", str(model), "--temp", "0", "-t", str(THREADS), "--json", *args
    )
    return json.loads(out.stdout)


def token_texts(model: kiln.Model, ids):
    return [model.detokenize([i]) for i in ids]


def test_greedy_completion_is_the_command_lines(chat_model):
    cli = cli_generate(chat_model.path, "-p", PROMPT, "-n", "24", "--ctx", "1024")
    out = chat_model.create_completion(PROMPT, max_tokens=24, temperature=0, logprobs=0)
    choice = out["choices"][0]
    assert choice["text"] == cli["text"]
    assert choice["logprobs"]["tokens"] == token_texts(chat_model, cli["tokens"])
    assert out["usage"]["completion_tokens"] == cli["generated_tokens"]
    assert out["usage"]["prompt_tokens"] == cli["prompt_tokens"]


def test_greedy_chat_is_the_command_lines(chat_model):
    cli = cli_generate(chat_model.path, "-p", QUESTION, "--chat", "-n", "32", "--ctx", "1024")
    out = chat_model.create_chat_completion(
        [{"role": "user", "content": QUESTION}], max_tokens=32, temperature=0
    )
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"]["content"] == cli["text"]
    assert out["choices"][0]["finish_reason"] == ("length" if cli["stop"] == "length" else "stop")


@pytest.mark.parametrize("fixture", ["llama-tied-f32", "qwen3-f32", "gemma3-f32"])
def test_tiny_families_match_the_command_line(fixture, tmp_path):
    path = model_path(f"tiny-{fixture}.kiln")
    cli = cli_generate(path, "-p", "hello world", "-n", "12")
    with kiln.Model(path, threads=THREADS) as m:
        out = m.create_completion("hello world", max_tokens=12, temperature=0, logprobs=0)
        assert out["choices"][0]["logprobs"]["tokens"] == token_texts(m, cli["tokens"])


def serve(model, *args):
    exe = binary("kiln-run")
    proc = subprocess.Popen(
        [str(exe), "serve", str(model), "--port", "0", "-t", str(THREADS), *args],
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stderr:
        found = re.search(r"listening on (http://\S+)", line)
        if found:
            return proc, found.group(1)
    proc.kill()
    raise AssertionError("kiln-run serve did not start")


def post(url, body):
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_logprobs_are_the_servers_bits(chat_model):
    proc, base = serve(chat_model.path, "--ctx", "1024")
    try:
        request = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 3}
        served = post(base + "/v1/completions", request)
        chat = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 12,
                "temperature": 0, "logprobs": True, "top_logprobs": 2}
        served_chat = post(base + "/v1/chat/completions", chat)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    ours = chat_model.create_completion(PROMPT, max_tokens=12, temperature=0, logprobs=3)
    assert ours["choices"] == served["choices"]
    assert ours["usage"] == served["usage"]
    ours_chat = chat_model.create_chat_completion(
        chat["messages"], max_tokens=12, temperature=0, logprobs=True, top_logprobs=2
    )
    assert ours_chat["choices"] == served_chat["choices"]


def test_a_stream_adds_up_to_the_whole_answer(chat_model):
    messages = [{"role": "user", "content": QUESTION}]
    whole = chat_model.create_chat_completion(messages, max_tokens=24, temperature=0)
    chunks = list(
        chat_model.create_chat_completion(
            messages, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["usage"] == whole["usage"]
    parts = list(chat_model.create_completion(PROMPT, max_tokens=10, temperature=0, stream=True))
    assert "".join(p["choices"][0]["text"] for p in parts) == chat_model.create_completion(
        PROMPT, max_tokens=10, temperature=0
    )["choices"][0]["text"]


def test_a_json_schema_constrains_the_output(chat_model):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "is_capital": {"type": "boolean"},
        },
        "required": ["city", "is_capital"],
        "additionalProperties": False,
    }
    out = chat_model.create_chat_completion(
        [{"role": "user", "content": "Name a large city, and say whether it is a capital."}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    value = json.loads(out["choices"][0]["message"]["content"])
    assert set(value) == {"city", "is_capital"}
    assert isinstance(value["city"], str) and isinstance(value["is_capital"], bool)


def test_two_threads_on_one_model_answer_as_each_alone(chat_model):
    prompts = [PROMPT, "A good breakfast is"]
    alone = [
        chat_model.create_completion(p, max_tokens=16, temperature=0)["choices"][0]["text"]
        for p in prompts
    ]
    together = [None, None]

    def work(i):
        out = chat_model.create_completion(prompts[i], max_tokens=16, temperature=0)
        together[i] = out["choices"][0]["text"]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert together == alone


def test_ctrl_c_interrupts_a_generation_and_frees_its_sequence(chat_model):
    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        chat_model.create_completion(PROMPT, max_tokens=900, temperature=0, ignore_eos=True)
    timer.cancel()
    for _ in range(100):
        if chat_model.health()["active"] == 0:
            break
        threading.Event().wait(0.05)
    assert chat_model.health()["active"] == 0
    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        for _ in chat_model.create_completion(
            PROMPT, max_tokens=900, temperature=0, ignore_eos=True, stream=True
        ):
            pass
    timer.cancel()
    # The model goes on serving.
    out = chat_model.create_completion(PROMPT, max_tokens=4, temperature=0)
    assert out["usage"]["completion_tokens"] == 4


def test_speculative_decoding_leaves_the_output_unchanged(chat_model):
    plain = chat_model.create_completion(PROMPT, max_tokens=24, temperature=0, logprobs=0)
    path = chat_model.path
    with kiln.Model(path, threads=THREADS, n_ctx=1024, lookup=4) as lookup:
        guessed = lookup.create_completion(PROMPT, max_tokens=24, temperature=0, logprobs=0)
    with kiln.Model(path, threads=THREADS, n_ctx=1024, draft=path) as drafted:
        drafted_out = drafted.create_completion(PROMPT, max_tokens=24, temperature=0, logprobs=0)
    for out in (guessed, drafted_out):
        assert out["choices"][0]["text"] == plain["choices"][0]["text"]
        assert out["choices"][0]["logprobs"]["tokens"] == plain["choices"][0]["logprobs"]["tokens"]


def test_several_models_at_once_from_several_threads(chat_model):
    tiny = model_path("tiny-qwen3-f32.kiln")
    results = {}

    def work(name, model, prompt):
        results[name] = model.create_completion(prompt, max_tokens=8, temperature=0)

    with kiln.Model(tiny, threads=1) as other:
        alone = other.create_completion("hello world", max_tokens=8, temperature=0)
        threads = [
            threading.Thread(target=work, args=("big", chat_model, PROMPT)),
            threading.Thread(target=work, args=("tiny", other, "hello world")),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert results["tiny"]["choices"][0]["text"] == alone["choices"][0]["text"]
    assert results["big"]["usage"]["completion_tokens"] == 8
