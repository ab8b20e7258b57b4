"""Check `kiln-run embed` against sentence-transformers' vectors (see ci/embeddings.sh)."""

import argparse
import json
import os
import subprocess
import sys

import numpy as np


def embed(binary, model, texts, *extra):
    args = [binary, "embed", model, "-t", "2", *extra]
    for t in texts:
        args += ["-p", t]
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    return [json.loads(line) for line in out.stdout.splitlines()]


def llama_embedding(binary, gguf, texts):
    """llama.cpp's `llama-embedding` on `texts` (one run, the texts joined by a separator),
    as JSON rows. It prints through llama.cpp's asynchronous logger, whose last lines are
    sometimes lost at exit: it runs again until the JSON is whole."""
    sep = "<#sep#>"
    for _ in range(20):
        out = subprocess.run([binary, "-m", gguf, "-p", sep.join(texts), "--embd-separator", sep,
                              "--embd-output-format", "json", "-t", "2", "-c", "4096",
                              "-b", "4096", "-ub", "4096"], capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{binary} failed:\n{out.stderr[-2000:]}")
        try:
            return json.loads(out.stdout)["data"]
        except json.JSONDecodeError:
            continue
    sys.exit(f"{binary}: no whole output in 20 runs")


def cosines(ref, got):
    a = np.array([r["embedding"] for r in ref], dtype=np.float64)
    b = np.array([g["embedding"] for g in got], dtype=np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def ranking(rows, queries, documents):
    e = np.array([rows[i]["embedding"] for i in range(len(rows))], dtype=np.float64)
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    return [list(np.argsort(-(e[documents] @ e[q]))) for q in queries]


def check_one(binary, model, reference, query_prompt, least_cosine=0.99999):
    """One model against its reference: cosine ≥ `least_cosine` (a zero vector only where the
    reference's is zero), the same token counts, a text the same bits alone and in a batch,
    and the model's `query` prompt (`query_prompt`) put before the text. Returns the
    failures."""
    ref = json.load(open(reference))
    rows = ref["rows"]
    texts = [r["text"] for r in rows]
    got = embed(binary, model, texts)
    failures = []
    least = 1.0
    for r, g in zip(rows, got):
        a = np.array(r["embedding"], np.float64)
        b = np.array(g["embedding"], np.float64)
        na, nb = np.linalg.norm(a), np.linalg.norm(b)
        if na == 0 or nb == 0:
            ok = na == nb
            cos = 1.0 if ok else 0.0
        else:
            cos = float(a @ b / na / nb)
        least = min(least, cos)
        if cos < least_cosine:
            failures.append(f"{model}: {r['text'][:40]!r} cosine {cos:.7f}")
        if len(r["ids"]) != g["tokens"]:
            failures.append(f"{model}: {r['text'][:40]!r} has {g['tokens']} tokens, "
                            f"sentence-transformers {len(r['ids'])}")
    print(f"{os.path.basename(model)}: least cosine to sentence-transformers {least:.7f} "
          f"over {len(rows)} texts, token counts {'equal' if not failures else 'checked'}")
    alone = [embed(binary, model, [t])[0]["embedding"] for t in texts[:4]]
    if alone != [g["embedding"] for g in got[:4]]:
        failures.append(f"{model}: a text's vector differs alone and in a batch")
    prompted = embed(binary, model, texts[:2], "--prompt-name", "query")
    prefix = embed(binary, model, [query_prompt + t for t in texts[:2]])
    if [p["embedding"] for p in prompted] != [p["embedding"] for p in prefix]:
        failures.append(f"{model}: --prompt-name query is not its prompt before the text")
    return failures


# Qwen3-Embedding's `query` prompt (fixtures/embedding/make_qwen3_embedding.py).
PROMPT_QUERY = ("Instruct: Given a web search query, retrieve relevant passages that answer the "
                "query\nQuery:")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--dir")
    ap.add_argument("--reference", required=True)
    ap.add_argument("--model", help="check only this F32 model against --reference")
    ap.add_argument("--same-as", help="with --model: embed --reference's texts with both and "
                    "require identical output")
    ap.add_argument("--least-cosine", type=float, default=0.99999,
                    help="the --model's least cosine to the reference (F32: 0.99999)")
    ap.add_argument("--query-prompt", default=PROMPT_QUERY,
                    help="the --model's `query` prompt (default: Qwen3-Embedding's)")
    ap.add_argument("--llama-embedding", metavar="BIN",
                    help="check llama.cpp's llama-embedding on --gguf against --reference "
                    "instead (not in CI: llama.cpp is built by hand)")
    ap.add_argument("--gguf", help="the GGUF file --llama-embedding runs")
    a = ap.parse_args()
    if a.llama_embedding:
        # The reference's texts llama-embedding takes as they are: not the empty one, and not
        # one past the model's max_seq_length (llama.cpp does not cut to it).
        ref = json.load(open(a.reference))
        rows = [r for r in ref["rows"]
                if r["text"].strip() and len(r["ids"]) < ref["max_seq_length"]]
        got = llama_embedding(a.llama_embedding, a.gguf, [r["text"] for r in rows])
        c = cosines(rows, got)
        print(f"llama-embedding on {os.path.basename(a.gguf)}: least cosine to "
              f"sentence-transformers {c.min():.7f}, mean {c.mean():.7f} over {len(rows)} texts")
        if c.min() < a.least_cosine:
            sys.exit(1)
        return
    if a.model and a.same_as:
        # Two files of the same weights (a GGUF round trip): the same token counts and bits.
        texts = [r["text"] for r in json.load(open(a.reference))["rows"]]
        got, want = embed(a.bin, a.model, texts), embed(a.bin, a.same_as, texts)
        if got != want:
            print(f"FAILED: {a.model} embeds differently from {a.same_as}")
            sys.exit(1)
        print(f"{os.path.basename(a.model)}: the same vectors and token counts as "
              f"{os.path.basename(a.same_as)} over {len(texts)} texts")
        return
    if a.model:
        failures = check_one(a.bin, a.model, a.reference, a.query_prompt, a.least_cosine)
        if failures:
            print("FAILED:\n  " + "\n  ".join(failures))
            sys.exit(1)
        print("embeddings: all checks passed")
        return
    ref = json.load(open(a.reference))
    rows = ref["rows"]
    texts = [r["text"] for r in rows]
    failures = []
    results = {}
    # (least cosine, mean cosine) each file must reach. Q8_0's least is the empty text's
    # ([CLS][SEP] alone), 0.998 when measured; every other text is above 0.999.
    # Q4_0 (reference rounding, and calibrated on fixtures/text/calibration.txt) is reported.
    files = [("f32", (0.99999, 0.99999)), ("q8_0", (0.998, 0.9995)), ("q4_0", None),
             ("q4_0-cal", None)]
    for name, floor in files:
        got = embed(a.bin, os.path.join(a.dir, f"minilm-{name}.kiln"), texts)
        cos = cosines(rows, got)
        results[name] = got
        worst = int(np.argmin(cos))
        print(f"{name}: cosine to sentence-transformers min {cos.min():.7f} mean {cos.mean():.7f} "
              f"(worst: {texts[worst][:40]!r})")
        if floor is not None and (cos.min() < floor[0] or cos.mean() < floor[1]):
            failures.append(f"{name}: cosine min {cos.min():.7f} mean {cos.mean():.7f}, "
                            f"below {floor} (worst {texts[worst][:40]!r})")
        nonempty = [c for c, t in zip(cos, texts) if t]
        print(f"{name}: least over non-empty texts {min(nonempty):.7f}")
        for r, g in zip(rows, got):
            if len(r["ids"]) != g["tokens"]:
                failures.append(f"{name}: {r['text'][:40]!r} has {g['tokens']} tokens, "
                                f"sentence-transformers {len(r['ids'])}")
    truncated = [g["truncated"] for g in results["f32"]]
    if truncated.count(True) != 1 or not results["f32"][texts.index(max(texts, key=len))]["truncated"]:
        failures.append(f"only the long text should be cut to max_seq_length: {truncated}")
    # Retrieval order of the query/document set, Q4_0 against F32 and the reference.
    q, d = ref["queries"], ref["documents"]
    want = ranking(rows, q, d)
    for name, _ in files:
        order = ranking(results[name], q, d)
        same = sum(o[0] == w[0] for o, w in zip(order, want))
        print(f"{name}: top document right for {same}/{len(q)} queries; "
              f"full order identical: {order == want}")
        if same != len(q):
            failures.append(f"{name}: retrieval's top document differs from sentence-transformers'")
    # A text's vector is the same bits alone, in a batch of mixed lengths, and with 1-token passes.
    f32 = os.path.join(a.dir, "minilm-f32.kiln")
    alone = [embed(a.bin, f32, [t])[0]["embedding"] for t in texts[:6]]
    batched = results["f32"][:6]
    tiny = embed(a.bin, f32, texts, "-b", "1")
    if any(x != y["embedding"] for x, y in zip(alone, batched)):
        failures.append("a text's vector differs alone and in a batch")
    if [t["embedding"] for t in tiny] != [g["embedding"] for g in results["f32"]]:
        failures.append("vectors differ between one text per pass and full passes")
    # .npy holds the same float32 values as the JSON lines.
    npy = os.path.join(a.dir, "vectors.npy")
    lines = os.path.join(a.dir, "texts.txt")
    simple = [t for t in texts if "\n" not in t]
    with open(lines, "w") as f:
        f.write("\n".join(simple) + "\n")
    subprocess.run([a.bin, "embed", f32, "-f", lines, "--format", "npy", "-o", npy, "--force"],
                   check=True, capture_output=True)
    arr = np.load(npy)
    want_npy = np.array([results["f32"][texts.index(t)]["embedding"] for t in simple], np.float32)
    if arr.shape != want_npy.shape or not np.array_equal(arr, want_npy):
        failures.append(f".npy {arr.shape} differs from the JSON lines {want_npy.shape}")
    # Through GGUF and back: the same vectors (Kiln's GGUF keeps the embedding settings).
    for name in ["f32", "q8_0"]:
        back = embed(a.bin, os.path.join(a.dir, f"minilm-{name}-from-gguf.kiln"), texts)
        if [b["embedding"] for b in back] != [g["embedding"] for g in results[name]]:
            failures.append(f"{name}: the file imported back from its GGUF embeds differently")
        else:
            print(f"{name}: GGUF export and import give the same vectors")
    # Options and bad input.
    raw = embed(a.bin, f32, texts[:3], "--no-normalize", "--pooling", "cls")
    if abs(np.linalg.norm(raw[0]["embedding"]) - 1) < 1e-3:
        failures.append("--no-normalize still normalised")
    for args, needle in [
        (["--truncate", "0"], "--truncate"),
        (["--truncate", "100000"], "--truncate"),
        (["--prompt-name", "nope"], "--prompt-name"),
        (["--format", "npy"], "-o"),
        (["--pooling", "max"], "max"),
    ]:
        p = subprocess.run([a.bin, "embed", f32, "-p", "x", *args], capture_output=True, text=True)
        if p.returncode != 2 or needle not in p.stderr:
            failures.append(f"{args}: exit {p.returncode}, stderr {p.stderr.strip()[:200]!r}")
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("embeddings: all checks passed")


if __name__ == "__main__":
    main()
