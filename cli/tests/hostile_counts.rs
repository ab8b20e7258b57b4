//! A `.kiln` file claiming more layers than it holds: `kiln-run` refuses it in bounded memory
//! with exit status 2, naming the file and `num_layers`, instead of listing the tensors the
//! claim implies (past 5 GB for 2^24 layers, until the allocator aborted).

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use kiln_convert::{convert_hf, ConvertOptions, NoProgress};
use kiln_format::KilnFile;
use kiln_runner::{Model, RunnerError};
use sha2::{Digest, Sha256};

/// Address space the child may use: ample for the tiny fixture, a small fraction of what
/// listing 2^24 layers' tensors took.
const MEMORY_LIMIT_KIB: u64 = 1 << 20;

/// Longest a refusal may take: it takes milliseconds, so reaching this means a hang.
const DEADLINE: Duration = Duration::from_secs(60);

fn tiny_kiln(dir: &Path) -> Vec<u8> {
    let out = dir.join("good.kiln");
    convert_hf(
        &ConvertOptions {
            input: Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny/llama-tied-f32"),
            output: out.clone(),
            dtype: None,
            overwrite: false,
            allow_non_finite: false,
        },
        &NoProgress,
    )
    .unwrap();
    std::fs::read(out).unwrap()
}

/// `src` with `config.num_layers` set to `layers` in its metadata JSON, the header rebuilt
/// and re-sealed, as a hostile tool would write it (Kiln's writer refuses what readers refuse).
fn with_layers(src: &[u8], layers: u64) -> Vec<u8> {
    let u64_at = |o: usize| u64::from_le_bytes(src[o..o + 8].try_into().unwrap());
    let (meta_len, index_len, files_len) = (u64_at(24), u64_at(40), u64_at(72));
    let data_offset = u64_at(48) as usize;
    let meta_end = 128 + meta_len as usize;
    let mut meta: serde_json::Value = serde_json::from_slice(&src[128..meta_end]).unwrap();
    meta["config"]["num_layers"] = layers.into();
    let meta = serde_json::to_vec(&meta).unwrap();
    let rest = &src[meta_end..meta_end + (index_len + files_len) as usize];
    let end = 128 + meta.len() + rest.len();
    let new_data_offset = end.next_multiple_of(64);
    let mut b = src[..128].to_vec();
    b.extend_from_slice(&meta);
    b.extend_from_slice(rest);
    b.resize(new_data_offset, 0);
    b.extend_from_slice(&src[data_offset..]);
    let set = |b: &mut Vec<u8>, o: usize, v: u64| b[o..o + 8].copy_from_slice(&v.to_le_bytes());
    set(&mut b, 24, meta.len() as u64);
    set(&mut b, 32, 128 + meta.len() as u64);
    set(&mut b, 48, new_data_offset as u64);
    let mut h = Sha256::new();
    h.update(&b[..96]);
    h.update(&b[128..end]);
    let sha: [u8; 32] = h.finalize().into();
    b[96..128].copy_from_slice(&sha);
    b
}

/// `kiln-run ARGS` under the address-space limit, killed at [`DEADLINE`].
fn limited(args: &[&std::ffi::OsStr]) -> Output {
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v {MEMORY_LIMIT_KIB} && exec \"$0\" \"$@\""
        ))
        .arg(env!("CARGO_BIN_EXE_kiln-run"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > DEADLINE {
            let _ = child.kill();
            panic!("kiln-run {args:?} did not finish in {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// Regression: `kiln-run generate` on a 0.4 MB file claiming 2^24 layers aborted (exit 134)
/// after allocating gigabytes; it is now refused at open.
#[test]
fn kiln_run_refuses_a_file_claiming_2_pow_24_layers_in_bounded_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("bad.kiln");
    std::fs::write(&bad, with_layers(&tiny_kiln(tmp.path()), 1 << 24)).unwrap();
    let r = limited(&[
        "generate".as_ref(),
        bad.as_os_str(),
        "-p".as_ref(),
        "Hi".as_ref(),
        "-n".as_ref(),
        "1".as_ref(),
    ]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{err}");
    assert!(
        err.contains("bad.kiln") && err.contains("num_layers") && err.contains("16777216"),
        "{err}"
    );
}

/// A layer count a file could hold, but far beyond the tensors this one holds, is refused by
/// the runner's load before it lists the implied tensors, naming both counts.
#[test]
fn a_layer_count_beyond_the_tensors_the_file_holds_is_refused_at_load() {
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("bad.kiln");
    std::fs::write(&bad, with_layers(&tiny_kiln(tmp.path()), 100_000)).unwrap();
    let f = KilnFile::open(&bad).unwrap();
    match Model::load(&f) {
        Err(
            e @ RunnerError::BadConfig {
                field: "num_layers",
                ..
            },
        ) => {
            let m = e.to_string();
            assert!(m.contains("600002") && m.contains("holds 20"), "{m}");
        }
        Err(other) => panic!("expected BadConfig num_layers, got {other}"),
        Ok(_) => panic!("a file missing most of its layers loaded"),
    }
}
