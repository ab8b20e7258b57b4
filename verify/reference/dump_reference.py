#!/usr/bin/env python3
"""Write the reference dumps `kiln-verify layers` compares a Kiln file with.

Runs a Hugging Face checkpoint with transformers (float32 compute, eager attention, eval, no
grad), records the output of every decoder layer, of each layer's sub-modules (norms,
projections, MLP) and the logits with forward hooks (for an embedding model: the token states
and the sentence-transformers vector, `sentence_embedding`), and writes one safetensors file per prompt:
`OUT/0.safetensors`, `OUT/1.safetensors`, ... (plain prompts first, then chats). Every family
Kiln runs is covered: Llama (SmolLM, TinyLlama), Mistral, Qwen2, Qwen3, Gemma 3 (text), Phi-3,
GLM-4 and GLM; fused projections (Phi-3, GLM) are saved split under the unfused names, and
per-head q/k norms flattened to [T, heads*head_dim], so every site lines up with Kiln's.

Install once (pinned versions; PyPI's Linux torch wheel carries CUDA libraries, about 5.5 GB
installed, and runs on the CPU as it is):

    python3.11 -m venv .venv-reference
    .venv-reference/bin/pip install -r verify/reference/requirements.txt

Then:

    .venv-reference/bin/python verify/reference/dump_reference.py --model ./my-model \
        --out ref/ --prompt "The capital of France is" --chat "Write a haiku about rust."

    # prompts from files: --prompts has one prompt per line; --chats has one JSON value per
    # line, either a string (one user message) or a list of {"role": ..., "content": ...}
    # messages, rendered with the checkpoint's own chat template
    .venv-reference/bin/python verify/reference/dump_reference.py --model ./my-model \
        --out ref/ --prompts prompts.txt --chats chats.jsonl --detail-layers 0,1,-1

An existing non-empty --out is replaced only with --force; the dumps are written to a
temporary directory beside it and renamed into place when all are done. Exit status 0 on
success, 2 on bad input (the message names the file, line or option).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

GREEDY_TOKENS = 8

# Sub-modules of a decoder layer whose outputs are recorded (relative to model.layers.N).
# Llama, Mistral and Qwen2 (and any other model_type not listed in LAYER_PARTS_BY_TYPE):
LAYER_PARTS = [
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "post_attention_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp",
]
# Per config.model_type. q_norm/k_norm are the per-head RMSNorms (weight [head_dim]) applied to
# the q_proj/k_proj outputs before rope.
LAYER_PARTS_BY_TYPE = {
    "qwen3": LAYER_PARTS[:4] + ["self_attn.q_norm", "self_attn.k_norm"] + LAYER_PARTS[4:],
    # Gemma 3: "sandwich" norms. post_attention_layernorm normalises the o_proj output (before
    # the residual add, not after it as in Llama); pre_feedforward_layernorm is the MLP's input
    # norm; post_feedforward_layernorm normalises the mlp output before its residual add.
    "gemma3_text": [
        "input_layernorm",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.q_norm",
        "self_attn.k_norm",
        "self_attn.o_proj",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "post_feedforward_layernorm",
        "mlp",
    ],
    # Phi-3: fused projections, dumped split (see SPLITS).
    "phi3": [
        "input_layernorm",
        "self_attn.qkv_proj",
        "self_attn.o_proj",
        "post_attention_layernorm",
        "mlp.gate_up_proj",
        "mlp",
    ],
    # GLM-4: post_self_attn_layernorm normalises the o_proj output and post_mlp_layernorm the mlp
    # output, each before its residual add; post_attention_layernorm is the pre-MLP norm.
    "glm4": [
        "input_layernorm",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "post_self_attn_layernorm",
        "post_attention_layernorm",
        "mlp.gate_up_proj",
        "post_mlp_layernorm",
        "mlp",
    ],
    "glm": LAYER_PARTS[:6] + ["mlp.gate_up_proj", "mlp"],
}
# Fused projections are saved split, under the names of the unfused modules, cut as the
# model's own forward cuts them: Phi3Attention takes q = qkv[..., :heads*head_dim], then k and v
# (kv_heads*head_dim each); Phi3MLP/Glm4MLP/GlmMLP take gate, up = gate_up.chunk(2, dim=-1).
SPLITS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# The q_norm/k_norm modules see one row per head, not per token: their raw outputs are
# [1, T, heads, head_dim] in Qwen3 (normed before the transpose) and [1, heads, T, head_dim] in
# Gemma 3 (normed after it). Both are saved as [T, heads*head_dim], head-major like q_proj's
# output (row t = concat over heads h of the normed head vector), so they line up with the
# q_proj/k_proj dumps.
HEAD_NORM_LAYOUT = {"qwen3": "thd", "gemma3_text": "htd"}
HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm")

# The Hugging Face classes Kiln converts (converter/src/hf_config.rs); anything else is refused
# before torch is loaded. The bare backbones and `BertModel` are embedding models (with a
# sentence-transformers modules.json, or BERT's own mean pooling).
SUPPORTED_CLASSES = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                     "Qwen3ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
                     "Glm4ForCausalLM", "GlmForCausalLM", "BertModel", "Qwen3Model",
                     "Gemma3TextModel", "LlamaModel", "Qwen2Model"]

# A BERT layer's sub-modules whose outputs are recorded (relative to encoder.layer.N): the
# projections with their biases, the attention block's output (LayerNorm after its residual
# add), the intermediate dense layer and its GELU, and the output dense layer.
BERT_PARTS = [
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.output.dense",
    "attention.output",
    "intermediate.dense",
    "intermediate",
    "output.dense",
]
ROLES = ("system", "user", "assistant")


class BadInput(Exception):
    """Input the user must fix: the message names the file, line or option (exit 2)."""


def first(x):
    """Decoder layers may return a tuple (hidden_states, ...); take the tensor."""
    return x[0] if isinstance(x, (tuple, list)) else x


def layer_parts(model_type: str) -> list[str]:
    return LAYER_PARTS_BY_TYPE.get(model_type, LAYER_PARTS)


def split_fused(fused: str, x, cfg):
    """A fused projection's output [T, rows] cut into its parts as the model's forward does."""
    if fused == "self_attn.qkv_proj":
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        if x.shape[-1] != q + 2 * kv:
            raise BadInput(f"qkv_proj output {tuple(x.shape)}, want {q + 2 * kv} columns")
        return x[:, :q], x[:, q:q + kv], x[:, q + kv:]
    if fused == "mlp.gate_up_proj":
        return x.chunk(2, dim=-1)
    raise BadInput(f"no split known for {fused}")


def flatten_heads(x, layout: str, n_tokens: int):
    """[T, heads, head_dim] ("thd") or [heads, T, head_dim] ("htd") -> [T, heads*head_dim]."""
    if x.ndim != 3:
        raise BadInput(f"per-head norm output has shape {tuple(x.shape)}, want 3 dims")
    if layout == "htd":
        x = x.transpose(0, 1)
    if x.shape[0] != n_tokens:
        raise BadInput(f"per-head norm output {tuple(x.shape)} ({layout}) has no {n_tokens} tokens")
    return x.reshape(n_tokens, -1).contiguous()


def greedy_ids(model, ids, mask, n: int):
    import torch

    out, past, cur = [], None, ids
    with torch.no_grad():
        for _ in range(n):
            o = model(input_ids=cur, attention_mask=mask, past_key_values=past, use_cache=True)
            nxt = o.logits[0, -1].argmax()
            out.append(int(nxt))
            past, cur = o.past_key_values, nxt.view(1, 1)
            mask = torch.cat([mask, torch.ones((1, 1), dtype=mask.dtype)], dim=1)
    return torch.tensor(out, dtype=torch.int64)


def dump_embedder(model_dir: Path, out_dir: Path, texts: list[str],
                  detail_layers: list[int] | None, source_name: str | None = None):
    """An embedding model: every layer's (and the detail layers' sub-modules') outputs for each
    text, as the bare backbone computes them on sentence-transformers' tokens, and the text's
    vector as sentence-transformers' `encode` gives it (`sentence_embedding`). A bare decoder
    backbone's module paths are saved with the `model.` prefix its causal class has, so that
    they line up with Kiln's names."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModel

    torch.manual_seed(0)
    st = None
    if (model_dir / "modules.json").is_file():
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(model_dir), device="cpu")
    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32,
                                      attn_implementation="eager").eval()
    cfg = model.config
    bert = cfg.model_type == "bert"
    n_layers = cfg.num_hidden_layers
    detail = list(range(n_layers)) if detail_layers is None else sorted(set(detail_layers))
    detail = sorted({i + n_layers if i < 0 else i for i in detail})
    if any(i < 0 or i >= n_layers for i in detail):
        raise BadInput(f"--detail-layers: layers are 0..{n_layers - 1} (or -1 for the last)")
    if bert:
        wanted = {"embeddings": "embeddings.output"}
        for n in range(n_layers):
            wanted[f"encoder.layer.{n}"] = f"encoder.layer.{n}.output"
            if n in detail:
                for part in BERT_PARTS:
                    wanted[f"encoder.layer.{n}.{part}"] = f"encoder.layer.{n}.{part}.output"
        head_norm_names, head_norm_layout = set(), None
    else:
        parts = layer_parts(cfg.model_type)
        head_norm_layout = HEAD_NORM_LAYOUT.get(cfg.model_type)
        wanted = {"embed_tokens": "model.embed_tokens.output", "norm": "model.norm.output"}
        head_norm_names = set()
        for n in range(n_layers):
            wanted[f"layers.{n}"] = f"model.layers.{n}.output"
            if n in detail:
                for part in parts:
                    wanted[f"layers.{n}.{part}"] = f"model.layers.{n}.{part}.output"
                    if part in HEAD_NORMS:
                        head_norm_names.add(f"model.layers.{n}.{part}.output")
    modules = dict(model.named_modules())
    missing = [m for m in wanted if m not in modules]
    if missing:
        raise BadInput(f"{model_dir}: modules not found: {missing[:5]}")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    tmp.chmod(0o755)
    try:
        for k, text in enumerate(texts):
            if st is not None:
                ids = getattr(st, "preprocess", st.tokenize)([text])["input_ids"]
            else:
                ids = transformers.AutoTokenizer.from_pretrained(str(model_dir))(
                    text, return_tensors="pt", truncation=True)["input_ids"]
            captured: dict[str, "torch.Tensor"] = {}

            def hook(name):
                def fn(_module, _inputs, output):
                    captured[name] = first(output).detach()[0].to(torch.float32).contiguous()
                return fn

            handles = [modules[m].register_forward_hook(hook(t)) for m, t in wanted.items()]
            try:
                with torch.no_grad():
                    model(input_ids=ids, attention_mask=torch.ones_like(ids))
            finally:
                for h in handles:
                    h.remove()
            tensors = {"input_ids": ids[0].to(torch.int64).contiguous()}
            for name in wanted.values():
                tensors[name] = captured[name]
                if name in head_norm_names:
                    tensors[name] = flatten_heads(captured[name], head_norm_layout, ids.shape[1])
            if st is not None:
                with torch.no_grad():
                    vec = st.encode([text], convert_to_tensor=True, batch_size=1)[0]
                tensors["sentence_embedding"] = vec.to(torch.float32).cpu().contiguous()
            meta = {
                "prompt": text,
                "model": source_name or model_dir.name,
                "architecture": ",".join(cfg.architectures or []),
                "dtype": "float32",
                "attn_implementation": "eager",
                "transformers_version": transformers.__version__,
                "torch_version": torch.__version__,
                "n_tokens": str(ids.shape[1]),
                "detail_layers": ",".join(map(str, detail)),
            }
            save_file(tensors, str(tmp / f"{k}.safetensors"), metadata=meta)
            (tmp / f"{k}.safetensors").chmod(0o644)
            print(f"{source_name or model_dir.name}/{k}: {ids.shape[1]} tokens, "
                  f"{len(tensors)} tensors")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def is_embedder(model_dir: Path, cls: str) -> bool:
    """`BertModel`, a bare backbone, or a sentence-transformers directory."""
    return cls == "BertModel" or cls.endswith("Model") or (model_dir / "modules.json").is_file()


