"""LlamaIndex adapters: ``KilnLLM``, an LLM, and ``KilnEmbedding``, over ``kiln.Model``.

``chat`` and ``stream_chat`` send the messages to ``create_chat_completion``, so the model's
own chat template renders them (not LlamaIndex's generic ``messages_to_prompt``);
``complete`` continues raw text with ``create_completion``, after ``completion_to_prompt``
unless ``formatted=True``. ``is_chat_model`` is True, so LlamaIndex's query engines and
agents take the chat path.

    from kiln.llama_index import KilnLLM
    llm = KilnLLM(model_path="smollm2.kiln", temperature=0, max_tokens=64)
    print(llm.complete("The sky is").text)

This module needs ``llama-index-core``; ``import kiln`` does not.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

try:
    from llama_index.core.base.embeddings.base import BaseEmbedding
    from llama_index.core.base.llms.types import (
        ChatMessage,
        ChatResponse,
        ChatResponseGen,
        CompletionResponse,
        CompletionResponseGen,
        LLMMetadata,
        MessageRole,
    )
    from llama_index.core.constants import DEFAULT_NUM_OUTPUTS
    from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
    from llama_index.core.llms.custom import CustomLLM
    from pydantic import Field, PrivateAttr
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kiln.llama_index needs LlamaIndex: pip install llama-index-core"
    ) from e

from . import Model

__all__ = ["KilnLLM", "KilnEmbedding"]


def _open(
    model: Optional[Model], model_path: Optional[str], model_kwargs: Dict[str, Any]
) -> Model:
    """The model given, or the one at ``model_path`` opened with ``model_kwargs``: an
    adapter either shares a model already open (one engine, many adapters) or owns one."""
    if (model is None) == (model_path is None):
        raise ValueError("give either model (a kiln.Model) or model_path, not both")
    return model if model is not None else Model(model_path, **model_kwargs)


def _name(model: Model) -> str:
    """The file's stem, the name Kiln's responses carry."""
    return os.path.splitext(os.path.basename(model.path))[0]


def _text(choice: Dict[str, Any]) -> str:
    """A choice's text: a completion's ``text``, or a chat stream's or answer's content."""
    if "text" in choice:
        return choice["text"]
    return (choice.get("delta") or choice.get("message") or {}).get("content") or ""


class KilnLLM(CustomLLM):
    """A LlamaIndex LLM answered by a ``kiln.Model`` in this process.

    Give ``model`` (an open ``kiln.Model``, which may be shared) or ``model_path`` (opened
    with ``model_kwargs``, e.g. ``{"threads": 4}``). The generation fields left at None take
    the model's defaults; ``max_tokens`` is also the ``num_output`` LlamaIndex leaves room
    for in the context. A call's keyword arguments pass on as OpenAI fields.
    """

    model_path: Optional[str] = None
    model_kwargs: Dict[str, Any] = Field(default_factory=dict)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    max_tokens: int = Field(default=DEFAULT_NUM_OUTPUTS, gt=0)
    stop: Optional[Union[str, List[str]]] = None
    seed: Optional[int] = None

    _model: Model = PrivateAttr()

    def __init__(self, model: Optional[Model] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._model = _open(model, self.model_path, self.model_kwargs)

    @classmethod
    def class_name(cls) -> str:
        return "KilnLLM"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self._model.n_ctx,
            num_output=self.max_tokens,
            is_chat_model=True,
            model_name=_name(self._model),
        )

    def _fields(self, kwargs: Dict[str, Any]) -> Dict[str, Any]:
        fields = dict(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_tokens,
            stop=self.stop,
            seed=self.seed,
        )
        return {**fields, **kwargs}

    @llm_completion_callback()
    def complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        prompt = self._prompt(prompt, formatted)
        out = self._model.create_completion(prompt, **self._fields(kwargs))
        text = _text(out["choices"][0])
        return CompletionResponse(text=text, raw=out, additional_kwargs=out["usage"])

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        parts = self._model.create_completion(
            self._prompt(prompt, formatted), stream=True, **self._fields(kwargs)
        )
        text = ""
        for part, delta in _deltas(parts):
            text += delta
            yield CompletionResponse(text=text, delta=delta, raw=part)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        out = self._model.create_chat_completion(_messages(messages), **self._fields(kwargs))
        message = ChatMessage(role=MessageRole.ASSISTANT, content=_text(out["choices"][0]))
        return ChatResponse(message=message, raw=out, additional_kwargs=out["usage"])

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        parts = self._model.create_chat_completion(
            _messages(messages), stream=True, **self._fields(kwargs)
        )
        text = ""
        for part, delta in _deltas(parts):
            text += delta
            message = ChatMessage(role=MessageRole.ASSISTANT, content=text)
            yield ChatResponse(message=message, delta=delta, raw=part)

    def _prompt(self, prompt: str, formatted: bool) -> str:
        return prompt if formatted else self.completion_to_prompt(prompt)


def _messages(messages: Sequence[ChatMessage]) -> List[Dict[str, str]]:
    """OpenAI-style messages: LlamaIndex's roles are OpenAI's names."""
    return [{"role": m.role.value, "content": m.content or ""} for m in messages]


def _deltas(parts: Iterator[Dict[str, Any]]) -> Iterator[Tuple[Dict[str, Any], str]]:
    """The stream's chunks with text, each with its text (role-only and finishing chunks
    carry none)."""
    for part in parts:
        delta = _text(part["choices"][0]) if part["choices"] else ""
        if delta:
            yield part, delta


class KilnEmbedding(BaseEmbedding):
    """LlamaIndex embeddings from a Kiln embedding model: the vectors ``Model.embed`` gives
    (unit length). Give ``model`` or ``model_path`` plus ``model_kwargs``; ``truncate``
    cuts texts longer than the model takes instead of refusing them."""

    model_path: Optional[str] = None
    model_kwargs: Dict[str, Any] = Field(default_factory=dict)
    truncate: bool = False

    _model: Model = PrivateAttr()

    def __init__(self, model: Optional[Model] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._model = _open(model, self.model_path, self.model_kwargs)
        if self.model_name == "unknown":
            self.model_name = _name(self._model)

    @classmethod
    def class_name(cls) -> str:
        return "KilnEmbedding"

    def _get_query_embedding(self, query: str) -> List[float]:
        return self._get_text_embedding(query)

    async def _aget_query_embedding(self, query: str) -> List[float]:
        return self._get_text_embedding(query)

    def _get_text_embedding(self, text: str) -> List[float]:
        return self._model.embed(text, truncate=self.truncate).tolist()

    def _get_text_embeddings(self, texts: List[str]) -> List[List[float]]:
        """A batch (``embed_batch_size`` texts) in one call."""
        return self._model.embed(texts, truncate=self.truncate).tolist()
