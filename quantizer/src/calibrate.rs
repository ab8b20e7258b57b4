//! The calibration pass: run the model over a text and measure what each matrix multiplies.
//!
//! The model is the file being quantized, run by the runner library (all threads) in windows
//! of `ctx` tokens, each from an empty KV cache (as `kiln-verify perplexity` does), with the
//! output matrix skipped except where its input is needed. An [`Observer`] receives the input
//! of every quantizable matrix — the normed residual for q/k/v and gate/up, the attention output
//! for o, `act(gate)·up` for down, the final norm's output for the output matrix (which is the
//! embedding matrix when they are tied) — and accumulates:
//!
//! - `Σ x_j²` per input column, in f64 (always);
//! - `Σ x·xᵀ` per input (when second moments are asked for), one `T×d` by `d×T` product per
//!   window, split over the threads by column blocks.
//!
//! Memory is bounded by the model's inputs, not the text: `O(d)` per site for column
//! importance, `O(d²)` per site for second moments. Results are deterministic for a given
//! model, text and settings (fixed window boundaries, fixed reduction order).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use kiln_format::{hex, KilnFile, NormPlace, Role, TensorName};
use kiln_runner::{Activation, Logits, Model, Observer, Tokenizer};
use ndarray::linalg::general_mat_mul;
use ndarray::{s, ArrayView2, ArrayViewMut2};
use rayon::prelude::*;
use sha2::{Digest, Sha256};

use crate::error::{QuantizeError, Result};
use crate::importance::{CalibrationInfo, Importance, PROBE_TOKENS};
use crate::report::{advance, Progress};

/// Default number of calibration tokens.
pub const DEFAULT_TOKENS: usize = 12 * 1024;
/// Most calibration tokens a run may ask for: a hundred times the default, far more than
/// importance statistics need, and a bound on the text read and tokenized for them.
pub const MAX_TOKENS: usize = 1_000_000;
/// Default window length.
pub const DEFAULT_CTX: usize = 512;

/// How to calibrate.
#[derive(Debug, Clone)]
pub struct CalibrationOptions {
    /// At most this many tokens of the text are used.
    pub max_tokens: usize,
    /// Window length (the KV cache is reset between windows).
    pub ctx: usize,
    /// Also measure the full second-moment matrices (for error-compensating rounding).
    pub second_moments: bool,
    /// Threads for the forward pass.
    pub threads: usize,
}

impl Default for CalibrationOptions {
    fn default() -> Self {
        CalibrationOptions {
            max_tokens: DEFAULT_TOKENS,
            ctx: DEFAULT_CTX,
            second_moments: false,
            threads: kiln_runner::threads::physical_cores(),
        }
    }
}

/// The input site of each quantizable matrix in `file`: matrix name → activation name.
pub fn matrix_sites(file: &KilnFile) -> BTreeMap<String, String> {
    let names: Vec<&str> = file.tensors().iter().map(|t| t.name.as_str()).collect();
    // The embedding is also the output projection of a tied generator; an embedding model's is
    // a lookup table only, which no input statistic describes.
    let tied = !names.contains(&Role::LmHead.suffix())
        && file.metadata().config.family.embedding.is_none();
    // Where the pre-MLP norm's output is reported: Gemma's `pre_feedforward_layernorm`.
    let post_norms = file.metadata().config.family.post_norms;
    // A post-norm block (BERT) reads the residual stream itself: the attention takes the
    // previous layer's output (the embeddings' for layer 0), the MLP the LayerNorm after the
    // attention's residual add.
    let post_place = file.metadata().config.family.norm_place == NormPlace::Post;
    let arch = file.metadata().config.architecture;
    let mut sites = BTreeMap::new();
    for name in names {
        let Some(t) = TensorName::parse(name) else {
            continue;
        };
        let l = t.layer.unwrap_or(0) as usize;
        let site = match t.role {
            Role::AttnQ | Role::AttnK | Role::AttnV if post_place => match l {
                0 => Activation::Embed,
                _ => Activation::Layer(l - 1),
            },
            Role::MlpUp if post_place => Activation::AttnNorm(l),
            Role::AttnQ | Role::AttnK | Role::AttnV => Activation::AttnNorm(l),
            Role::AttnO => Activation::AttnOut(l),
            Role::MlpGate | Role::MlpUp if post_norms => Activation::PreFfnNorm(l),
            Role::MlpGate | Role::MlpUp => Activation::MlpNorm(l),
            Role::MlpDown => Activation::DownIn(l),
            Role::LmHead => Activation::FinalNorm,
            Role::Embed if tied => Activation::FinalNorm,
            _ => continue,
        };
        sites.insert(name.to_string(), site.name(arch));
    }
    sites
}