def dump_model(model_dir: Path, out_dir: Path, prompts: list[str], chats: list,
               system: str | None, detail_layers: list[int] | None, source_name: str | None = None,
               extra_prompts: list[str] = ()):
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    cfg = model.config
    raw_cfg = json.loads((model_dir / "config.json").read_text())
    ckpt_dtype = str(raw_cfg.get("dtype") or raw_cfg.get("torch_dtype"))  # as stored, before the f32 load
    n_layers = cfg.num_hidden_layers
    detail = list(range(n_layers)) if detail_layers is None else sorted(set(detail_layers))
    detail = sorted({i + n_layers if i < 0 else i for i in detail})
    if any(i < 0 or i >= n_layers for i in detail):
        raise BadInput(f"--detail-layers: layers are 0..{n_layers - 1} (or -1 for the last)")

    texts = list(prompts)
    for c in chats:
        msgs = [{"role": "user", "content": c}] if isinstance(c, str) else list(c)
        if system is not None and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": system})
        # A conversation that ends with the assistant's turn is dumped as it stands; otherwise
        # the template's generation prompt follows, as a chat front end sends it.
        texts.append(tok.apply_chat_template(msgs, tokenize=False,
                                             add_generation_prompt=msgs[-1]["role"] != "assistant"))
    texts.extend(extra_prompts)

    # module name -> recorded tensor name
    parts = layer_parts(cfg.model_type)
    head_norm_layout = HEAD_NORM_LAYOUT.get(cfg.model_type)
    if any(p in HEAD_NORMS for p in parts) and head_norm_layout is None:
        raise BadInput(f"no q_norm/k_norm layout known for {cfg.model_type}")
    wanted = {"model.embed_tokens": "model.embed_tokens.output", "model.norm": "model.norm.output"}
    head_norm_names = set()
    for n in range(n_layers):
        wanted[f"model.layers.{n}"] = f"model.layers.{n}.output"
        if n in detail:
            for part in parts:
                wanted[f"model.layers.{n}.{part}"] = f"model.layers.{n}.{part}.output"
                if part in HEAD_NORMS:
                    head_norm_names.add(f"model.layers.{n}.{part}.output")
    modules = dict(model.named_modules())
    missing = [m for m in wanted if m not in modules]
    if missing:
        raise BadInput(f"{model_dir}: modules not found: {missing[:5]}")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    tmp.chmod(0o755)
    try:
        for k, text in enumerate(texts):
            enc = tok(text, return_tensors="pt")
            ids = enc["input_ids"]
            captured: dict[str, "torch.Tensor"] = {}

            def hook(name):
                def fn(_module, _inputs, output):
                    captured[name] = first(output).detach()[0].to(torch.float32).contiguous()
                return fn

            handles = [modules[m].register_forward_hook(hook(t)) for m, t in wanted.items()]
            try:
                with torch.no_grad():
                    logits = model(input_ids=ids, attention_mask=enc["attention_mask"],
                                   use_cache=False).logits[0].float()
            finally:
                for h in handles:
                    h.remove()

            # Greedy continuation: GREEDY_TOKENS argmax steps through the KV cache, with no
            # logits processing and no stop at EOS (generate() stops at the tokenizer's EOS
            # whatever its config says), so there are always GREEDY_TOKENS ids.
            greedy = greedy_ids(model, ids, enc["attention_mask"], GREEDY_TOKENS)
            if int(greedy[0]) != int(logits[-1].argmax()):
                raise BadInput("first greedy token is not the argmax of the dumped logits")

            tensors = {"input_ids": ids[0].to(torch.int64).contiguous(), "logits": logits.contiguous(),
                       "greedy_ids": greedy.contiguous()}
            for name in wanted.values():
                fused = next((f for f in SPLITS if name.endswith(f".{f}.output")), None)
                if fused is not None:
                    # Only the parts are kept: they are the fused output, sliced.
                    prefix = name[: -len(f"{fused}.output")]
                    for part, piece in zip(SPLITS[fused], split_fused(fused, captured[name], cfg)):
                        tensors[f"{prefix}{part}.output"] = piece.contiguous()
                    continue
                tensors[name] = captured[name]
                if name in head_norm_names:
                    tensors[name] = flatten_heads(captured[name], head_norm_layout, ids.shape[1])
            meta = {
                "prompt": text,
                "model": source_name or model_dir.name,
                "architecture": ",".join(cfg.architectures or []),
                "checkpoint_dtype": ckpt_dtype,
                "dtype": "float32",
                "attn_implementation": "eager",
                "transformers_version": transformers.__version__,
                "torch_version": torch.__version__,
                "n_tokens": str(ids.shape[1]),
                "greedy_tokens": str(GREEDY_TOKENS),
                "greedy_text": tok.decode(greedy),
                "detail_layers": ",".join(map(str, detail)),
            }
            save_file(tensors, str(tmp / f"{k}.safetensors"), metadata=meta)
            (tmp / f"{k}.safetensors").chmod(0o644)
            print(f"{source_name or model_dir.name}/{k}: {ids.shape[1]} tokens, {len(tensors)} tensors, "
                  f"greedy {tok.decode(greedy)!r}")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_prompts(path: Path) -> list[str]:
    """One prompt per line; blank lines are skipped (a prompt cannot span lines here)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"--prompts {path}: {e}") from None
    return [line for line in lines if line.strip()]


def read_chats(path: Path) -> list:
    """One JSON value per line: a string (a user message) or a list of messages."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"--chats {path}: {e}") from None
    chats = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--chats {path}, line {n}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadInput(f"{where}: not JSON: {e.msg} at column {e.colno}") from None
        chats.append(check_chat(value, where))
    return chats


