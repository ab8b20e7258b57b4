//! Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1 through GGUF: kept byte for byte both ways (import and
//! export, q/k rows reordered whole for llama.cpp's rope), decoded with the format crate's
//! references where asked (`--dequantize-all`) or where the runner needs floats (quantized 1-D
//! tensors); malformed blocks refused naming the file and tensor; and `kiln_format`'s reference
//! dequantizers against PyPI's `gguf` on real blocks of Gemma 3 270M's Q4_K_M file
//! (`fixtures/gguf/gemma3_dequant.json`, made by `fixtures/gguf/make_gemma3_dequant.py`).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::{convert, repo};
use half::f16;
use kiln_convert::gguf::{
    export_gguf, import_gguf, ExportOptions, GgmlType, GgufBuilder, GgufFile, ImportOptions,
    ImportSummary, Value,
};
use kiln_convert::names::{source_name, Source};
use kiln_convert::{ConvertError, NoProgress};
use kiln_format::values::decode_rows_f32;
use kiln_format::{Architecture, DType, KilnFile, KilnWriter, Role, TensorName, TensorSpec};

/// The block types format 1.2 added, which GGUF import keeps as they are.
const KEPT: [DType; 5] = [
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
    DType::Q5_0,
    DType::Q5_1,
];

/// Deterministic pseudo-random numbers (xorshift64*), so that a failure reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// Byte offsets of a block's f16 scale fields (`d`, and `dmin`/`m` where it has one).
fn scale_offsets(d: DType) -> &'static [usize] {
    match d {
        DType::Q5_0 | DType::Q8_0 | DType::Q4_0 => &[0],
        DType::Q6_K => &[208],
        DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        other => panic!("{other} has no block scales"),
    }
}

/// `numel` weights of `d`: blocks of random codes (and random K-quant sub-block scales), with
/// small finite f16 scales of either sign.
fn random_blocks(d: DType, numel: u64, rng: &mut Rng) -> Vec<u8> {
    let n = numel as usize / d.block_len();
    let mut out = Vec::with_capacity(n * d.block_bytes());
    for _ in 0..n {
        let start = out.len();
        out.extend((0..d.block_bytes()).map(|_| rng.next() as u8));
        for &o in scale_offsets(d) {
            let s = (rng.next() % 2001) as f32 / 1000.0 - 1.0;
            out[start + o..start + o + 2].copy_from_slice(&f16::from_f32(s * 0.01).to_le_bytes());
        }
    }
    out
}

/// The block type of a matrix, by role: every type of [`KEPT`] appears, q and k (whose rows
/// export reorders) in K-quants, and Q4_K holds the most weights (the embedding, gate and up),
/// as in a llama-quantize `Q4_K_M` file.
fn matrix_dtype(name: TensorName) -> DType {
    match name.role {
        Role::AttnQ => DType::Q5_K,
        Role::AttnK | Role::MlpDown => DType::Q6_K,
        Role::AttnV => DType::Q5_0,
        Role::AttnO => DType::Q5_1,
        _ => DType::Q4_K,
    }
}

/// The tensor whose 1-D values are stored in a block type (Q5_0): export must widen them.
const QUANTIZED_NORM: &str = "layers.1.mlp_norm.weight";

/// A llama model (the tiny fixture's tokenizer and family) whose rows are a multiple of 256,
/// every matrix in one of [`KEPT`], one norm in Q5_0, the other 1-D tensors in f32.
fn kquant_model(dir: &Path) -> PathBuf {
    let base = dir.join("base.kiln");
    convert(&repo().join("fixtures/tiny/llama-tied-f32"), &base);
    let mut meta = KilnFile::open(&base).unwrap().metadata().clone();
    let c = &mut meta.config;
    (c.hidden_size, c.intermediate_size, c.head_dim) = (256, 512, 64);
    (c.num_heads, c.num_kv_heads) = (4, 2);
    let mut rng = Rng(0x6b69_6c6e_5f6b_7175);
    let mut specs = Vec::new();
    let mut data = Vec::new();
    for (name, shape) in kiln_format::expected_tensors(&meta.config) {
        let numel: u64 = shape.iter().product();
        let dtype = if shape.len() == 2 {
            matrix_dtype(name)
        } else if name.to_string() == QUANTIZED_NORM {
            DType::Q5_0
        } else {
            DType::F32
        };
        data.push(if dtype == DType::F32 {
            (0..numel)
                .flat_map(|_| (1.0 + (rng.next() % 100) as f32 / 1000.0).to_le_bytes())
                .collect()
        } else {
            random_blocks(dtype, numel, &mut rng)
        });
        specs.push(TensorSpec {
            name: name.to_string(),
            dtype,
            shape,
        });
    }
    let path = dir.join("kq.kiln");
    let w = KilnWriter::create(&path, &meta, specs, false).unwrap();
    for (i, bytes) in data.iter().enumerate() {
        w.write_tensor(i, bytes).unwrap();
    }
    w.finish().unwrap();
    path
}

