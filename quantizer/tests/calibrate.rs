//! Calibration on real (tiny) transformers checkpoints: what is measured, that it is what the
//! forward pass actually multiplies, the importance file, and calibrated quantization end to end.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_format::{DType, KilnFile};
use kiln_quantize::budget::{self, Budget};
use kiln_quantize::calibrate::{calibrate, matrix_sites, CalibrationOptions};
use kiln_quantize::importance::Importance;
use kiln_quantize::sensitivity::Probe;
use kiln_quantize::{
    quantize_file, Method, NoProgress, Override, Policy, QuantizeError, QuantizeOptions,
};
use kiln_runner::{Logits, Model, Recorder, Tokenizer};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn convert(fixture: &str, dir: &Path) -> PathBuf {
    let out = dir.join(format!("{fixture}.kiln"));
    kiln_convert::convert_hf(
        &kiln_convert::ConvertOptions {
            input: root().join("fixtures/tiny").join(fixture),
            output: out.clone(),
            dtype: None,
            overwrite: true,
            allow_non_finite: false,
        },
        &kiln_convert::NoProgress,
    )
    .unwrap();
    out
}

/// The quantized model runs and gives finite logits.
fn assert_runs(q: &KilnFile) {
    let model = Model::load(q).unwrap();
    let ids = Tokenizer::from_file(q).unwrap().encode("the fox").unwrap();
    let logits = model
        .session(64, 1)
        .unwrap()
        .forward(&ids, Logits::Last, None)
        .unwrap()
        .to_vec();
    assert!(logits.iter().all(|v| v.is_finite()));
}

fn corpus() -> String {
    std::fs::read_to_string(root().join("fixtures/tiny/corpus.txt")).unwrap()
}

fn options(second_moments: bool) -> CalibrationOptions {
    CalibrationOptions {
        max_tokens: 4096,
        ctx: 64,
        second_moments,
        threads: 2,
    }
}

#[test]
fn every_matrix_gets_the_mean_square_of_what_it_multiplies() {
    let dir = tempfile::tempdir().unwrap();
    let path = convert("llama-untied-bf16", dir.path());
    let file = KilnFile::open(&path).unwrap();
    let text = corpus();
    let imp = calibrate(&file, &text, &options(true), &NoProgress).unwrap();

    // Every 2-D matrix but the (untied) embedding, with one value per column.
    let matrices: Vec<&str> = file
        .tensors()
        .iter()
        .filter(|t| t.shape.len() == 2 && t.name != "embed.weight")
        .map(|t| t.name.as_str())
        .collect();
    assert_eq!(
        imp.columns.keys().map(String::as_str).collect::<Vec<_>>(),
        {
            let mut m = matrices.clone();
            m.sort();
            m
        }
    );
    for (name, v) in &imp.columns {
        let cols = file.info(name).unwrap().shape[1] as usize;
        assert_eq!(v.len(), cols, "{name}");
        assert!(v.iter().all(|x| x.is_finite() && *x >= 0.0), "{name}");
        assert!(v.iter().any(|x| *x > 0.0), "{name}");
        // The diagonal of the second moment is the column mean square.
        let m = imp.moment(name).unwrap();
        for (j, &c) in v.iter().enumerate() {
            let d = m[j * cols + j];
            assert!(
                (d - c).abs() <= 1e-4 * c.max(1e-6),
                "{name}[{j}]: {d} vs {c}"
            );
        }
        // Symmetric.
        for i in 0..cols {
            for j in 0..i {
                let (a, b) = (m[i * cols + j], m[j * cols + i]);
                assert!((a - b).abs() <= 1e-5 * (a.abs() + b.abs() + 1e-6), "{name}");
            }
        }
    }
    assert_eq!(
        imp.sites["layers.1.attn.k.weight"],
        imp.sites["layers.1.attn.v.weight"]
    );
    assert_eq!(imp.sites["lm_head.weight"], "model.norm.output");

    // Recompute two sites independently from recorded activations of the same windows.
    let model = Model::load(&file).unwrap();
    let mut ids = Tokenizer::from_file(&file).unwrap().encode(&text).unwrap();
    ids.truncate(4096);
    assert_eq!(imp.info.tokens, ids.len() as u64);
    let mut sess = model.session(64, 1).unwrap();
    for (site, matrix) in [
        (
            "model.layers.1.mlp.down_proj.input",
            "layers.1.mlp.down.weight",
        ),
        (
            "model.layers.0.self_attn.o_proj.input",
            "layers.0.attn.o.weight",
        ),
    ] {
        let mut sums = vec![0f64; imp.columns[matrix].len()];
        for w in ids.chunks(64) {
            sess.reset();
            let mut rec = Recorder {
                only: vec![site.into()],
                records: vec![],
            };
            sess.forward(w, Logits::None, Some(&mut rec)).unwrap();
            let (shape, data) = rec.get(site).unwrap();
            for row in data.chunks_exact(shape[1]) {
                for (s, &x) in sums.iter_mut().zip(row) {
                    *s += f64::from(x) * f64::from(x);
                }
            }
        }
        for (j, (s, &got)) in sums.iter().zip(&imp.columns[matrix]).enumerate() {
            let want = (s / ids.len() as f64) as f32;
            assert!((got - want).abs() <= 1e-5 * want.max(1e-6), "{matrix}[{j}]");
        }
    }

    // Deterministic, and the file round-trips.
    let again = calibrate(&file, &text, &options(true), &NoProgress).unwrap();
    assert_eq!(again, imp);
    let saved = dir.path().join("imp.safetensors");
    imp.save(&saved, false).unwrap();
    assert_eq!(Importance::load(&saved).unwrap(), imp);
}

