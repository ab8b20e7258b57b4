//! `kiln-verify layers` as a front end asks for it: [`LayersRequest`] holds the subcommand's
//! flags and [`layers`] does what the command line does with them (the tolerance class, the
//! results files checked before any work, the model's checksums, the comparison, JUnit and
//! HTML results), so the command line and the Python package give the same verdicts and
//! refuse the same requests with the same messages. Printing is the front end's.

use std::path::{Path, PathBuf};

use kiln_format::args;

use crate::dump::Dump;
use crate::error::Result;
use crate::layers::{verify_layers, LayersReport};
use crate::tolerance::{Tolerance, WeightClass};
use crate::{junit, report};

/// The flags of `kiln-verify layers`.
#[derive(Debug, Clone, Default)]
pub struct LayersRequest {
    /// The `.kiln` model.
    pub model: PathBuf,
    /// `--reference`: the reference dump.
    pub reference: PathBuf,
    /// `--max-nmse`: overrides the tolerance's largest NMSE.
    pub max_nmse: Option<f64>,
    /// `--min-top1`: overrides the tolerance's smallest top-1 agreement.
    pub min_top1: Option<f64>,
    /// `--tolerance`: a tolerance class by name instead of the file's own.
    pub tolerance: Option<String>,
    /// `--threads`, already capped at the CPUs available
    /// ([`kiln_runner::threads::cap_threads`]); `None`: the machine's physical cores.
    pub threads: Option<usize>,
    /// `--junit`: also write the results as JUnit XML.
    pub junit: Option<PathBuf>,
    /// `--report`: also write an HTML page.
    pub report: Option<PathBuf>,
}

/// `--max-nmse`: a finite number, at least 0.
pub fn max_nmse_arg() -> impl Fn(&str) -> std::result::Result<f64, String> + Clone + Send + Sync {
    args::non_negative::<f64>()
}

/// `--min-top1`: 0 to 1.
pub fn min_top1_arg() -> impl Fn(&str) -> std::result::Result<f64, String> + Clone + Send + Sync {
    args::fraction::<f64>()
}

/// `--threads`: at least 1.
pub fn threads_arg() -> impl Fn(&str) -> std::result::Result<usize, String> + Clone + Send + Sync {
    args::at_least::<usize>(1)
}

/// Run `kiln-verify layers`: a model out of tolerance is an `Ok` report whose `pass` is
/// false; an error is a check that could not run (exit status 2).
pub fn layers(req: &LayersRequest) -> Result<LayersReport> {
    let t0 = std::time::Instant::now();
    let class = req
        .tolerance
        .as_deref()
        .map(WeightClass::from_name)
        .transpose()?;
    let results: Vec<&Path> = [&req.junit, &req.report]
        .into_iter()
        .filter_map(|p| p.as_deref())
        .collect();
    for p in &results {
        kiln_format::check_destination(p, true)?;
    }
    kiln_format::refuse_clobbering(&results, &[&req.model, &req.reference])?;
    // The data under test must be the data the file claims: checksums first.
    let f = kiln_runner::open_model_verified(&req.model, true)?;
    let d = Dump::load(&req.reference)?;
    let default = Tolerance::for_class(class.unwrap_or_else(|| WeightClass::of_file(&f)));
    let overridden = class.is_some() || req.max_nmse.is_some() || req.min_top1.is_some();
    let tol = overridden.then(|| Tolerance {
        max_nmse: req.max_nmse.unwrap_or(default.max_nmse),
        min_top1: req.min_top1.unwrap_or(default.min_top1),
    });
    let threads = req
        .threads
        .unwrap_or_else(kiln_runner::threads::physical_cores);
    let r = verify_layers(&f, &d, tol, threads)?;
    if let Some(p) = &req.junit {
        junit::write(p, &[junit::layers_suite(&r, t0.elapsed().as_secs_f64())])?;
    }
    if let Some(p) = &req.report {
        report::write(p, &report::layers_html(&r))?;
    }
    Ok(r)
}