/// Accumulates input statistics per site.
struct Collector {
    /// Site name → index into `sums`/`moments`.
    index: HashMap<String, usize>,
    sums: Vec<Vec<f64>>,
    moments: Vec<Vec<f32>>,
    second_moments: bool,
}

impl Observer for Collector {
    fn wants(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    fn record(&mut self, name: &str, data: &[f32], shape: [usize; 2]) {
        let Some(&i) = self.index.get(name) else {
            return;
        };
        let [rows, cols] = shape;
        let sums = &mut self.sums[i];
        if sums.is_empty() {
            *sums = vec![0.0; cols];
        }
        for row in data.chunks_exact(cols).take(rows) {
            for (s, &x) in sums.iter_mut().zip(row) {
                *s += f64::from(x) * f64::from(x);
            }
        }
        if self.second_moments {
            let m = &mut self.moments[i];
            if m.is_empty() {
                *m = vec![0.0; cols * cols];
            }
            accumulate_gram(&data[..rows * cols], rows, cols, m);
        }
    }
}

/// `g += xᵀ·x` for `x` of `rows × cols` (row-major), `g` of `cols × cols`; column blocks of `g`
/// go to different threads.
pub fn accumulate_gram(x: &[f32], rows: usize, cols: usize, g: &mut [f32]) {
    const BLOCK: usize = 64;
    let x = ArrayView2::from_shape((rows, cols), x).expect("rows × cols values");
    g.par_chunks_mut(BLOCK * cols)
        .enumerate()
        .for_each(|(b, gb)| {
            let r0 = b * BLOCK;
            let nr = gb.len() / cols;
            let mut gb = ArrayViewMut2::from_shape((nr, cols), gb).expect("nr × cols values");
            let xt = x.slice(s![.., r0..r0 + nr]).reversed_axes();
            general_mat_mul(1.0, &xt, &x, 1.0, &mut gb);
        });
}

/// Run `file`'s model over `text` and return the importance of every quantizable matrix.
pub fn calibrate(
    file: &KilnFile,
    text: &str,
    options: &CalibrationOptions,
    progress: &dyn Progress,
) -> Result<Importance> {
    let runner = model_error(file);
    let tokenizer = Tokenizer::from_file(file).map_err(&runner)?;
    let mut tokens = tokenizer.encode(text).map_err(&runner)?;
    tokens.truncate(options.max_tokens);
    let text_sha256 = Sha256::digest(text.as_bytes()).into();
    calibrate_tokens(file, &tokens, text_sha256, options, progress)
}

/// A runner failure while calibrating on `file`, named as the model's.
fn model_error(file: &KilnFile) -> impl Fn(kiln_runner::RunnerError) -> QuantizeError + '_ {
    move |e| QuantizeError::Calibration {
        file: file.label().to_string(),
        reason: e.to_string(),
    }
}