#[test]
fn tied_embeddings_take_the_output_side_importance() {
    let dir = tempfile::tempdir().unwrap();
    let path = convert("llama-tied-f32", dir.path());
    let file = KilnFile::open(&path).unwrap();
    let sites = matrix_sites(&file);
    assert_eq!(sites["embed.weight"], "model.norm.output");
    assert!(!sites.contains_key("lm_head.weight"));
}

#[test]
fn calibrated_quantization_runs_end_to_end_and_is_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let path = convert("qwen2-bias-f32", dir.path());
    let file = KilnFile::open(&path).unwrap();
    let imp = calibrate(&file, &corpus(), &options(true), &NoProgress).unwrap();
    for method in [Method::Search, Method::Gptq] {
        let out = dir.path().join(format!("{method}.kiln"));
        let mut o = QuantizeOptions::new(&path, &out, Policy::new(DType::Q4_0, vec![]).unwrap());
        o.method = method;
        o.importance = Some(imp.clone());
        let report = quantize_file(&o, &NoProgress).unwrap();
        assert!(report.tensors.iter().any(|t| t.to == DType::Q4_0));
        let q = KilnFile::open(&out).unwrap();
        assert!(q.verify_checksums(&|_| {}).is_empty());
        // Q4_0 matrices of whole sixteen-row groups are stored interleaved, by the
        // error-compensating path (GPTQ) as by the row chunks; the report's error, recomputed
        // from what a reader decodes, shows the rows were put back in their places.
        assert!(q.tensors().iter().any(|t| t.dtype == DType::Q4_0x16));
        for t in report.tensors.iter().filter(|t| t.to == DType::Q4_0) {
            let stored = q.info(&t.name).unwrap().dtype;
            assert_eq!(stored, DType::Q4_0.storage_for(&t.shape), "{}", t.name);
            assert_eq!(t.stored_as, stored, "{}", t.name);
            let x = file.tensor(&t.name).unwrap().to_f32_vec();
            let y = q.tensor(&t.name).unwrap().to_f32_vec();
            let mut s = kiln_quantize::ErrorStats::default();
            s.add(&x, &y);
            assert!(
                (s.rmse() - t.rmse).abs() <= 1e-9 * t.rmse,
                "{method} {}: {} vs {}",
                t.name,
                s.rmse(),
                t.rmse
            );
        }
        let step = q.metadata().provenance.last().unwrap();
        let cal = &step.details["quantization"]["calibration"];
        assert_eq!(cal["text_sha256"], imp.info.text_sha256);
        assert_eq!(cal["tokens"], imp.info.tokens);
        assert_eq!(step.details["quantization"]["method"], method.name());
        // The runner loads and runs it.
        let model = Model::load(&q).unwrap();
        let ids = Tokenizer::from_file(&q)
            .unwrap()
            .encode("the quick brown fox")
            .unwrap();
        let logits = model
            .session(64, 1)
            .unwrap()
            .forward(&ids, Logits::Last, None)
            .unwrap()
            .to_vec();
        assert!(logits.iter().all(|v| v.is_finite()));
    }
}