def check_chat(value, where: str):
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise BadInput(f"{where}: want a string or a non-empty list of messages, "
                       f"got {type(value).__name__}")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise BadInput(f"{where}: message {i} must be an object with exactly "
                           f"\"role\" and \"content\"")
        if m["role"] not in ROLES:
            raise BadInput(f"{where}: message {i} has role {m['role']!r}; "
                           f"roles are {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise BadInput(f"{where}: message {i}'s content must be a string")
    return value


def check_model_dir(model_dir: Path) -> str:
    """The checkpoint's class, if it is one Kiln converts; read without torch."""
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise BadInput(f"--model {model_dir}: no config.json (want a Hugging Face checkpoint "
                       f"directory)")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadInput(f"{cfg_path}: {e}") from None
    classes = cfg.get("architectures") if isinstance(cfg, dict) else None
    if not isinstance(classes, list) or not classes or classes[0] not in SUPPORTED_CLASSES:
        raise BadInput(f"{cfg_path}: architectures {classes!r} is not one Kiln runs "
                       f"({', '.join(SUPPORTED_CLASSES)})")
    return classes[0]


def check_out_dir(out_dir: Path, force: bool):
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise BadInput(f"--out {out_dir}: exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise BadInput(f"--out {out_dir}: exists and is not empty (--force replaces it)")


def parse_layers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise BadInput(f"--detail-layers {text!r}: want comma-separated layer numbers") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--model", type=Path, required=True, help="Hugging Face checkpoint directory")
    ap.add_argument("--out", type=Path, required=True,
                    help="output directory (<k>.safetensors per prompt)")
    ap.add_argument("--prompt", action="append", default=[], help="plain prompt (repeatable)")
    ap.add_argument("--prompts", type=Path, help="file of plain prompts, one per line")
    ap.add_argument("--chat", action="append", default=[],
                    help="user message rendered with the chat template (repeatable)")
    ap.add_argument("--chats", type=Path,
                    help="JSON lines: a user message string or a list of {role, content} messages")
    ap.add_argument("--system", help="system message put before each chat that has none")
    ap.add_argument("--detail-layers", help="comma-separated layers whose sub-module outputs are "
                    "dumped (default: all; -1 is the last)")
    ap.add_argument("--force", action="store_true", help="replace a non-empty --out")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cls = check_model_dir(args.model)
        check_out_dir(args.out, args.force)
        prompts = list(args.prompt) + (read_prompts(args.prompts) if args.prompts else [])
        chats = list(args.chat) + (read_chats(args.chats) if args.chats else [])
        if not prompts and not chats:
            raise BadInput("nothing to run: give --prompt, --prompts, --chat or --chats")
        detail = None if args.detail_layers is None else parse_layers(args.detail_layers)
        embedder = is_embedder(args.model, cls)
        if embedder and chats:
            raise BadInput(f"--model {args.model} is an embedding model, which has no chat "
                           f"template: give its texts with --prompt or --prompts")
        import transformers

        if not transformers.__version__.startswith("5."):
            raise BadInput(f"transformers 5.x expected, found {transformers.__version__} "
                           f"(pip install -r verify/reference/requirements.txt)")
        if embedder:
            dump_embedder(args.model, args.out, prompts, detail)
        else:
            dump_model(args.model, args.out, prompts, chats, args.system, detail)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"error: {e.name or e} is not installed: "
              f"pip install -r verify/reference/requirements.txt", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
