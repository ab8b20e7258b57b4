"""Embeddings from Python: the bits `kiln-run embed` writes, one text or many, alone or in a
batch, normalised or not."""

from __future__ import annotations

import numpy as np

from conftest import ROOT, THREADS, run_cli

TEXTS = [
    "A man is eating food.",
    "A man is riding a horse.",
    "",
    "The quick brown fox jumps over the lazy dog. " * 40,  # past the model's 256 tokens: cut
    "Ünïcödé, emoji 🙂 and CJK 漢字 together.",
]


def cli_vectors(model, tmp_path, *args):
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    out = tmp_path / "vectors.npy"
    run_cli(
        "kiln-run", "embed", str(model), "-f", str(texts), "--format", "npy", "-o", str(out),
        "-t", str(THREADS), "--force", *args,
    )
    return np.load(out)


def test_vectors_are_the_command_lines_bits(embed_model, tmp_path):
    ours = embed_model.embed(TEXTS)
    assert ours.dtype == np.float32 and ours.shape == (len(TEXTS), embed_model.n_embd)
    np.testing.assert_array_equal(ours, cli_vectors(embed_model.path, tmp_path))
    raw = embed_model.embed(TEXTS, normalize=False)
    np.testing.assert_array_equal(raw, cli_vectors(embed_model.path, tmp_path, "--no-normalize"))


def test_a_text_alone_is_its_row_in_a_batch(embed_model):
    batch = embed_model.embed(TEXTS)
    for i, text in enumerate(TEXTS):
        one = embed_model.embed(text)
        assert one.shape == (embed_model.n_embd,)
        np.testing.assert_array_equal(one, batch[i])


def test_many_texts_past_one_turns_token_limit(embed_model):
    corpus = (ROOT / "fixtures" / "text").glob("*.txt")
    lines = [l for p in sorted(corpus) for l in p.read_text(encoding="utf-8").splitlines() if l]
    texts = (lines * 4)[:1200]
    vectors = embed_model.embed(texts)
    assert vectors.shape == (len(texts), embed_model.n_embd)
    np.testing.assert_array_equal(vectors[:50], embed_model.embed(texts[:50]))
    norms = np.linalg.norm(vectors, axis=1)
    assert np.allclose(norms, 1.0, atol=1e-5)