/// Compensated rounding inside the Q5 and IQ4_NL layouts (IQ4_NL's scales then refitted; the
/// tiny model's 64-column rows are too short for K-quant and IQ4_XS super-blocks; `gptq.rs`
/// and `refit.rs` test those): the file verifies, the report's error is
/// what a reader decodes, the weights stay within twice the weighted rule's error (the
/// compensation trades weight error for output error), and the runner runs it.
#[test]
fn compensated_rounding_in_q5_and_iq4_nl_layouts_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let path = convert("qwen2-bias-f32", dir.path());
    let file = KilnFile::open(&path).unwrap();
    let imp = calibrate(&file, &corpus(), &options(true), &NoProgress).unwrap();
    for dtype in [DType::Q5_0, DType::Q5_1, DType::IQ4_NL] {
        let mut rmse = Vec::new();
        for method in [Method::Search, Method::Gptq] {
            let out = dir.path().join(format!("{dtype}-{method}.kiln"));
            let mut o = QuantizeOptions::new(&path, &out, Policy::new(dtype, vec![]).unwrap());
            o.method = method;
            o.importance = Some(imp.clone());
            let report = quantize_file(&o, &NoProgress).unwrap();
            let q = KilnFile::open(&out).unwrap();
            assert!(q.verify_checksums(&|_| {}).is_empty());
            let mut total = 0.0f64;
            for t in report.tensors.iter().filter(|t| t.to == dtype) {
                let x = file.tensor(&t.name).unwrap().to_f32_vec();
                let y = q.tensor(&t.name).unwrap().to_f32_vec();
                let mut s = kiln_quantize::ErrorStats::default();
                s.add(&x, &y);
                assert!(
                    (s.rmse() - t.rmse).abs() <= 1e-9 * t.rmse,
                    "{dtype} {method} {}",
                    t.name
                );
                total += t.rmse;
            }
            assert!(total > 0.0, "{dtype}: some tensors quantized");
            rmse.push(total);
            assert_runs(&q);
        }
        // Compensation trades weight error for output error, within bounds: the weights move
        // no more than twice as far as the weighted rule moves them.
        assert!(rmse[1] < 2.0 * rmse[0], "{dtype}: {rmse:?}");
    }
}

#[test]
fn importance_from_another_model_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let untied = convert("llama-untied-bf16", dir.path());
    let tied = convert("llama-tied-f32", dir.path());
    let imp = calibrate(
        &KilnFile::open(&untied).unwrap(),
        &corpus(),
        &options(false),
        &NoProgress,
    )
    .unwrap();
    let out = dir.path().join("out.kiln");
    let mut o = QuantizeOptions::new(&tied, &out, Policy::new(DType::Q4_0, vec![]).unwrap());
    o.method = Method::Search;
    o.importance = Some(imp);
    let e = quantize_file(&o, &NoProgress).unwrap_err();
    assert!(e.to_string().contains("lm_head.weight"), "{e}");
    assert!(!out.exists());
}

#[test]
fn too_little_text_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = convert("llama-tied-f32", dir.path());
    let file = KilnFile::open(&path).unwrap();
    let e = calibrate(&file, "hi", &options(false), &NoProgress).unwrap_err();
    assert!(matches!(e, QuantizeError::CalibrationText { .. }), "{e}");
    assert!(e.to_string().contains("too little text"), "{e}");
}

