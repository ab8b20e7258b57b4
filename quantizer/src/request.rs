//! A whole run as a front end asks for it: [`Request`] holds `kiln-quantize`'s flags, and
//! [`run`] validates them into [`QuantizeOptions`] and does what the command line does
//! (importance, calibration, the `--to auto` budget, the file), so the command line and the
//! Python package refuse the same requests with the same messages and write the same bytes.
//!
//! The numeric flags' ranges are here too ([`calib_tokens_arg`] and the others): clap parses
//! the command line with them, and other front ends check their numbers with the same
//! functions.

use std::ops::Bound;
use std::path::{Path, PathBuf};

use kiln_format::{args, DType, QK_K};

use crate::budget::{self, Budget};
use crate::calibrate::{self, calibrate_path, CalibrationOptions};
use crate::error::{QuantizeError, Result};
use crate::importance::Importance;
use crate::method::Method;
use crate::options::QuantizeOptions;
use crate::pipeline::quantize_file;
use crate::policy::{Mix, Override, Policy, Target, TARGETS};
use crate::report::{Progress, Report};

/// A quantization as the command line states it, before validation: one field per flag.
#[derive(Debug, Clone)]
pub struct Request {
    /// The source `.kiln`.
    pub input: PathBuf,
    /// The `.kiln` to write (atomically; never the input).
    pub output: PathBuf,
    /// `--to`: a dtype, a mix or `auto`.
    pub to: String,
    /// `--method`: `reference`, `search` or `gptq`; `None` chooses by calibration.
    pub method: Option<String>,
    /// `--calibrate`: the calibration text.
    pub calibrate: Option<PathBuf>,
    /// `--calib-tokens`.
    pub calib_tokens: usize,
    /// `--calib-ctx`.
    pub calib_ctx: usize,
    /// `--importance`: a file saved by `--save-importance`.
    pub importance: Option<PathBuf>,
    /// `--save-importance`.
    pub save_importance: Option<PathBuf>,
    /// `--bpw` (with `--to auto`).
    pub bpw: Option<f64>,
    /// `--max-bytes` (with `--to auto`).
    pub max_bytes: Option<u64>,
    /// `--keep PATTERN=DTYPE`, in order.
    pub keep: Vec<String>,
    /// `--threads`, already capped at the CPUs available ([`kiln_runner::threads::cap_threads`]).
    pub threads: Option<usize>,
    /// `--force`.
    pub force: bool,
}

impl Request {
    /// `input` to `output` as `to`, every other flag at the command line's default.
    pub fn new(input: impl Into<PathBuf>, output: impl Into<PathBuf>, to: &str) -> Request {
        Request {
            input: input.into(),
            output: output.into(),
            to: to.to_string(),
            method: None,
            calibrate: None,
            calib_tokens: calibrate::DEFAULT_TOKENS,
            calib_ctx: calibrate::DEFAULT_CTX,
            importance: None,
            save_importance: None,
            bpw: None,
            max_bytes: None,
            keep: Vec::new(),
            threads: None,
            force: false,
        }
    }
}

/// `--calib-tokens`: 64 to [`calibrate::MAX_TOKENS`].
pub fn calib_tokens_arg(
) -> impl Fn(&str) -> std::result::Result<usize, String> + Clone + Send + Sync + 'static {
    args::whole::<usize>(64, calibrate::MAX_TOKENS as u64)
}

/// `--calib-ctx`: 16 to a million tokens.
pub fn calib_ctx_arg(
) -> impl Fn(&str) -> std::result::Result<usize, String> + Clone + Send + Sync + 'static {
    args::whole::<usize>(16, 1_000_000)
}

/// `--bpw`: above 0, at most 32 bits per weight.
pub fn bpw_arg() -> impl Fn(&str) -> std::result::Result<f64, String> + Clone + Send + Sync + 'static
{
    args::real::<f64>(Bound::Excluded(0.0), Bound::Included(32.0))
}

/// `--max-bytes`: at least 1.
pub fn max_bytes_arg(
) -> impl Fn(&str) -> std::result::Result<u64, String> + Clone + Send + Sync + 'static {
    args::at_least::<u64>(1)
}

/// `--threads`: 1 to 1024.
pub fn threads_arg(
) -> impl Fn(&str) -> std::result::Result<u32, String> + Clone + Send + Sync + 'static {
    args::whole::<u32>(1, 1024)
}

