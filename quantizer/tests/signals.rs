//! `kiln-quantize` stopped by a signal while it writes its output: the temporary file is
//! removed, the stderr names the signal, and the exit status is 128 + the signal's number
//! (SIGTERM 143, SIGINT 130), the rule every Kiln program follows.
//!
//! The run is caught mid-write deterministically (format/tests/support/interrupt.rs).

mod common;
#[path = "../../format/tests/support/interrupt.rs"]
mod interrupt;

use std::path::Path;
use std::process::Command;

use common::{files_in, metadata, shapes, values, HIDDEN};
use interrupt::interrupt_mid_write;
use kiln_format::{DType, KilnWriter, TensorSpec};

/// Rows of the widened embedding: 2^19 × 64 weights, so that quantizing takes long enough to
/// be caught (a tenth of a second or more).
const WIDE_VOCAB: u64 = 1 << 19;

/// The common tiny model with a `vocab`-row embedding (zeros; the other tensors as usual).
fn write_wide_model(path: &Path, vocab: u64) {
    let mut meta = metadata();
    meta.config.vocab_size = vocab;
    let specs: Vec<TensorSpec> = shapes()
        .into_iter()
        .map(|(name, shape)| {
            let shape = if name == "embed.weight" {
                vec![vocab, HIDDEN]
            } else {
                shape
            };
            let dtype = if shape.len() == 1 {
                DType::F32
            } else {
                DType::BF16
            };
            TensorSpec { name, dtype, shape }
        })
        .collect();
    let w = KilnWriter::create(path, &meta, specs.clone(), false).unwrap();
    for (i, spec) in specs.iter().enumerate() {
        let n = spec.shape.iter().product::<u64>() as usize;
        let bytes = match (spec.name.as_str(), spec.dtype) {
            ("embed.weight", _) => vec![0u8; n * 2],
            (_, DType::F32) => bytemuck::cast_slice(&vec![1.0f32; n]).to_vec(),
            _ => values(i as u64 + 1, n)
                .iter()
                .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                .collect(),
        };
        w.write_tensor(i, &bytes).unwrap();
    }
    w.finish().unwrap();
}

#[test]
fn sigterm_and_sigint_remove_the_unfinished_output_and_exit_with_128_plus_the_number() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("in.kiln");
    write_wide_model(&model, WIDE_VOCAB);
    for (signal, code) in [("TERM", 143), ("INT", 130)] {
        let out = tmp.path().join(format!("out-{signal}"));
        std::fs::create_dir(&out).unwrap();
        let (status, err) = interrupt_mid_write(
            Command::new(env!("CARGO_BIN_EXE_kiln-quantize"))
                .arg(&model)
                .arg(out.join("q.kiln"))
                .args(["--to", "q8_0", "--threads", "1", "-q"]),
            &out,
            "q.kiln",
            signal,
        );
        assert_eq!(status, Some(code), "SIG{signal}: {err}");
        assert!(
            err.contains(&format!("kiln-quantize: interrupted by SIG{signal}")),
            "SIG{signal}: {err}"
        );
        assert_eq!(files_in(&out), Vec::<String>::new(), "SIG{signal}");
    }
}
