//! One conversion from a source and a destination path, for front ends that take no
//! subcommand (the Python package's `kiln.convert`): [`Direction::of`] chooses what
//! `kiln-convert` would be asked to do (`hf`, `gguf` or `export-gguf`) and [`convert`] runs
//! exactly that subcommand's library function with its flags ([`Request`]).

use std::io::Read;
use std::path::{Path, PathBuf};

use kiln_format::DType;

use crate::error::{ConvertError, Result};
use crate::gguf::{
    export_gguf, import_gguf, ExportOptions, ExportSummary, ImportOptions, ImportSummary,
};
use crate::hf::{convert_hf, ConvertOptions, ConvertSummary};
use crate::Progress;
use Direction::{ExportGguf, Hf, ImportGguf};

/// The float dtypes `--dtype` and `--dequantize-to` take, by the names they take.
pub const FLOAT_DTYPES: [(&str, DType); 3] = [
    ("f32", DType::F32),
    ("f16", DType::F16),
    ("bf16", DType::BF16),
];

/// A float dtype by its command-line name, for the flag `flag` (`--dtype`).
pub fn float_dtype(flag: &str, name: &str) -> Result<DType> {
    FLOAT_DTYPES
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|&(_, d)| d)
        .ok_or_else(|| ConvertError::BadOption {
            option: format!("{flag} {name}"),
            reason: "possible values: f32, f16, bf16".into(),
        })
}

/// Which subcommand of `kiln-convert` a (source, destination) pair stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// `kiln-convert hf`: a Hugging Face checkpoint directory to `.kiln`.
    Hf,
    /// `kiln-convert gguf`: a GGUF file to `.kiln`.
    ImportGguf,
    /// `kiln-convert export-gguf`: a `.kiln` file to GGUF.
    ExportGguf,
}

impl Direction {
    /// A destination ending in `.gguf` is an export; a source ending in `.gguf`, or a file
    /// starting with GGUF's magic, is an import; anything else is a checkpoint directory
    /// (a missing one then fails as `kiln-convert hf` fails on it).
    pub fn of(src: &Path, dst: &Path) -> Direction {
        let is_gguf = |p: &Path| {
            p.extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        };
        if is_gguf(dst) {
            Direction::ExportGguf
        } else if is_gguf(src) || starts_with_gguf_magic(src) {
            Direction::ImportGguf
        } else {
            Direction::Hf
        }
    }

    /// The subcommand's name.
    pub fn name(self) -> &'static str {
        match self {
            Direction::Hf => "hf",
            Direction::ImportGguf => "gguf",
            Direction::ExportGguf => "export-gguf",
        }
    }
}

/// Whether `path` is a regular file whose first four bytes are `GGUF`.
fn starts_with_gguf_magic(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    path.is_file()
        && std::fs::File::open(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
        && &magic == b"GGUF"
}

/// The flags of `kiln-convert`'s three conversions, each at its default.
#[derive(Debug, Clone)]
pub struct Request {
    /// The checkpoint directory, GGUF file or `.kiln` file.
    pub input: PathBuf,
    /// The file to write.
    pub output: PathBuf,
    /// `hf --dtype`: `None` keeps each tensor's dtype.
    pub dtype: Option<DType>,
    /// `gguf --dequantize-to` (default f16).
    pub dequantize_to: DType,
    /// `gguf --dequantize-all`.
    pub dequantize_all: bool,
    /// `--force`: replace an existing output.
    pub force: bool,
    /// `hf`/`gguf --allow-non-finite`.
    pub allow_non_finite: bool,
}

impl Request {
    /// `input` to `output`, every flag at its default.
    pub fn new(input: impl Into<PathBuf>, output: impl Into<PathBuf>) -> Request {
        Request {
            input: input.into(),
            output: output.into(),
            dtype: None,
            dequantize_to: DType::F16,
            dequantize_all: false,
            force: false,
            allow_non_finite: false,
        }
    }
}

/// What a conversion did: the summary of the subcommand that ran (`--json` prints it).
#[derive(Debug, Clone, serde::Serialize)]
#[serde(untagged)]
pub enum Summary {
    /// From [`convert_hf`].
    Hf(ConvertSummary),
    /// From [`import_gguf`].
    ImportGguf(ImportSummary),
    /// From [`export_gguf`].
    ExportGguf(ExportSummary),
}

/// Run the conversion [`Direction::of`] chooses, refusing a flag that subcommand has not.
pub fn convert(req: &Request, progress: &dyn Progress) -> Result<Summary> {
    let direction = Direction::of(&req.input, &req.output);
    let refuse = |flag: &str, given: bool, has: &[Direction]| {
        if given && !has.contains(&direction) {
            return Err(ConvertError::BadOption {
                option: flag.to_string(),
                reason: format!("`kiln-convert {}` takes no such option", direction.name()),
            });
        }
        Ok(())
    };
    refuse("--dtype", req.dtype.is_some(), &[Hf])?;
    refuse(
        "--dequantize-to",
        req.dequantize_to != DType::F16,
        &[ImportGguf],
    )?;
    refuse("--dequantize-all", req.dequantize_all, &[ImportGguf])?;
    refuse(
        "--allow-non-finite",
        req.allow_non_finite,
        &[Hf, ImportGguf],
    )?;
    let (input, output, overwrite) = (req.input.clone(), req.output.clone(), req.force);
    Ok(match direction {
        Hf => Summary::Hf(convert_hf(
            &ConvertOptions {
                input,
                output,
                dtype: req.dtype,
                overwrite,
                allow_non_finite: req.allow_non_finite,
            },
            progress,
        )?),
        ImportGguf => Summary::ImportGguf(import_gguf(
            &ImportOptions {
                input,
                output,
                overwrite,
                dequantize_to: req.dequantize_to,
                dequantize_all: req.dequantize_all,
                allow_non_finite: req.allow_non_finite,
            },
            progress,
        )?),
        ExportGguf => Summary::ExportGguf(export_gguf(
            &ExportOptions {
                input,
                output,
                overwrite,
            },
            progress,
        )?),
    })
}