/// Do what `kiln-quantize` does for `req`: validate, refuse outputs that would replace an
/// input, load or measure importance, plan the budget, quantize. Notices (what calibration
/// and the budget found) go to [`Progress::notice`].
pub fn run(req: &Request, progress: &dyn Progress) -> Result<Report> {
    let mut options = options(req)?;
    check_outputs(req)?;
    if let Some(path) = &req.importance {
        load_importance(req, path, &mut options)?;
    }
    if let Some(text) = &req.calibrate {
        calibrate(req, text, &mut options, progress)?;
    }
    if let Some(budget) = budget_of(req) {
        options = plan_budget(req, budget, options, progress)?;
    }
    quantize_file(&options, progress)
}

/// The flags validated into [`QuantizeOptions`].
fn options(req: &Request) -> Result<QuantizeOptions> {
    let overrides = req
        .keep
        .iter()
        .map(|k| Override::parse(k))
        .collect::<Result<Vec<_>>>()?;
    let auto = req.to.eq_ignore_ascii_case("auto");
    let calibrated = req.calibrate.is_some() || req.importance.is_some();
    check_budget_flags(req, auto, calibrated)?;
    let policy = match Mix::parse(&req.to) {
        _ if auto => Policy::auto(overrides),
        Some(mix) => Policy::mix(mix, overrides),
        None => {
            let to = DType::parse(&req.to)
                .filter(|d| TARGETS.contains(d))
                .ok_or_else(|| QuantizeError::BadTarget {
                    dtype: req.to.clone(),
                })?;
            Policy::new(to, overrides)?
        }
    };
    let policy = policy.with_importance(calibrated);
    let method = method(req, calibrated)?;
    check_ggml_only_types(&policy, method, calibrated)?;
    let mut o = QuantizeOptions::new(&req.input, &req.output, policy);
    o.method = method;
    o.threads = req.threads;
    o.overwrite = req.force;
    Ok(o)
}

/// `--to auto` needs a size budget (`--bpw` or `--max-bytes`) and calibration; a budget
/// needs `--to auto`.
fn check_budget_flags(req: &Request, auto: bool, calibrated: bool) -> Result<()> {
    let budget_flag = match (req.bpw, req.max_bytes) {
        (Some(_), _) => Some("--bpw"),
        (_, Some(_)) => Some("--max-bytes"),
        _ => None,
    };
    match (auto, budget_flag) {
        (true, None) => {
            return Err(QuantizeError::BadArgument {
                arg: "--to auto".into(),
                reason: "give the size to fit: --bpw B (bits per weight, e.g. 4.5) or \
                         --max-bytes N"
                    .into(),
            })
        }
        (false, Some(flag)) => {
            return Err(QuantizeError::BadArgument {
                arg: flag.into(),
                reason: format!(
                    "a size budget goes with --to auto (this run has --to {})",
                    req.to
                ),
            })
        }
        _ => {}
    }
    if auto && !calibrated {
        return Err(QuantizeError::BadArgument {
            arg: "--to auto".into(),
            reason: "the types are chosen from calibration: add --calibrate TEXT (or \
                     --importance FILE)"
                .into(),
        });
    }
    Ok(())
}

/// The rounding method: `--method`, or by default GPTQ with calibration and GGML's
/// reference rule without; GPTQ without calibration and the reference rule with it are
/// refused.
fn method(req: &Request, calibrated: bool) -> Result<Method> {
    let method = match &req.method {
        // Downgraded to `search` in `load_importance` if the file has no second moments.
        None if calibrated => Method::Gptq,
        None => Method::Reference,
        Some(m) => Method::parse(m).ok_or_else(|| QuantizeError::BadOverride {
            arg: format!("--method {m}"),
            reason: "use `reference` or `search`".into(),
        })?,
    };
    if method == Method::Gptq && !calibrated {
        return Err(QuantizeError::BadOverride {
            arg: "--method gptq".into(),
            reason: "error-compensating rounding needs calibration: add --calibrate TEXT \
                     (or --importance FILE saved by a --method gptq calibration)"
                .into(),
        });
    }
    if calibrated && method == Method::Reference {
        return Err(QuantizeError::BadOverride {
            arg: "--method reference".into(),
            reason: "the reference method is GGML's fixed rule and ignores importance; drop \
                     --method (or use `search`) with --calibrate/--importance"
                .into(),
        });
    }
    Ok(method)
}

