//! Shared helpers for the integration tests: converting fixtures, reading reference dumps,
//! comparing activations with named metrics.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use kiln_format::DType;
use kiln_runner::{
    generate, GenerateOptions, Logits, Model, Recorder, Sampler, SamplerConfig, Tokenizer,
};
use safetensors::{Dtype, SafeTensors};

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The tiny fixture variants.
pub const TINY: [&str; 11] = [
    "llama-tied-f32",
    "llama-untied-bf16",
    "qwen2-bias-f32",
    "llama3-rope-f32",
    "mistral-f32",
    "llama-sharded-f16",
    "qwen3-f32",
    "gemma3-f32",
    "phi3-f32",
    "glm4-f32",
    "glm-f32",
];

/// The real SmolLM2 checkpoint, built by `ci/smollm2.sh` (not committed).
pub fn smollm2_dir() -> PathBuf {
    let d = root().join("target/models/smollm2-bf16");
    assert!(
        d.join("model.safetensors").exists(),
        "{} is absent: run ci/smollm2.sh to build it",
        d.display()
    );
    d
}

/// A directory for the files a test binary builds once and shares between its tests, under
/// cargo's scratch directory for integration tests (`target/tmp`). The files are kept in a
/// `static`, which is never dropped, so a temporary directory there would outlive every run
/// (a gigabyte or more each time); these paths are the same from run to run, and every build
/// overwrites the last one's file (atomically, so a run beside this one keeps reading its copy).
pub fn fixture_dir(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&d).unwrap_or_else(|e| panic!("creating {}: {e}", d.display()));
    d
}

/// Convert an HF directory into `dir/name.kiln` with `dtype` (None: source dtypes).
pub fn convert(input: &Path, dir: &Path, dtype: Option<DType>) -> PathBuf {
    let tag = dtype.map_or("source".to_string(), |d| d.to_string());
    let out = dir.join(format!(
        "{}-{tag}.kiln",
        input.file_name().unwrap().to_string_lossy()
    ));
    kiln_convert::convert_hf(
        &kiln_convert::ConvertOptions {
            input: input.to_path_buf(),
            output: out.clone(),
            dtype,
            overwrite: true,
            allow_non_finite: false,
        },
        &kiln_convert::NoProgress,
    )
    .unwrap_or_else(|e| panic!("converting {}: {e}", input.display()));
    out
}

/// One reference dump: activations by name, plus ids and metadata.
pub struct Reference {
    pub tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
    pub input_ids: Vec<u32>,
    pub greedy_ids: Vec<u32>,
    pub meta: HashMap<String, String>,
}

impl Reference {
    pub fn load(path: &Path) -> Reference {
        let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
        let meta = header.metadata().clone().unwrap_or_default();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut tensors = HashMap::new();
        let mut input_ids = Vec::new();
        let mut greedy_ids = Vec::new();
        for (name, view) in st.tensors() {
            let data = view.data();
            match view.dtype() {
                Dtype::F32 => {
                    let v: Vec<f32> = data
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                        .collect();
                    tensors.insert(name, (view.shape().to_vec(), v));
                }
                Dtype::I64 => {
                    let v: Vec<u32> = data
                        .chunks_exact(8)
                        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
                        .collect();
                    match name.as_str() {
                        "input_ids" => input_ids = v,
                        "greedy_ids" => greedy_ids = v,
                        other => panic!("unexpected integer tensor {other}"),
                    }
                }
                d => panic!("unexpected dtype {d:?} for {name}"),
            }
        }
        Reference {
            tensors,
            input_ids,
            greedy_ids,
            meta,
        }
    }
}