fn export(input: &Path, output: &Path) -> kiln_convert::gguf::ExportSummary {
    export_gguf(
        &ExportOptions {
            input: input.to_path_buf(),
            output: output.to_path_buf(),
            overwrite: false,
        },
        &NoProgress,
    )
    .unwrap()
}

fn import_with(
    input: &Path,
    output: &Path,
    dequantize_to: DType,
    dequantize_all: bool,
) -> Result<ImportSummary, ConvertError> {
    import_gguf(
        &ImportOptions {
            input: input.to_path_buf(),
            output: output.to_path_buf(),
            overwrite: false,
            dequantize_to,
            dequantize_all,
            allow_non_finite: false,
        },
        &NoProgress,
    )
}

fn import(input: &Path, output: &Path) -> ImportSummary {
    import_with(input, output, DType::F16, false).unwrap()
}

/// A copy of the GGUF `src` at `dst`, the same metadata and tensors, except those `edit`
/// (given a tensor's name, dims and bytes) returns a new type, dims and bytes for.
type Edit = (GgmlType, Vec<u64>, Vec<u8>);

fn rebuild(src: &Path, dst: &Path, edit: impl Fn(&str, &[u64], &[u8]) -> Option<Edit>) {
    let g = GgufFile::open(src).unwrap();
    let h = g.header();
    let mut b = GgufBuilder::new();
    for (k, v) in &h.metadata {
        if k != "general.alignment" {
            b.set(k, v.clone());
        }
    }
    let mut data: Vec<Vec<u8>> = Vec::new();
    for t in &h.tensors {
        let bytes = g.tensor_bytes(t);
        let (ty, dims, bytes) = edit(&t.name, &t.dims, bytes)
            .unwrap_or_else(|| (t.ggml_type, t.dims.clone(), bytes.to_vec()));
        b.add_tensor(&t.name, dims, ty).unwrap();
        data.push(bytes);
    }
    b.write(dst, false, |i| Ok(data[i].clone().into())).unwrap();
}

fn ggml(d: DType) -> GgmlType {
    GgmlType::of(d)
}

