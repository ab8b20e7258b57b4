"""Kiln from Python: generate, chat, embed, convert, quantize and verify ``.kiln`` models
in-process, on the same engine ``kiln-run`` drives.

``Model`` takes the shapes of llama-cpp-python's ``Llama`` and OpenAI's API: a request's
keyword arguments are the OpenAI request's fields, validated and answered by the same code as
``kiln-run serve``'s endpoints, so what is accepted, refused (``InvalidRequestError`` naming
the parameter) and returned is what the server does.

    import kiln
    llm = kiln.Model("smollm2.kiln")
    out = llm.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=32)
    print(out["choices"][0]["message"]["content"])
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

from . import _kiln
from ._kiln import InvalidRequestError, KilnError, __version__, convert, log_to_stderr, quantize

__all__ = [
    "Model",
    "KilnError",
    "InvalidRequestError",
    "convert",
    "quantize",
    "verify",
    "log_to_stderr",
    "__version__",
]

PathLike = Union[str, "os.PathLike[str]"]
Message = Dict[str, Any]


def _body(fields: Dict[str, Any]) -> bytes:
    """The request's JSON: the fields given, leaving out those left at None (the model's
    defaults then apply, as for a server request that omits them)."""
    return json.dumps({k: v for k, v in fields.items() if v is not None}).encode()


def _fields(args: Dict[str, Any]) -> Dict[str, Any]:
    """A request method's arguments (its ``locals()``) as the request's fields, ``extra``
    merged in; ``stream=False`` left out, as a server request leaves it."""
    fields = {k: v for k, v in args.items() if k not in ("self", "extra")}
    fields.update(args.get("extra") or {})
    fields["stream"] = fields.get("stream") or None
    return fields


def _answers(request: Any) -> Iterator[Dict[str, Any]]:
    for text in request:
        yield json.loads(text)


class Model:
    """A ``.kiln`` model, opened and verified (checksums and NaN scan) as ``kiln-run`` does.

    ``n_ctx``: context length in tokens (default: the model's, at most 4096);
    ``threads``: compute threads (default: the physical cores); ``n_batch``: prompt tokens per
    forward pass; ``n_parallel``: requests decoded together, from any number of Python
    threads; ``draft``: a smaller ``.kiln`` model with the same vocabulary guessing tokens
    for this one to check (output unchanged); ``lookup``: tokens guessed from the prompt
    itself; ``cache_type``: the KV cache's storage (``f16``, ``f32``, ``q8_0``);
    ``cache_mb``: memory for finished conversations kept for reuse; ``verify``: check the
    file's checksums and scan it for NaNs on open.

    Raises ``KilnError`` with the message ``kiln-run`` prints when the file cannot be
    opened, verified or loaded.
    """

    def __init__(
        self,
        path: PathLike,
        *,
        n_ctx: Optional[int] = None,
        threads: Optional[int] = None,
        n_batch: int = 512,
        n_parallel: int = 4,
        draft: Optional[PathLike] = None,
        lookup: int = 0,
        cache_type: str = "f16",
        cache_mb: int = 256,
        verify: bool = True,
    ) -> None:
        self._model = _kiln.Model(
            os.fspath(path),
            n_ctx=n_ctx,
            threads=threads,
            n_batch=n_batch,
            n_parallel=n_parallel,
            draft=None if draft is None else os.fspath(draft),
            lookup=lookup,
            cache_type=cache_type,
            cache_mb=cache_mb,
            verify=verify,
        )

    # -- what the model is -------------------------------------------------------------

    @property
    def path(self) -> str:
        """The file the model came from."""
        return os.fspath(self._model.path)

    @property
    def n_ctx(self) -> int:
        """Context length in tokens, prompt and output together (0 for an embedding model)."""
        return self._model.n_ctx

    @property
    def n_vocab(self) -> int:
        """Vocabulary size: token ids are below it."""
        return self._model.n_vocab

    @property
    def n_embd(self) -> int:
        """The width of an embedding model's vectors (0 for a generative model)."""
        return self._model.n_embd

    @property
    def metadata(self) -> Dict[str, Any]:
        """The file's metadata: family, tokenizer, generation defaults, provenance."""
        return json.loads(self._model.metadata_json)

    def health(self) -> Dict[str, Any]:
        """The engine's counters, as ``/health`` reports them."""
        text = self._model._health()
        return json.loads(text) if text else {"status": "ok"}

    # -- text --------------------------------------------------------------------------

    def tokenize(self, text: Union[str, bytes], add_special: bool = True) -> List[int]:
        """Token ids of ``text``; ``add_special`` adds the tokenizer's own special tokens."""
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return self._model.tokenize(text, add_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens``, special tokens left out."""
        return self._model.detokenize(list(tokens))

    # -- generation --------------------------------------------------------------------

    def create_chat_completion(
        self,
        messages: List[Message],
        *,
        temperature: Optional[float] = None,
        top_p: Optional[float] = None,
        top_k: Optional[int] = None,
        min_p: Optional[float] = None,
        max_tokens: Optional[int] = None,
        stream: bool = False,
        stop: Optional[Union[str, List[str]]] = None,
        seed: Optional[int] = None,
        response_format: Optional[Dict[str, Any]] = None,
        presence_penalty: Optional[float] = None,
        frequency_penalty: Optional[float] = None,
        repeat_penalty: Optional[float] = None,
        logprobs: Optional[bool] = None,
        top_logprobs: Optional[int] = None,
        stream_options: Optional[Dict[str, Any]] = None,
        tools: Optional[List[Dict[str, Any]]] = None,
        tool_choice: Optional[Any] = None,
        **extra: Any,
    ) -> Union[Dict[str, Any], Iterator[Dict[str, Any]]]:
        """A chat completion, rendered with the model's own chat template: an OpenAI
        ``chat.completion`` dict, or with ``stream=True`` an iterator of
        ``chat.completion.chunk`` dicts. Parameters left at None take the model's defaults
        (its generation config: greedy unless it samples). ``response_format`` with a JSON
        schema constrains the output to it. Further OpenAI fields pass through ``extra``;
        one Kiln does not support raises ``InvalidRequestError`` naming it.

        Ctrl-C (or dropping a stream's iterator) cancels the generation.
        """
        return self._generate("chat", _fields(locals()), stream)

    def create_completion(
        self,
        prompt: Union[str, List[int]],
        *,
        temperature: Optional[float] = None,
        top_p: Optional[float] = None,
        top_k: Optional[int] = None,
        min_p: Optional[float] = None,
        max_tokens: Optional[int] = 16,
        stream: bool = False,
        stop: Optional[Union[str, List[str]]] = None,
        seed: Optional[int] = None,
        response_format: Optional[Dict[str, Any]] = None,
        presence_penalty: Optional[float] = None,
        frequency_penalty: Optional[float] = None,
        repeat_penalty: Optional[float] = None,
        logprobs: Optional[int] = None,
        stream_options: Optional[Dict[str, Any]] = None,
        **extra: Any,
    ) -> Union[Dict[str, Any], Iterator[Dict[str, Any]]]:
        """A plain completion of ``prompt`` (text, or token ids): an OpenAI
        ``text_completion`` dict, or an iterator of them with ``stream=True``. ``max_tokens``
        defaults to 16 as OpenAI's and llama-cpp-python's do; None runs to the end of the
        context or a stop token. ``logprobs=k`` reports each token's log-probability and the
        ``k`` most likely alternatives."""
        return self._generate("completion", _fields(locals()), stream)

    __call__ = create_completion

    def _generate(
        self, kind: str, fields: Dict[str, Any], stream: bool
    ) -> Union[Dict[str, Any], Iterator[Dict[str, Any]]]:
        request = self._model._request(kind, _body(fields))
        if stream:
            return _answers(request)
        return json.loads(next(iter(request)))

    # -- embeddings --------------------------------------------------------------------

    def embed(
        self,
        input: Union[str, Sequence[str]],
        *,
        normalize: bool = True,
        truncate: bool = True,
        prompt_name: Optional[str] = None,
    ) -> Any:
        """Embed ``input`` with an embedding model: a float32 NumPy array, ``(dim,)`` for one
        text and ``(n, dim)`` for a list; the vectors ``kiln-run embed`` gives. Unit length
        unless ``normalize=False``; ``truncate`` cuts texts longer than the model takes, as
        ``kiln-run embed`` and sentence-transformers do (``False``: they are refused, naming
        the input); ``prompt_name`` picks one of the
        model's named prompts, as sentence-transformers' does."""
        if not isinstance(input, str):
            input = list(input)
        return self._model.embed(
            input, normalize=normalize, truncate=truncate, prompt_name=prompt_name
        )

    def close(self) -> None:
        """Stop the model's engine now (it also stops when the object is collected)."""
        self._model.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"kiln.Model({self.path!r})"


from . import verify  # noqa: E402  (the submodule, after the names it may import)