/// Largest |a - b|.
pub fn max_abs_error(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Largest |b|, to put an absolute error in scale.
pub fn max_abs(b: &[f32]) -> f32 {
    b.iter().map(|x| x.abs()).fold(0.0, f32::max)
}

/// Cosine similarity of each row, the smallest over rows.
pub fn min_row_cosine(a: &[f32], b: &[f32], cols: usize) -> f64 {
    a.chunks(cols)
        .zip(b.chunks(cols))
        .map(|(x, y)| {
            let dot: f64 = x
                .iter()
                .zip(y)
                .map(|(p, q)| f64::from(*p) * f64::from(*q))
                .sum();
            let nx: f64 = x.iter().map(|p| f64::from(*p).powi(2)).sum::<f64>().sqrt();
            let ny: f64 = y.iter().map(|q| f64::from(*q).powi(2)).sum::<f64>().sqrt();
            dot / (nx * ny).max(1e-30)
        })
        .fold(1.0, f64::min)
}

/// Run one dump's prompt and compare every activation; returns the worst relative error.
pub fn compare_dump(
    kiln: &Path,
    dump: &Path,
    threads: usize,
    rel_max_err: f32,
    min_cosine: f64,
) -> f32 {
    let r = Reference::load(dump);
    let file = kiln_runner::open_model(kiln).unwrap();
    let model = Model::load(&file).unwrap();
    let mut sess = model.session(model.default_ctx(), threads).unwrap();
    let mut rec = Recorder::default();
    let logits = sess
        .forward(&r.input_ids, Logits::All, Some(&mut rec))
        .unwrap()
        .to_vec();
    let mut worst = (0f32, String::new());
    let mut names: Vec<_> = r.tensors.keys().cloned().collect();
    names.sort();
    for name in &names {
        let (shape, want) = &r.tensors[name];
        let (got_shape, got) = rec
            .get(name)
            .unwrap_or_else(|| panic!("{}: kiln recorded no `{name}`", dump.display()));
        assert_eq!(
            &got_shape[..],
            &shape[..],
            "{}: shape of {name}",
            dump.display()
        );
        let err = max_abs_error(got, want) / max_abs(want).max(1e-6);
        if err > worst.0 {
            worst = (err, name.clone());
        }
        assert!(
            err <= rel_max_err,
            "{} ({}): {name}: relative max error {err:.3e} > {rel_max_err:e}",
            dump.display(),
            kiln.display()
        );
    }
    let (_, want_logits) = &r.tensors["logits"];
    assert_eq!(&logits, rec.get("logits").unwrap().1);
    let vocab = model.config.vocab;
    let cos = min_row_cosine(&logits, want_logits, vocab);
    assert!(cos >= min_cosine, "{}: logits cosine {cos}", dump.display());
    eprintln!(
        "{} vs {}: worst relative error {:.2e} ({}), logits max abs error {:.2e}, min cosine {:.9}",
        kiln.file_name().unwrap().to_string_lossy(),
        dump.display(),
        worst.0,
        worst.1,
        max_abs_error(&logits, want_logits),
        cos
    );

    // Greedy continuation: 8 tokens, EOS not stopping (as the dump's generate() call).
    let tok = Tokenizer::from_file(&file).unwrap();
    let mut sess = model.session(model.default_ctx(), threads).unwrap();
    let g = generate(
        &mut sess,
        &tok,
        &r.input_ids,
        &GenerateOptions {
            max_tokens: r.greedy_ids.len(),
            ignore_eos: true,
            ..Default::default()
        },
        &mut Sampler::new(SamplerConfig::default()),
        &mut |_| Ok(()),
    )
    .unwrap();
    assert_eq!(g.tokens, r.greedy_ids, "{}: greedy ids", dump.display());
    worst.0
}

/// Render each case of `cases` (transformers' `apply_chat_template` results: `messages`,
/// `add_generation_prompt`, then `rendered`, or `error` where the template refused) with
/// `template`, and return the disagreements, each prefixed with `what`; a rendering that
/// agrees is checked further by `then` (its token ids, say), which returns a disagreement.
pub fn compare_chats(
    what: &str,
    template: &kiln_runner::ChatTemplate<'_>,
    cases: &[serde_json::Value],
    then: &dyn Fn(&str, &serde_json::Value) -> Option<String>,
) -> Vec<String> {
    use kiln_runner::{Message, RunnerError};
    let mut bad = Vec::new();
    for (k, case) in cases.iter().enumerate() {
        let messages: Vec<Message> = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| Message::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        let gen = case["add_generation_prompt"].as_bool().unwrap();
        let what = format!("{what}chat {k} (add_generation_prompt {gen})");
        match (template.render(&messages, gen), case.get("error")) {
            (Ok(text), None) => {
                let want = case["rendered"].as_str().unwrap();
                if text != want {
                    bad.push(format!(
                        "{what}: kiln renders {text:?}, transformers {want:?}"
                    ));
                } else if let Some(e) = then(&text, case) {
                    bad.push(format!("{what}: {e}"));
                }
            }
            (Err(RunnerError::ChatTemplate(msg)), Some(refusal)) => {
                let refusal = refusal.as_str().unwrap();
                if !msg.contains(refusal) {
                    bad.push(format!(
                        "{what}: kiln refuses with {msg:?}, transformers with {refusal:?}"
                    ));
                }
            }
            (Ok(text), Some(refusal)) => bad.push(format!(
                "{what}: kiln renders {text:?}, transformers refuses ({refusal})"
            )),
            (Err(e), _) => bad.push(format!("{what}: kiln fails: {e}")),
        }
    }
    bad
}
