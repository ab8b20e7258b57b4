"""LangChain adapters: ``ChatKiln``, a chat model, and ``KilnEmbeddings``, over ``kiln.Model``.

They are thin on purpose: a request becomes one ``create_chat_completion`` or ``embed`` call,
so the model's own chat template, its generation defaults and Kiln's validation
(``InvalidRequestError`` naming the parameter) apply unchanged, and a chain's output at
temperature 0 is the text the direct call gives.

    from kiln.langchain import ChatKiln
    chat = ChatKiln(model_path="smollm2.kiln", temperature=0, max_tokens=64)
    print(chat.invoke("Name a colour.").content)

This module needs ``langchain-core``; ``import kiln`` does not.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterator, List, Optional, Union

try:
    from langchain_core.callbacks import CallbackManagerForLLMRun
    from langchain_core.embeddings import Embeddings
    from langchain_core.language_models.chat_models import BaseChatModel
    from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
    from langchain_core.messages.ai import UsageMetadata
    from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
    from pydantic import Field, PrivateAttr
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kiln.langchain needs LangChain: pip install langchain-core"
    ) from e

from . import Model

__all__ = ["ChatKiln", "KilnEmbeddings"]

# LangChain's message types and the OpenAI roles the chat template knows them by.
_ROLES = {"system": "system", "human": "user", "ai": "assistant"}


def _open(
    model: Optional[Model], model_path: Optional[str], model_kwargs: Dict[str, Any]
) -> Model:
    """The model given, or the one at ``model_path`` opened with ``model_kwargs``: an
    adapter either shares a model already open (one engine, many adapters) or owns one."""
    if (model is None) == (model_path is None):
        raise ValueError("give either model (a kiln.Model) or model_path, not both")
    return model if model is not None else Model(model_path, **model_kwargs)


def _message(message: BaseMessage) -> Dict[str, str]:
    """An OpenAI-style message; a ``ChatMessage`` keeps its own role. ``text`` joins a
    content list's text blocks: a property from langchain-core 1.0, a method before."""
    role = message.role if message.type == "chat" else _ROLES.get(message.type)
    if role is None:
        raise ValueError(f"ChatKiln does not take {message.type!r} messages")
    text = message.text
    return {"role": role, "content": text if isinstance(text, str) else text()}


def _usage(usage: Dict[str, int]) -> UsageMetadata:
    """The response's ``usage`` in LangChain's names, for callbacks and cost tracking."""
    return UsageMetadata(
        input_tokens=usage["prompt_tokens"],
        output_tokens=usage["completion_tokens"],
        total_tokens=usage["total_tokens"],
    )


class ChatKiln(BaseChatModel):
    """A LangChain chat model answered by a ``kiln.Model`` in this process.

    Give ``model`` (an open ``kiln.Model``, which may be shared) or ``model_path`` (opened
    with ``model_kwargs``, e.g. ``{"threads": 4}``). The generation fields left at None take
    the model's defaults; a call's ``stop`` replaces ``stop``, and further keyword arguments
    of a call (or of ``.bind(...)``) pass to ``create_chat_completion`` as OpenAI fields,
    e.g. ``response_format``.
    """

    model_path: Optional[str] = None
    model_kwargs: Dict[str, Any] = Field(default_factory=dict)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    max_tokens: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    seed: Optional[int] = None

    _model: Model = PrivateAttr()

    def __init__(self, model: Optional[Model] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._model = _open(model, self.model_path, self.model_kwargs)

    @property
    def _llm_type(self) -> str:
        return "kiln"

    @property
    def _identifying_params(self) -> Dict[str, Any]:
        """What decides the output, for LangChain's caching and tracing."""
        return {"model_path": self._model.path, **self._fields()}

    def _fields(self) -> Dict[str, Any]:
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_tokens": self.max_tokens,
            "stop": self.stop,
            "seed": self.seed,
        }

    def _request(
        self, messages: List[BaseMessage], stop: Optional[List[str]], kwargs: Dict[str, Any]
    ) -> Dict[str, Any]:
        fields = {**self._fields(), **kwargs, "messages": [_message(m) for m in messages]}
        if stop is not None:
            fields["stop"] = stop
        return fields

    def _generate(
        self,
        messages: List[BaseMessage],
        stop: Optional[List[str]] = None,
        run_manager: Optional[CallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> ChatResult:
        out = self._model.create_chat_completion(**self._request(messages, stop, kwargs))
        choice = out["choices"][0]
        meta = {"model_name": out["model"], "finish_reason": choice["finish_reason"]}
        message = AIMessage(
            content=choice["message"]["content"] or "",
            usage_metadata=_usage(out["usage"]),
            response_metadata=meta,
        )
        return ChatResult(
            generations=[ChatGeneration(message=message, generation_info=meta)],
            llm_output={"token_usage": out["usage"], "model_name": out["model"]},
        )

    def _stream(
        self,
        messages: List[BaseMessage],
        stop: Optional[List[str]] = None,
        run_manager: Optional[CallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        """One chunk per content delta; the finish reason and the usage (asked for with
        ``include_usage``) come as chunks without text, which LangChain merges in."""
        fields = self._request(messages, stop, kwargs)
        fields.update(stream=True, stream_options={"include_usage": True})
        for part in self._model.create_chat_completion(**fields):
            chunk = _chunk(part)
            if chunk is None:
                continue
            if run_manager and chunk.text:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk


def _chunk(part: Dict[str, Any]) -> Optional[ChatGenerationChunk]:
    """A stream's ``chat.completion.chunk`` as LangChain's chunk; None for one carrying
    nothing (the opening role-only delta)."""
    if part["usage"] is not None:
        message = AIMessageChunk(content="", usage_metadata=_usage(part["usage"]))
        return ChatGenerationChunk(message=message)
    choice = part["choices"][0]
    text = choice["delta"].get("content") or ""
    if not text and choice["finish_reason"] is None:
        return None
    meta = {"finish_reason": choice["finish_reason"]} if choice["finish_reason"] else {}
    message = AIMessageChunk(content=text, response_metadata=meta)
    return ChatGenerationChunk(message=message, generation_info=meta or None)


class KilnEmbeddings(Embeddings):
    """LangChain embeddings from a Kiln embedding model: the vectors ``Model.embed`` gives
    (unit length), as lists of floats.

    Give ``model`` (an open ``kiln.Model``) or ``model_path`` plus ``kiln.Model``'s keyword
    arguments. ``truncate`` cuts texts longer than the model takes instead of refusing
    them, which suits documents split without counting tokens.
    """

    def __init__(
        self,
        model: Optional[Model] = None,
        model_path: Optional[Union[str, "os.PathLike[str]"]] = None,
        *,
        truncate: bool = False,
        **model_kwargs: Any,
    ) -> None:
        self.model = _open(model, model_path, model_kwargs)
        self.truncate = truncate

    def embed_documents(self, texts: List[str]) -> List[List[float]]:
        """One vector per text, in one batch. An empty list gives an empty list (vector
        stores ask with one), where ``Model.embed`` would refuse it."""
        if not texts:
            return []
        return self.model.embed(list(texts), truncate=self.truncate).tolist()

    def embed_query(self, text: str) -> List[float]:
        return self.model.embed(text, truncate=self.truncate).tolist()