/// `--to auto`: the plan fits the budget, the file is what the plan chose and fits too (each
/// matrix's output error recomputed here from what a reader decodes, through the
/// calibration's second moments), its summed KL-weighed error is at most that of the uniform
/// type of the same size, a looser budget buys less error, and a budget below the smallest
/// file is refused with that size.
#[test]
fn size_budget_fits_and_spends_bytes_where_the_kl_divergence_is() {
    let dir = tempfile::tempdir().unwrap();
    let path = convert("qwen2-bias-f32", dir.path());
    let file = KilnFile::open(&path).unwrap();
    let imp = calibrate(&file, &corpus(), &options(true), &NoProgress).unwrap();
    // Each matrix's output error in `q`, by name.
    let output_error = |q: &KilnFile| -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        for t in file
            .tensors()
            .iter()
            .filter(|t| imp.sites.contains_key(&t.name))
        {
            let mut sum = 0.0f64;
            let h = imp.moment(&t.name).unwrap();
            let cols = *t.shape.last().unwrap() as usize;
            let x = file.tensor(&t.name).unwrap().to_f32_vec();
            let y = q.tensor(&t.name).unwrap().to_f32_vec();
            for (xr, yr) in x.chunks(cols).zip(y.chunks(cols)) {
                let e: Vec<f64> = xr.iter().zip(yr).map(|(a, b)| f64::from(a - b)).collect();
                for i in 0..cols {
                    for j in 0..cols {
                        sum += e[i] * f64::from(h[i * cols + j]) * e[j];
                    }
                }
            }
            out.insert(t.name.clone(), sum);
        }
        out
    };
    let quantize = |policy: Policy, name: &str| {
        let out = dir.path().join(name);
        let mut o = QuantizeOptions::new(&path, &out, policy);
        o.method = Method::Gptq;
        o.importance = Some(imp.clone());
        let report = quantize_file(&o, &NoProgress).unwrap();
        (report, KilnFile::open(&out).unwrap())
    };
    let (uniform, uq) = quantize(Policy::new(DType::Q5_0, vec![]).unwrap(), "q5_0.kiln");
    let mut errors = Vec::new();
    let mut gains = BTreeMap::new();
    // Each planned matrix's error as Q5_0 (the embedding's included: it is no calibration
    // site, so only the plan's probe weighs it).
    let mut q5_0 = BTreeMap::new();
    for bpw in [uniform.bits_per_weight_out, 7.0] {
        let auto = Policy::auto(vec![]).with_importance(true);
        let plan = budget::plan(
            &path,
            &auto,
            Method::Gptq,
            &imp,
            Budget::Bpw(bpw),
            &NoProgress,
        )
        .unwrap();
        assert!(plan.total_bytes <= plan.budget_bytes, "{bpw}");
        assert!(plan.bits_per_weight() <= bpw + 1e-9, "{bpw}");
        let (report, q) = quantize(plan.apply(auto), &format!("auto-{bpw}.kiln"));
        assert_eq!(report.to, "auto");
        assert!(report.bits_per_weight_out <= bpw + 1e-9, "{bpw}");
        assert!(q.verify_checksums(&|_| {}).is_empty());
        // Every matrix's error was weighed in KL-divergence on the calibration's first tokens.
        assert_eq!(plan.probe_tokens, 256, "{bpw}");
        for c in &plan.choices {
            let t = report.tensors.iter().find(|t| t.name == c.tensor).unwrap();
            assert_eq!(t.to, c.candidate().dtype, "{}", t.name);
            assert!(t.rule.starts_with("auto: KL-divergence"), "{}", t.rule);
            let g = c.gain.unwrap();
            assert!(g.is_finite() && g > 0.0, "{}: gain {g}", c.tensor);
            gains.insert(c.tensor.clone(), g);
            let as_q5_0 = c.candidates.iter().find(|k| k.dtype == DType::Q5_0);
            q5_0.insert(c.tensor.clone(), as_q5_0.expect("a Q5_0 candidate").error);
        }
        let file_errors = output_error(&q);
        // The plan's own errors (over the matrices calibration fed) are what the file holds.
        for c in plan
            .choices
            .iter()
            .filter(|c| imp.sites.contains_key(&c.tensor))
        {
            let e = file_errors[&c.tensor] * gains[&c.tensor];
            let planned = c.candidate().error;
            assert!(
                (e - planned).abs() <= 1e-3 * e,
                "{bpw} {}: file {e} vs plan {planned}",
                c.tensor
            );
        }
        errors.push(plan.total_error());
        assert_runs(&q);
    }
    // The uniform file holds the errors the plan measured for Q5_0.
    for (name, e) in output_error(&uq) {
        let (e, planned) = (e * gains[&name], q5_0[&name]);
        assert!(
            (e - planned).abs() <= 1e-3 * e,
            "{name}: file {e} vs plan {planned}"
        );
    }
    let e_uniform: f64 = q5_0.values().sum();
    assert!(
        errors[0] <= e_uniform,
        "{} vs uniform q5_0 {e_uniform}",
        errors[0]
    );
    assert!(errors[1] < errors[0], "{errors:?}");
    // Too small for any file: refused, naming the file and the smallest size.
    let auto = Policy::auto(vec![]).with_importance(true);
    let e = budget::plan(
        &path,
        &auto,
        Method::Gptq,
        &imp,
        Budget::Bpw(1.0),
        &NoProgress,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("qwen2-bias-f32.kiln") && e.contains("smallest file"),
        "{e}"
    );
    // A byte budget: the whole output file fits it.
    let size = std::fs::metadata(dir.path().join("q5_0.kiln"))
        .unwrap()
        .len();
    let plan = budget::plan(
        &path,
        &auto,
        Method::Gptq,
        &imp,
        Budget::MaxBytes(size),
        &NoProgress,
    )
    .unwrap();
    let (_, _) = quantize(plan.apply(auto), "auto-bytes.kiln");
    let written = std::fs::metadata(dir.path().join("auto-bytes.kiln"))
        .unwrap()
        .len();
    assert!(written <= size, "{written} > {size}");
}