/// Run `file`'s model over `tokens` (of a text whose sha256 is `text_sha256`) and return the
/// importance of every quantizable matrix.
fn calibrate_tokens(
    file: &KilnFile,
    tokens: &[u32],
    text_sha256: [u8; 32],
    options: &CalibrationOptions,
    progress: &dyn Progress,
) -> Result<Importance> {
    let runner = model_error(file);
    let model = Model::load(file).map_err(&runner)?;
    let ctx = options.ctx.min(model.default_ctx()).max(1);
    if tokens.len() < ctx.min(64) {
        return Err(QuantizeError::CalibrationText {
            reason: format!(
                "{} tokens is too little text to calibrate on (at least {} are needed)",
                tokens.len(),
                ctx.min(64)
            ),
        });
    }
    let sites = matrix_sites(file);
    let mut index = HashMap::new();
    for s in sites.values() {
        let n = index.len();
        index.entry(s.clone()).or_insert(n);
    }
    let n_sites = index.len();
    let mut collector = Collector {
        index,
        sums: vec![Vec::new(); n_sites],
        moments: vec![Vec::new(); n_sites],
        second_moments: options.second_moments,
    };
    let mut session = model.session(ctx, options.threads).map_err(&runner)?;
    progress.phase("calibrating", tokens.len() as u64);
    let windows: Vec<&[u32]> = tokens.chunks(ctx).collect();
    for w in &windows {
        session.reset();
        session
            .forward(w, Logits::None, Some(&mut collector))
            .map_err(&runner)?;
        advance(progress, w.len() as u64)?;
    }
    let n = tokens.len() as f64;
    let mut by_site: HashMap<&str, usize> = HashMap::new();
    for (s, &i) in &collector.index {
        by_site.insert(s.as_str(), i);
    }
    let mut columns = BTreeMap::new();
    for (matrix, site) in &sites {
        let i = by_site[site.as_str()];
        columns.insert(
            matrix.clone(),
            collector.sums[i].iter().map(|&s| (s / n) as f32).collect(),
        );
    }
    let mut moments = BTreeMap::new();
    if options.second_moments {
        for (site, &i) in &collector.index {
            // In place: the sums become means without a second copy of every matrix.
            let mut m = std::mem::take(&mut collector.moments[i]);
            for v in &mut m {
                *v = (f64::from(*v) / n) as f32;
            }
            moments.insert(site.clone(), Arc::new(m));
        }
    }
    Ok(Importance {
        columns,
        sites,
        moments,
        info: CalibrationInfo {
            model_sha256: hex(&file.header_sha256()),
            text_sha256: hex(&text_sha256),
            tokens: tokens.len() as u64,
            chunks: windows.len() as u64,
            ctx: ctx as u64,
        },
        probe: tokens[..tokens.len().min(PROBE_TOKENS)].to_vec(),
    })
}

/// Run [`calibrate`] on the model at `model` over the calibration text at `text_path`, reading
/// and tokenizing only the part of the text that `options.max_tokens` needs (a long text costs
/// no more than that; the file must be a regular file).
pub fn calibrate_path(
    model: &Path,
    text_path: &Path,
    options: &CalibrationOptions,
    progress: &dyn Progress,
) -> Result<Importance> {
    let file = kiln_runner::open_model(model).map_err(|e| QuantizeError::Calibration {
        file: model.display().to_string(),
        reason: e.to_string(),
    })?;
    // The tokenizer is loaded once the text is known to be readable UTF-8, so the text's own
    // faults are reported first.
    let mut tokenizer = None;
    let mut encode = |text: &str| -> kiln_runner::Result<Vec<u32>> {
        if tokenizer.is_none() {
            tokenizer = Some(Tokenizer::from_file(&file)?);
        }
        tokenizer.as_ref().expect("loaded above").encode(text)
    };
    let text = kiln_runner::text_file::tokenize_file(
        &mut encode,
        text_path,
        Some(options.max_tokens),
        "calibration text",
    )
    .map_err(|e| match e {
        // The text's own faults (not a file, not UTF-8, unreadable) name the text.
        kiln_runner::RunnerError::Format(f) => QuantizeError::Format(f),
        kiln_runner::RunnerError::Io { source, .. } => QuantizeError::Io {
            file: text_path.display().to_string(),
            action: "cannot read the calibration text",
            source,
        },
        e => QuantizeError::Calibration {
            file: model.display().to_string(),
            reason: e.to_string(),
        },
    })?;
    calibrate_tokens(&file, &text.tokens, text.sha256, options, progress)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The plain definition of `accumulate_gram`.
    fn gram_reference(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        let mut g = vec![0.0f32; cols * cols];
        for i in 0..cols {
            for j in 0..cols {
                g[i * cols + j] = (0..rows).map(|t| x[t * cols + i] * x[t * cols + j]).sum();
            }
        }
        g
    }

    proptest! {
        #[test]
        fn gram_matches_reference(rows in 1usize..40, cols in 1usize..150, seed in any::<u64>()) {
            let mut s = seed | 1;
            let x: Vec<f32> = (0..rows * cols)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    (s % 2001) as f32 / 1000.0 - 1.0
                })
                .collect();
            let want = gram_reference(&x, rows, cols);
            let mut got = vec![0.5f32; cols * cols];
            accumulate_gram(&x, rows, cols, &mut got);
            for (g, w) in got.iter().zip(&want) {
                prop_assert!((g - 0.5 - w).abs() <= 1e-4 * (1.0 + w.abs()), "{g} vs {w}");
            }
        }
    }
}
