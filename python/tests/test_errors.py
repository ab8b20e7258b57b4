"""Errors from Python: each an exception carrying the message the command line prints, and the
model still usable after a refused request."""

from __future__ import annotations

import shutil

import pytest

import kiln
from conftest import model_path, run_cli

PREFIX = "kiln-run: error: "


def cli_error(*args: str) -> str:
    out = run_cli("kiln-run", *args, check=False)
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith(PREFIX), line
    return line[len(PREFIX):]


def test_a_missing_file_is_the_command_lines_error(tmp_path):
    missing = tmp_path / "missing.kiln"
    expected = cli_error("generate", str(missing), "-p", "hi")
    with pytest.raises(kiln.KilnError) as e:
        kiln.Model(missing)
    assert str(e.value) == expected


def test_a_corrupted_tensor_is_named_as_the_command_line_names_it(tmp_path):
    bad = tmp_path / "bad.kiln"
    shutil.copy(model_path("minilm-q4_0.kiln"), bad)
    with open(bad, "r+b") as f:
        f.seek(-1000, 2)
        byte = f.read(1)
        f.seek(-1000, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    expected = cli_error("embed", str(bad), "-p", "hi")
    assert "checksum mismatch" in expected
    with pytest.raises(kiln.KilnError) as e:
        kiln.Model(bad)
    assert str(e.value) == expected
    # verify=False skips the scan, as --no-verify does.
    kiln.Model(bad, verify=False).close()


def test_bad_arguments_are_refused_naming_them(chat_model):
    messages = [{"role": "user", "content": "hi"}]
    cases = [
        (dict(temperature=5), "temperature"),
        (dict(top_logprobs=3), "top_logprobs"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(response_format={"type": "json_schema", "json_schema": {"schema": 3}}),
         "response_format.json_schema.schema"),
        (dict(frobnicate=1), "frobnicate"),
    ]
    for kwargs, param in cases:
        with pytest.raises(kiln.InvalidRequestError) as e:
            chat_model.create_chat_completion(messages, **kwargs)
        assert e.value.param == param, (kwargs, str(e.value))
        assert e.value.status == 400
        assert param.split(".")[0] in str(e.value)
    with pytest.raises(kiln.InvalidRequestError) as e:
        chat_model.create_chat_completion([{"role": "wizard", "content": "hi"}])
    assert "wizard" in str(e.value)
    with pytest.raises(kiln.InvalidRequestError):
        chat_model.detokenize([chat_model.n_vocab])
    with pytest.raises(kiln.InvalidRequestError):
        chat_model.embed("a text")
    with pytest.raises(ValueError):
        kiln.Model(chat_model.path, threads=0)
    with pytest.raises(ValueError):
        kiln.Model(chat_model.path, cache_type="f8")
    # Still serving.
    out = chat_model.create_completion("hello", max_tokens=2, temperature=0)
    assert out["usage"]["completion_tokens"] == 2


def test_a_prompt_longer_than_the_context_is_refused(tmp_path):
    with kiln.Model(model_path("smollm2-q4_0.kiln"), threads=2, n_ctx=64) as m:
        with pytest.raises(kiln.InvalidRequestError) as e:
            m.create_completion("word " * 200, max_tokens=4)
        assert e.value.param == "prompt"
        assert "context" in str(e.value)


def test_embedding_errors(embed_model):
    with pytest.raises(kiln.InvalidRequestError) as e:
        embed_model.embed("word " * 1000, truncate=False)
    assert e.value.param == "input[0]"
    with pytest.raises(kiln.InvalidRequestError) as e:
        embed_model.embed([])
    with pytest.raises(kiln.InvalidRequestError) as e:
        embed_model.create_completion("hi")
    assert "embedding model" in str(e.value)