/// Mean KL-divergence per row from `p`'s softmax to `q`'s (logits of `vocab` columns).
fn mean_kl(p: &[f32], q: &[f32], vocab: usize) -> f64 {
    let log_softmax = |v: &[f32]| -> Vec<f64> {
        let max = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = v.iter().map(|&x| f64::from(x - max).exp()).sum();
        v.iter().map(|&x| f64::from(x - max) - sum.ln()).collect()
    };
    let rows = p.len() / vocab;
    let mut total = 0.0;
    for (a, b) in p.chunks(vocab).zip(q.chunks(vocab)) {
        let (a, b) = (log_softmax(a), log_softmax(b));
        total += a
            .iter()
            .zip(&b)
            .map(|(x, y)| x.exp() * (x - y))
            .sum::<f64>();
    }
    total / rows as f64
}

/// The probe adds one matrix's rounding error to the forward pass; that must cost what running
/// the model with that matrix alone quantized costs, for every kind of matrix (q/k/v with
/// biases, o, gate/up, down, an untied output, an untied embedding, and a tied embedding with
/// Gemma's embedding scale, which is both).
#[test]
fn the_probe_costs_one_matrix_as_the_quantized_model_does() {
    for fixture in ["gemma3-f32", "qwen2-bias-f32"] {
        let dir = tempfile::tempdir().unwrap();
        let path = convert(fixture, dir.path());
        let file = KilnFile::open(&path).unwrap();
        let model = Model::load(&file).unwrap();
        let tokens = Tokenizer::from_file(&file)
            .unwrap()
            .encode(&corpus())
            .unwrap()[..40]
            .to_vec();
        let vocab = model.config.vocab;
        let logits = |m: &Model| -> Vec<f32> {
            m.session(tokens.len(), 2)
                .unwrap()
                .forward(&tokens, Logits::All, None)
                .unwrap()
                .to_vec()
        };
        let base = logits(&model);
        let mut probe = Probe::new(&file, &model, &tokens, 2).unwrap().unwrap();
        assert_eq!(probe.tokens(), tokens.len());
        // An importance file's token ids are checked against the model's vocabulary.
        let e = Probe::new(&file, &model, &[0, vocab as u32], 2)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("{fixture}.kiln")) && e.contains("outside"),
            "{e}"
        );
        let matrices: Vec<String> = file
            .tensors()
            .iter()
            .filter(|t| t.shape.len() == 2 && probe.covers(&t.name))
            .map(|t| t.name.clone())
            .collect();
        assert!(matrices.len() >= 8, "{fixture}: {matrices:?}");
        for name in &matrices {
            let out = dir.path().join("one.kiln");
            let policy = Policy::new(
                DType::Q4_0,
                vec![
                    Override::parse("*=f32").unwrap(),
                    Override::parse(&format!("{name}=q4_0")).unwrap(),
                ],
            )
            .unwrap();
            let mut o = QuantizeOptions::new(&path, &out, policy);
            o.overwrite = true;
            quantize_file(&o, &NoProgress).unwrap();
            let q = KilnFile::open(&out).unwrap();
            let w = file.tensor(name).unwrap().to_f32_vec();
            let delta: Vec<f32> = q
                .tensor(name)
                .unwrap()
                .to_f32_vec()
                .iter()
                .zip(&w)
                .map(|(a, b)| a - b)
                .collect();
            let cols = *file.info(name).unwrap().shape.last().unwrap() as usize;
            let want = mean_kl(&base, &logits(&Model::load(&q).unwrap()), vocab);
            let got = probe.kl(name, &delta, cols).unwrap();
            assert!(want > 0.0, "{fixture} {name}: quantizing changed nothing");
            assert!(
                (got - want).abs() <= 0.05 * want,
                "{fixture} {name}: probe {got:.4e}, quantized model {want:.4e}"
            );
        }
    }
}
