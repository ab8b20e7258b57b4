"""The LangChain and LlamaIndex adapters, used as their users would: at temperature 0 each
gives the text of the direct ``kiln.Model`` call for the same request, and the embeddings
are ``Model.embed``'s vectors.

The models are conftest's (SmolLM2-135M-Instruct and all-MiniLM-L6-v2 at Q4_0); a test is
skipped when its framework (langchain-core, llama-index-core) is not installed.
"""

import numpy as np
import pytest

MAX_TOKENS = 12


def _direct(model, messages):
    """The text the direct call gives: the reference each adapter must match."""
    out = model.create_chat_completion(messages, temperature=0, max_tokens=MAX_TOKENS)
    return out["choices"][0]["message"]["content"]


TEXTS = ["Kiln runs models on the CPU.", "The cat sat on the mat."]


# -- LangChain -----------------------------------------------------------------------------


def test_langchain_chain_matches_direct_call(chat_model):
    pytest.importorskip("langchain_core")
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate

    from kiln.langchain import ChatKiln

    prompt = ChatPromptTemplate.from_messages(
        [("system", "You answer in one short sentence."), ("human", "What is {thing}?")]
    )
    chat = ChatKiln(chat_model, temperature=0, max_tokens=MAX_TOKENS)
    chain = prompt | chat | StrOutputParser()
    expected = _direct(
        chat_model,
        [
            {"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": "What is a kiln?"},
        ],
    )
    assert expected
    assert chain.invoke({"thing": "a kiln"}) == expected
    assert "".join(chain.stream({"thing": "a kiln"})) == expected


def test_langchain_message_carries_usage(chat_model):
    pytest.importorskip("langchain_core")
    from kiln.langchain import ChatKiln

    chat = ChatKiln(chat_model, temperature=0, max_tokens=MAX_TOKENS)
    message = chat.invoke("Hi")
    assert message.content == _direct(chat_model, [{"role": "user", "content": "Hi"}])
    usage = message.usage_metadata
    assert usage["output_tokens"] <= MAX_TOKENS
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]

    streamed = None
    for chunk in chat.stream("Hi"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.content == message.content
    assert streamed.usage_metadata == usage
    finish = message.response_metadata["finish_reason"]
    assert streamed.response_metadata["finish_reason"] == finish


def test_langchain_embeddings_are_model_embed(embed_model):
    pytest.importorskip("langchain_core")
    from kiln.langchain import KilnEmbeddings

    embeddings = KilnEmbeddings(embed_model)
    docs = embeddings.embed_documents(TEXTS)
    assert np.array_equal(np.array(docs, dtype=np.float32), embed_model.embed(TEXTS))
    query = embeddings.embed_query(TEXTS[0])
    assert np.array_equal(np.array(query, dtype=np.float32), embed_model.embed(TEXTS[0]))
    assert embeddings.embed_documents([]) == []


def test_langchain_needs_one_model():
    pytest.importorskip("langchain_core")
    from kiln.langchain import ChatKiln

    with pytest.raises(ValueError, match="model_path"):
        ChatKiln()


# -- LlamaIndex ----------------------------------------------------------------------------


def test_llama_index_complete_matches_direct_call(chat_model):
    pytest.importorskip("llama_index.core")
    from kiln.llama_index import KilnLLM

    llm = KilnLLM(chat_model, temperature=0, max_tokens=MAX_TOKENS)
    assert llm.metadata.context_window == chat_model.n_ctx
    assert llm.metadata.is_chat_model

    out = chat_model.create_completion("The sky is", temperature=0, max_tokens=MAX_TOKENS)
    completion = llm.complete("The sky is")
    assert completion.text == out["choices"][0]["text"]
    assert "".join(r.delta for r in llm.stream_complete("The sky is")) == completion.text


def test_llama_index_chat_matches_direct_call(chat_model):
    pytest.importorskip("llama_index.core")
    from llama_index.core.llms import ChatMessage

    from kiln.llama_index import KilnLLM

    llm = KilnLLM(chat_model, temperature=0, max_tokens=MAX_TOKENS)
    messages = [
        ChatMessage(role="system", content="You answer in one short sentence."),
        ChatMessage(role="user", content="What is a kiln?"),
    ]
    expected = _direct(
        chat_model, [{"role": m.role.value, "content": m.content} for m in messages]
    )
    assert llm.chat(messages).message.content == expected
    *_, last = llm.stream_chat(messages)
    assert last.message.content == expected


def test_llama_index_embedding_is_model_embed(embed_model):
    pytest.importorskip("llama_index.core")
    from kiln.llama_index import KilnEmbedding

    embedding = KilnEmbedding(embed_model)
    docs = embedding.get_text_embedding_batch(TEXTS)
    assert np.array_equal(np.array(docs, dtype=np.float32), embed_model.embed(TEXTS))
    query = embedding.get_query_embedding(TEXTS[0])
    assert np.array_equal(np.array(query, dtype=np.float32), embed_model.embed(TEXTS[0]))
