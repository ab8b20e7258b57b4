#!/usr/bin/env python3
"""Write a Hugging Face checkpoint with random weights at a real model's shape.

Why: no trained decoder larger than 135M parameters ships on the package registries Kiln can
reach, yet speed and memory have to be judged at the sizes people run (1B to 8B). A checkpoint
with the exact tensor shapes, dtypes and file layout of Llama-3.2-1B, Llama-3.2-3B or
Llama-3.1-8B costs the same to convert, quantize, load and run as the real one, so it measures
speed and memory. It measures nothing else: its text is noise, and its perplexity, KL-divergence
or layer-by-layer figures mean nothing.

The directory holds what `kiln-convert hf` reads: config.json (the real model's, with the
vocabulary cut to the tokenizer's), SmolLM2's tokenizer files (tokenizer.json,
tokenizer_config.json, special_tokens_map.json, taken from a SmolLM2 checkpoint directory), and
bf16 safetensors split into shards of at most 5 GB with a model.safetensors.index.json, as
transformers' save_pretrained writes them.

Weights are normal with standard deviation 0.02 (transformers' initializer_range), norms are
ones; a fixed seed makes the files reproducible. Only numpy is needed, and memory stays near
one 64 MiB chunk whatever the model size.

    python benches/random_checkpoint.py --shape llama-3.2-1b \
        --tokenizer target/models/smollm2-bf16 --out target/models/random-1b
"""

import argparse
import json
import os
import shutil
import struct
import sys

import numpy as np

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# The published configurations (hidden sizes, layers, heads, RoPE), vocab set from the tokenizer.
SHAPES = {
    "llama-3.2-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling=dict(LLAMA3_ROPE, factor=32.0), max_position_embeddings=131072,
    ),
    "llama-3.2-3b": dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
        num_attention_heads=24, num_key_value_heads=8, head_dim=128,
        tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling=dict(LLAMA3_ROPE, factor=32.0), max_position_embeddings=131072,
    ),
    "llama-3.1-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling=dict(LLAMA3_ROPE, factor=8.0), max_position_embeddings=131072,
    ),
}

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
SHARD_BYTES = 5 * 10**9
CHUNK = 1 << 25  # values generated at a time (128 MiB of float32)


def tensors(cfg):
    """(name, shape) in transformers' order for LlamaForCausalLM."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", (cfg["vocab_size"], h))]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out += [
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (cfg["vocab_size"], h)))
    return out


def bf16_bits(x):
    """float32 → bfloat16 bit patterns, rounded to nearest even (as torch rounds)."""
    u = x.view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_shard(path, names, shapes, rng):
    header, offset = {}, 0
    for name in names:
        n = int(np.prod(shapes[name]))
        header[name] = {"dtype": "BF16", "shape": list(shapes[name]),
                        "data_offsets": [offset, offset + 2 * n]}
        offset += 2 * n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in names:
            n = int(np.prod(shapes[name]))
            norm = len(shapes[name]) == 1
            for start in range(0, n, CHUNK):
                m = min(CHUNK, n - start)
                x = (np.ones(m, np.float32) if norm
                     else rng.standard_normal(m, dtype=np.float32) * np.float32(0.02))
                f.write(bf16_bits(x).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return offset


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--tokenizer", required=True,
                    help="a directory with SmolLM2's tokenizer files (e.g. target/models/smollm2-bf16)")
    ap.add_argument("--out", required=True, help="directory to write (must not exist, or be empty)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    if os.path.exists(args.out) and os.listdir(args.out):
        sys.exit(f"error: {args.out} exists and is not empty")
    for f in TOKENIZER_FILES:
        if not os.path.isfile(os.path.join(args.tokenizer, f)):
            sys.exit(f"error: {args.tokenizer}: no {f}")
    with open(os.path.join(args.tokenizer, "tokenizer.json")) as f:
        tok = json.load(f)
    ids = list(tok["model"]["vocab"].values()) + [t["id"] for t in tok.get("added_tokens", [])]
    vocab = max(ids) + 1
    with open(os.path.join(args.tokenizer, "tokenizer_config.json")) as f:
        tcfg = json.load(f)
    vocab_ids = dict(tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok.get("added_tokens", [])})
    bos = vocab_ids.get(tcfg.get("bos_token"))
    eos = vocab_ids.get(tcfg.get("eos_token"))

    cfg = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
        attention_bias=False, attention_dropout=0.0, mlp_bias=False, rms_norm_eps=1e-5,
        initializer_range=0.02, torch_dtype="bfloat16", use_cache=True,
        vocab_size=vocab, bos_token_id=bos, eos_token_id=eos,
        **SHAPES[args.shape],
    )
    os.makedirs(args.out, exist_ok=True)
    for f in TOKENIZER_FILES:
        shutil.copy(os.path.join(args.tokenizer, f), os.path.join(args.out, f))
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)

    specs = tensors(cfg)
    shapes = dict(specs)
    shards, cur, size = [], [], 0
    for name, shape in specs:
        b = 2 * int(np.prod(shape))
        if cur and size + b > SHARD_BYTES:
            shards.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += b
    shards.append(cur)

    rng = np.random.default_rng(args.seed)
    total, weight_map = 0, {}
    for k, names in enumerate(shards):
        fname = (f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                 if len(shards) > 1 else "model.safetensors")
        total += write_shard(os.path.join(args.out, fname), names, shapes, rng)
        weight_map.update({n: fname for n in names})
        print(f"wrote {fname} ({len(names)} tensors)", file=sys.stderr)
    if len(shards) > 1:
        with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    params = total // 2
    print(f"{args.out}: {args.shape}, {params / 1e9:.2f} B parameters, {total / 1e9:.2f} GB bf16 "
          f"in {len(shards)} shard(s), vocab {vocab}; random weights: for speed and memory only",
          file=sys.stderr)


if __name__ == "__main__":
    main()