/// The values of `bytes` of GGML row-major `d`, by the format crate's reference.
fn values(d: DType, bytes: &[u8]) -> Vec<f32> {
    let n = bytes.len() / d.block_bytes() * d.block_len();
    let mut out = vec![0f32; n];
    decode_rows_f32(d, n, bytes, &mut out);
    out
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// GGUF → .kiln → GGUF keeps every K-quant and Q5 block: the .kiln holds the GGUF's bytes
/// (q/k rows moved whole, back in Hugging Face's order), re-export writes the same bytes and
/// types, and the file says Q4_K_M as llama-quantize's files of such a mix do.
#[test]
fn k_quants_and_q5_cross_gguf_byte_for_byte() {
    let tmp = tempfile::tempdir().unwrap();
    let a_path = kquant_model(tmp.path());
    let (d1, d2) = (tmp.path().join("1"), tmp.path().join("2"));
    std::fs::create_dir(&d1).unwrap();
    std::fs::create_dir(&d2).unwrap();
    let gguf1 = d1.join("m.gguf");
    let s = export(&a_path, &gguf1);
    for d in KEPT {
        assert!(s.types.contains_key(ggml(d).name), "{:?}", s.types);
    }
    let back = d2.join("m.kiln");
    let imported = import(&gguf1, &back);
    assert!(
        imported.dequantized.is_empty(),
        "{:?}",
        imported.dequantized
    );
    for d in KEPT {
        assert!(
            imported.kept.contains_key(ggml(d).name),
            "{:?}",
            imported.kept
        );
    }
    // The Q5_0 norm was widened to F32 on export, as llama.cpp expects norms.
    assert!(imported.vectors_to_f32.is_empty());
    let gguf2 = d2.join("m.gguf");
    export(&back, &gguf2);

    let (a, b) = (
        KilnFile::open(&a_path).unwrap(),
        KilnFile::open(&back).unwrap(),
    );
    assert_eq!(a.version(), (1, 2));
    assert_eq!(a.info(QUANTIZED_NORM).unwrap().dtype, DType::Q5_0);
    assert_eq!(b.version(), (1, 2), "a file with K-quants is format 1.2");
    assert_eq!(a.tensors().len(), b.tensors().len());
    for (x, y) in a.tensors().iter().zip(b.tensors()) {
        assert_eq!((&x.name, &x.shape), (&y.name, &y.shape));
        if x.shape.len() == 2 {
            assert_eq!(x.dtype, y.dtype, "{}", x.name);
            assert!(a.view(x).bytes() == b.view(y).bytes(), "{} differs", x.name);
        } else {
            assert_eq!(y.dtype, DType::F32, "{}", x.name);
            assert_eq!(
                bits(&a.view(x).to_f32_vec()),
                bits(&b.view(y).to_f32_vec()),
                "{}",
                x.name
            );
        }
    }

    let (g1, g2) = (
        GgufFile::open(&gguf1).unwrap(),
        GgufFile::open(&gguf2).unwrap(),
    );
    let (h1, h2) = (g1.header(), g2.header());
    assert_eq!(h1.tensors.len(), h2.tensors.len());
    for (t1, t2) in h1.tensors.iter().zip(&h2.tensors) {
        assert_eq!(
            (&t1.name, &t1.dims, t1.ggml_type),
            (&t2.name, &t2.dims, t2.ggml_type)
        );
        assert!(
            g1.tensor_bytes(t1) == g2.tensor_bytes(t2),
            "{} differs",
            t1.name
        );
    }
    // Tensors that need no row reordering hold the .kiln bytes themselves.
    for (kiln, gguf) in [
        ("layers.0.attn.v.weight", "blk.0.attn_v.weight"),
        ("layers.1.mlp.down.weight", "blk.1.ffn_down.weight"),
        ("embed.weight", "token_embd.weight"),
    ] {
        let x = a.info(kiln).unwrap();
        let t = h1.tensor(gguf).unwrap();
        assert_eq!(t.ggml_type, ggml(x.dtype), "{gguf}");
        assert!(a.view(x).bytes() == g1.tensor_bytes(t), "{gguf}");
    }
    // q is reordered for llama.cpp's rope: its rows are the .kiln's, moved whole.
    let q = a.info("layers.0.attn.q.weight").unwrap();
    let tq = h1.tensor("blk.0.attn_q.weight").unwrap();
    assert_ne!(a.view(q).bytes(), g1.tensor_bytes(tq));
    let row = q.dtype.byte_len(&[256]).unwrap() as usize;
    let mut rows_a: Vec<&[u8]> = a.view(q).bytes().chunks(row).collect();
    let mut rows_g: Vec<&[u8]> = g1.tensor_bytes(tq).chunks(row).collect();
    rows_a.sort_unstable();
    rows_g.sort_unstable();
    assert_eq!(rows_a, rows_g);
    // `inspect` names the types, their sizes and the format version they need.
    let i = kiln_convert::inspect(&back, false, &NoProgress).unwrap();
    assert_eq!(i.format_version, "1.2");
    let q6 = &i.dtypes["q6_k"];
    assert_eq!((q6.bits_per_weight, q6.since_minor), (6.5625, 2));
    assert_eq!(i.dtypes["f32"].since_minor, 0);
    let text = kiln_convert::inspect::render(&i);
    for d in KEPT {
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{} ", d.name())))
            .unwrap_or_else(|| panic!("no {d} line in\n{text}"));
        assert!(
            line.contains(&format!("GGML {}", ggml(d).name)) && line.contains("(format 1.2)"),
            "{line}"
        );
    }
    for h in [h1, h2] {
        // MOSTLY_Q4_K_M: the K-quant holding most weights is Q4_K.
        assert_eq!(h.get("general.file_type"), Some(&Value::U32(15)));
        assert_eq!(h.get("general.quantization_version"), Some(&Value::U32(2)));
    }
}

/// `--dequantize-all` decodes K-quant and Q5 blocks with the format crate's references: the
/// f32 file holds exactly the values of the blocks the default import keeps.
#[test]
fn dequantize_all_gives_the_reference_values() {
    let tmp = tempfile::tempdir().unwrap();
    let a_path = kquant_model(tmp.path());
    let gguf = tmp.path().join("m.gguf");
    export(&a_path, &gguf);
    let f32_path = tmp.path().join("f32.kiln");
    let s = import_with(&gguf, &f32_path, DType::F32, true).unwrap();
    let a = KilnFile::open(&a_path).unwrap();
    let mut want: BTreeMap<String, usize> = BTreeMap::new();
    for x in a.tensors().iter().filter(|x| x.shape.len() == 2) {
        *want.entry(ggml(x.dtype).name.to_string()).or_default() += 1;
    }
    assert_eq!(s.dequantized, want);
    let f = KilnFile::open(&f32_path).unwrap();
    assert_eq!(f.version(), (1, 0), "an all-float file stays format 1.0");
    for x in a.tensors() {
        let y = f.info(&x.name).unwrap();
        assert_eq!(y.dtype, DType::F32, "{}", x.name);
        let want = values(x.dtype, a.view(x).bytes());
        assert_eq!(bits(&f.view(y).to_f32_vec()), bits(&want), "{}", x.name);
    }
}

/// A norm a GGUF holds in a block type (llama-quantize never writes one, a hand-made file may)
/// is imported as f32, its exact values, since the runner reads vectors as floats.
#[test]
fn quantized_vectors_import_as_f32() {
    let tmp = tempfile::tempdir().unwrap();
    let a_path = kquant_model(tmp.path());
    let gguf = tmp.path().join("m.gguf");
    export(&a_path, &gguf);
    let edited = tmp.path().join("vectors.gguf");
    let q4k = random_blocks(DType::Q4_K, 256, &mut Rng(7));
    let q5_0 = random_blocks(DType::Q5_0, 256, &mut Rng(8));
    let (q4k_copy, q5_0_copy) = (q4k.clone(), q5_0.clone());
    rebuild(&gguf, &edited, move |name, _, _| match name {
        "blk.0.attn_norm.weight" => Some((ggml(DType::Q4_K), vec![256], q4k_copy.clone())),
        "output_norm.weight" => Some((ggml(DType::Q5_0), vec![256], q5_0_copy.clone())),
        _ => None,
    });
    let out = tmp.path().join("v.kiln");
    let s = import(&edited, &out);
    assert_eq!(
        s.vectors_to_f32,
        BTreeMap::from([("Q4_K".to_string(), 1), ("Q5_0".to_string(), 1)])
    );
    let f = KilnFile::open(&out).unwrap();
    for (name, d, bytes) in [
        ("layers.0.attn_norm.weight", DType::Q4_K, &q4k),
        ("final_norm.weight", DType::Q5_0, &q5_0),
    ] {
        let x = f.info(name).unwrap();
        assert_eq!(x.dtype, DType::F32, "{name}");
        assert_eq!(bits(f.view(x).as_f32().unwrap()), bits(&values(d, bytes)));
    }
    // The provenance says what was kept and what was decoded.
    let p = &f.metadata().provenance[0].details["conversion"];
    assert_eq!(p["vectors_to_f32"]["Q4_K"], 1, "{p}");
    assert_eq!(p["kept"]["Q6_K"], 4, "{p}");
}

/// A block whose f16 scale (or minimum) is NaN or infinite makes every weight of the block
/// non-finite: refused, naming the file, the tensor and the first element, as float tensors
/// are.
#[test]
fn non_finite_block_scales_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let a_path = kquant_model(tmp.path());
    let gguf = tmp.path().join("m.gguf");
    export(&a_path, &gguf);
    let a = KilnFile::open(&a_path).unwrap();
    // (tensor, its dtype in the model, byte offset of the field within a block, value)
    let mut cases = Vec::new();
    for x in a.tensors().iter().filter(|x| x.shape.len() == 2) {
        let gguf_name = source_name(
            Source::Gguf,
            Architecture::Llama,
            TensorName::parse(&x.name).unwrap(),
        );
        let offsets = scale_offsets(x.dtype);
        let field = *offsets.last().unwrap(); // `dmin`/`m` where there is one, else `d`
        if !cases
            .iter()
            .any(|(_, d, _): &(String, DType, usize)| *d == x.dtype)
        {
            cases.push((gguf_name, x.dtype, field));
        }
    }
    assert_eq!(cases.len(), KEPT.len(), "{cases:?}");
    for (i, (tensor, dtype, field)) in cases.into_iter().enumerate() {
        let bad = if i % 2 == 0 { f16::NAN } else { f16::INFINITY };
        let edited = tmp.path().join(format!("bad{i}.gguf"));
        let name = tensor.clone();
        rebuild(&gguf, &edited, move |n, dims, bytes| {
            (n == name).then(|| {
                let mut b = bytes.to_vec();
                // The third block of the tensor.
                let at = 2 * dtype.block_bytes() + field;
                b[at..at + 2].copy_from_slice(&bad.to_le_bytes());
                (ggml(dtype), dims.to_vec(), b)
            })
        });
        let e = import_with(
            &edited,
            &tmp.path().join(format!("bad{i}.kiln")),
            DType::F16,
            false,
        )
        .unwrap_err();
        match &e {
            ConvertError::NonFinite {
                file,
                tensor: t,
                index,
                count,
            } => {
                assert!(file.ends_with(&format!("bad{i}.gguf")), "{e}");
                assert_eq!(t, &tensor, "{e}");
                assert_eq!(*index, 2 * dtype.block_len(), "{e}");
                assert_eq!(*count, dtype.block_len(), "{e}");
            }
            other => panic!("{tensor} ({dtype}): {other}"),
        }
        assert!(e.to_string().contains(&tensor), "{e}");
    }
}