/// Types that have only GGML's rules (K-quants, Q5_0, Q5_1, IQ4_NL) take no `--method`
/// without calibration.
fn check_ggml_only_types(policy: &Policy, method: Method, calibrated: bool) -> Result<()> {
    let ggml_only = std::iter::once(policy.to)
        .chain(policy.overrides.iter().filter_map(|o| match o.target {
            Target::DType(d) => Some(d),
            Target::Copy => None,
        }))
        .find(|d| d.block_len() == QK_K || matches!(d, DType::Q5_0 | DType::Q5_1 | DType::IQ4_NL));
    // Without calibration these types have only GGML's reference rule; with it, any method
    // other than `reference` gives them GGML's importance-weighted rule (llama.cpp's imatrix).
    if let (Some(d), false, false) = (ggml_only, method == Method::Reference, calibrated) {
        return Err(QuantizeError::BadOverride {
            arg: format!("--method {}", method.name()),
            reason: format!(
                "{} blocks are made by GGML's reference rule, or its importance-weighted rule \
                 with --calibrate/--importance; drop --method",
                d.name()
            ),
        });
    }
    Ok(())
}

/// Before an hour of calibration, not after it: no output may replace anything this run
/// reads (the model, the calibration text, the importance file) or another output.
fn check_outputs(req: &Request) -> Result<()> {
    let outputs: Vec<&Path> = std::iter::once(req.output.as_path())
        .chain(req.save_importance.as_deref())
        .collect();
    let inputs: Vec<&Path> = std::iter::once(req.input.as_path())
        .chain(req.calibrate.as_deref())
        .chain(req.importance.as_deref())
        .collect();
    kiln_format::refuse_clobbering(&outputs, &inputs)?;
    for out in &outputs {
        kiln_format::check_destination(out, req.force)?;
    }
    Ok(())
}

/// `--importance`: read the file; without second moments the method defaults to search, and
/// GPTQ is refused.
fn load_importance(req: &Request, path: &Path, options: &mut QuantizeOptions) -> Result<()> {
    let importance = Importance::load(path)?;
    if req.method.is_none() && importance.moments.is_empty() {
        options.method = Method::Search;
    }
    if options.method == Method::Gptq && importance.moments.is_empty() {
        return Err(QuantizeError::ImportanceMismatch {
            file: path.display().to_string(),
            reason: "--method gptq needs second moments, and this file has none; \
                     calibrate again with --method gptq --save-importance"
                .into(),
        });
    }
    options.importance = Some(importance);
    Ok(())
}

/// `--calibrate`: measure the importance on `text` (and with `--save-importance` keep it).
fn calibrate(
    req: &Request,
    text: &Path,
    options: &mut QuantizeOptions,
    progress: &dyn Progress,
) -> Result<()> {
    let calibration = CalibrationOptions {
        max_tokens: req.calib_tokens,
        ctx: req.calib_ctx,
        threads: options
            .threads
            .unwrap_or_else(kiln_runner::threads::physical_cores),
        second_moments: options.method == Method::Gptq,
    };
    let start = std::time::Instant::now();
    let importance = calibrate_path(&req.input, text, &calibration, progress)?;
    progress.notice(&format!(
        "calibrated on {} tokens ({} windows of {}) in {:.1} s",
        importance.info.tokens,
        importance.info.chunks,
        importance.info.ctx,
        start.elapsed().as_secs_f64()
    ));
    if let Some(path) = &req.save_importance {
        importance.save(path, req.force)?;
    }
    options.importance = Some(importance);
    Ok(())
}

/// `--to auto`: choose each tensor's type within the budget and apply the plan to the policy.
fn plan_budget(
    req: &Request,
    budget: Budget,
    mut options: QuantizeOptions,
    progress: &dyn Progress,
) -> Result<QuantizeOptions> {
    let importance = options
        .importance
        .as_ref()
        .expect("--to auto requires calibration, checked in options()");
    let plan = budget::plan(
        &req.input,
        &options.policy,
        options.method,
        importance,
        budget,
        progress,
    )?;
    let weighed = match plan.probe_tokens {
        0 => "output errors not weighed in KL-divergence (the importance keeps no probe \
              tokens, or the model has no logits; calibrate again to weigh them)"
            .to_string(),
        n => format!("errors weighed in KL-divergence on {n} calibration tokens"),
    };
    progress.notice(&format!(
        "{budget}: {} bytes of tensor data ({:.3} bits per weight) of {} allowed; {}; {weighed}",
        plan.total_bytes,
        plan.bits_per_weight(),
        plan.budget_bytes,
        plan.summary()
    ));
    options.policy = plan.apply(options.policy);
    Ok(options)
}

/// The size budget `--bpw` or `--max-bytes` asks for.
fn budget_of(req: &Request) -> Option<Budget> {
    match (req.bpw, req.max_bytes) {
        (Some(b), _) => Some(Budget::Bpw(b)),
        (_, Some(n)) => Some(Budget::MaxBytes(n)),
        _ => None,
    }
}