/// Real blocks of Gemma 3 270M's Q4_K_M GGUF (Q4_K, Q6_K, Q5_0, Q8_0: the types llama-quantize
/// wrote), decoded by PyPI's `gguf` (numpy, independent of Kiln): `kiln_format`'s reference
/// dequantizers give the same f32 bits for every weight.
#[test]
fn format_dequantizers_match_gguf_py_on_real_gemma3_blocks() {
    let text = std::fs::read_to_string(repo().join("fixtures/gguf/gemma3_dequant.json")).unwrap();
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let blocks = doc["blocks"].as_object().unwrap();
    let mut types: Vec<&str> = blocks.keys().map(String::as_str).collect();
    types.sort_unstable();
    assert_eq!(types, ["Q4_K", "Q5_0", "Q6_K", "Q8_0"]);
    for (name, case) in blocks {
        let d = DType::parse(name).unwrap();
        let hex = case["hex"].as_str().unwrap();
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let want: Vec<u32> = case["f32_bits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u32)
            .collect();
        let n_blocks = case["block_indices"].as_array().unwrap().len();
        assert_eq!(bytes.len(), n_blocks * d.block_bytes(), "{name}");
        let got = bits(&values(d, &bytes));
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g,
                w,
                "{name} weight {i}: kiln {} vs gguf-py {}",
                f32::from_bits(*g),
                f32::from_bits(*w)
            );
        }
    }
}

/// A K-quant matrix whose rows are not whole 256-weight blocks cannot be declared: the `.kiln`
/// writer refuses it naming the tensor, and so does the GGUF writer.
#[test]
fn k_quant_rows_must_be_whole_super_blocks() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base.kiln");
    convert(&repo().join("fixtures/tiny/llama-tied-f32"), &base);
    let meta = KilnFile::open(&base).unwrap().metadata().clone();
    for d in [DType::Q4_K, DType::Q5_K, DType::Q6_K] {
        let spec = TensorSpec {
            name: "embed.weight".into(),
            dtype: d,
            shape: vec![320, 576],
        };
        let e = KilnWriter::create(tmp.path().join("x.kiln"), &meta, vec![spec], false)
            .err()
            .unwrap_or_else(|| panic!("{d} with rows of 576 accepted"))
            .to_string();
        assert!(e.contains("embed.weight") && e.contains("256"), "{e}");
        let mut b = GgufBuilder::new();
        let e = b
            .add_tensor("blk.0.ffn_down.weight", vec![576, 4], ggml(d))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("blk.0.ffn_down.weight") && e.contains("256"),
            "{e}"
        );
    }
}
