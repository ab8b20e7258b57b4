//! The writer's contract: misuse is an error naming the file and tensor, a failed or abandoned
//! write leaves nothing behind, an existing file is only replaced when asked, and tensors may be
//! written from many threads at once.

mod common;

use std::path::Path;

use common::{sample_metadata, sample_specs, tensor_bytes};
use kiln_format::layout::{MAX_DIM, MAX_NAME_LEN};
use kiln_format::{DType, FormatError, KilnFile, KilnWriter, TensorSpec};
use rayon::prelude::*;

/// Names of the entries in `dir`, sorted.
fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Expect an error naming a `.kiln` file and matching `want` (a writer-contract variant).
#[track_caller]
fn expect_err<T: std::fmt::Debug>(r: Result<T, FormatError>, want: impl Fn(&FormatError) -> bool) {
    match r {
        Err(e) if want(&e) => assert!(e.to_string().contains(".kiln"), "{e}"),
        other => panic!("unexpected: {other:?}"),
    }
}

fn create(path: &Path, overwrite: bool) -> KilnWriter {
    KilnWriter::create(path, &sample_metadata(), sample_specs(), overwrite).unwrap()
}

fn write_all(w: &KilnWriter) {
    for i in 0..w.len() {
        w.write_tensor(i, &tensor_bytes(i, w.tensor_len(i)))
            .unwrap();
    }
}

#[test]
fn declared_tensor_never_written_fails_finish_and_leaves_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.kiln");
    let w = create(&path, false);
    for i in [0, 1, 3, 4] {
        w.write_tensor(i, &tensor_bytes(i, w.tensor_len(i)))
            .unwrap();
    }
    expect_err(
        w.finish(),
        |e| matches!(e, FormatError::NeverWritten { tensor, .. } if tensor == "layers.0.attn.q.weight"),
    );
    assert!(entries(dir.path()).is_empty(), "{:?}", entries(dir.path()));
}

#[test]
fn writing_more_bytes_than_declared_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let w = create(&dir.path().join("m.kiln"), false);
    let n = w.tensor_len(0) as usize;
    expect_err(w.write_tensor(0, &vec![1u8; n + 1]), |e| {
        matches!(e, FormatError::WrongLength { tensor, written: 81, expected: 80, .. }
            if tensor == "embed.weight")
    });
    // The same through a sink, across chunks.
    let mut sink = w.tensor_sink(0).unwrap();
    sink.write(&vec![1u8; n - 1]).unwrap();
    expect_err(sink.write(&[1, 2]), |e| {
        matches!(
            e,
            FormatError::WrongLength {
                written: 81,
                expected: 80,
                ..
            }
        )
    });
}

#[test]
fn finishing_a_tensor_short_of_its_length_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.kiln");
    let w = create(&path, false);
    let n = w.tensor_len(2) as usize;
    expect_err(w.write_tensor(2, &vec![1u8; n - 1]), |e| {
        matches!(e, FormatError::WrongLength { tensor, written: 135, expected: 136, .. }
            if tensor == "layers.0.attn.q.weight")
    });
    // The failed attempt recorded nothing: the tensor can still be written, and the file is good.
    write_all(&w);
    w.finish().unwrap();
    KilnFile::open(&path).unwrap().verify().unwrap();
}

#[test]
fn writing_a_tensor_twice_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let w = create(&dir.path().join("m.kiln"), false);
    let b = tensor_bytes(1, w.tensor_len(1));
    w.write_tensor(1, &b).unwrap();
    expect_err(
        w.write_tensor(1, &b),
        |e| matches!(e, FormatError::WrittenTwice { tensor, .. } if tensor == "layers.0.attn_norm.weight"),
    );
    // Two sinks opened before either finished: the second to finish is refused.
    let b = tensor_bytes(3, w.tensor_len(3));
    let mut s1 = w.tensor_sink(3).unwrap();
    let mut s2 = w.tensor_sink(3).unwrap();
    s1.write(&b).unwrap();
    s2.write(&b).unwrap();
    s1.finish().unwrap();
    expect_err(
        s2.finish(),
        |e| matches!(e, FormatError::WrittenTwice { tensor, .. } if tensor == "layers.0.attn.k.weight"),
    );
}

#[test]
fn tensor_number_out_of_range_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let w = create(&dir.path().join("m.kiln"), false);
    expect_err(w.write_tensor(5, &[]), |e| {
        matches!(
            e,
            FormatError::NoSuchTensor {
                index: 5,
                declared: 5,
                ..
            }
        )
    });
}

#[test]
fn invalid_specs_are_refused_at_create_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.kiln");
    let spec = |name: &str, dtype, shape: &[u64]| TensorSpec {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
    };
    let long = "x".repeat(MAX_NAME_LEN as usize + 1);
    let name = |t: &str| {
        let t = t.to_string();
        move |e: &FormatError| matches!(e, FormatError::BadTensorName { tensor, .. } if *tensor == t)
    };
    let shape = |needle: &'static str| {
        move |e: &FormatError| {
            matches!(e, FormatError::BadShape { tensor, reason, .. }
                if tensor == "a" && reason.contains(needle))
        }
    };
    type Want = Box<dyn Fn(&FormatError) -> bool>;
    let cases: Vec<(Vec<TensorSpec>, Want)> = vec![
        (vec![spec("", DType::F32, &[1])], Box::new(name(""))),
        (vec![spec(&long, DType::F32, &[1])], Box::new(name(&long))),
        (vec![spec("a\tb", DType::F32, &[1])], Box::new(name("a\tb"))),
        (
            vec![spec("a", DType::F32, &[1]), spec("a", DType::F16, &[2])],
            Box::new(
                |e: &FormatError| matches!(e, FormatError::DuplicateTensor { tensor, .. } if tensor == "a"),
            ),
        ),
        (
            vec![spec("a", DType::F32, &[])],
            Box::new(shape("1 to 4 dimensions")),
        ),
        (
            vec![spec("a", DType::F32, &[1; 5])],
            Box::new(shape("1 to 4 dimensions")),
        ),
        (
            vec![spec("a", DType::F32, &[4, 0])],
            Box::new(shape("1 to 4 dimensions")),
        ),
        (
            vec![spec("a", DType::F32, &[MAX_DIM + 1])],
            Box::new(shape("1 to 4 dimensions")),
        ),
        (
            vec![spec("a", DType::Q4_0, &[2, 33])],
            Box::new(shape("multiple of 32")),
        ),
        (
            vec![spec("a", DType::F32, &[MAX_DIM, MAX_DIM])],
            Box::new(shape("overflows 64 bits")),
        ),
    ];
    for (specs, want) in cases {
        expect_err(
            KilnWriter::create(&path, &sample_metadata(), specs, false),
            want,
        );
        assert!(entries(dir.path()).is_empty());
    }
}

/// Regression: four tensors of 2^62 bytes each are individually valid, but their offsets sum
/// past 64 bits; planning the layout used unchecked `offset + len` and panicked (debug) or
/// wrapped around (release) instead of returning an error.
#[test]
fn data_section_overflowing_64_bits_is_an_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.kiln");
    let huge = |i: usize| TensorSpec {
        name: format!("t{i}"),
        dtype: DType::F32,
        shape: vec![MAX_DIM, 1 << 20], // 2^60 elements, 2^62 bytes
    };
    for n in [4, 5] {
        let specs = (0..n).map(huge).collect();
        expect_err(
            KilnWriter::create(&path, &sample_metadata(), specs, false),
            |e| matches!(e, FormatError::DataOverflow { .. }),
        );
    }
    // The data section fits in 64 bits (it ends 4 bytes short of 2^64), but not once it is
    // placed after the header, metadata and index.
    let specs = vec![
        huge(0),
        huge(1),
        huge(2),
        TensorSpec {
            name: "t3".into(),
            dtype: DType::F16,
            shape: vec![2, (1 << 30) - 1, (1 << 30) + 1], // 2^61 - 2 elements, 2^62 - 4 bytes
        },
    ];
    expect_err(
        KilnWriter::create(&path, &sample_metadata(), specs, false),
        |e| matches!(e, FormatError::DataOverflow { .. }),
    );
    assert!(entries(dir.path()).is_empty());
}

#[test]
fn existing_destination_without_overwrite_is_already_exists_and_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.kiln");
    std::fs::write(&path, b"precious").unwrap();
    match KilnWriter::create(&path, &sample_metadata(), sample_specs(), false) {
        Err(e @ FormatError::AlreadyExists { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("m.kiln") && msg.contains("--force"), "{msg}");
        }
        other => panic!("expected AlreadyExists, got {other:?}"),
    }
    assert_eq!(std::fs::read(&path).unwrap(), b"precious");
    assert_eq!(entries(dir.path()), ["m.kiln"]);
}

#[test]
fn destination_appearing_during_the_write_is_not_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.kiln");
    let w = create(&path, false);
    write_all(&w);
    std::fs::write(&path, b"someone else's").unwrap();
    assert!(matches!(w.finish(), Err(FormatError::AlreadyExists { .. })));
    assert_eq!(std::fs::read(&path).unwrap(), b"someone else's");
    assert_eq!(
        entries(dir.path()),
        ["m.kiln"],
        "the temporary file is removed"
    );
}

#[test]
fn existing_destination_with_overwrite_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.kiln");
    std::fs::write(&path, b"old").unwrap();
    let w = create(&path, true);
    write_all(&w);
    let summary = w.finish().unwrap();
    assert_eq!(summary.path, path);
    assert_eq!(
        summary.file_len,
        std::fs::metadata(&path).unwrap().len(),
        "the summary describes the new file"
    );
    let f = KilnFile::open(&path).unwrap();
    f.verify().unwrap();
    assert_eq!(f.header_sha256(), summary.header_sha256);
    assert_eq!(entries(dir.path()), ["m.kiln"]);
}

/// A conversion that fails half-way with `?`, the way a real caller would.
fn failing_conversion(path: &Path) -> Result<(), FormatError> {
    let w = KilnWriter::create(path, &sample_metadata(), sample_specs(), false)?;
    w.write_tensor(0, &tensor_bytes(0, w.tensor_len(0)))?;
    w.write_tensor(1, &[0u8; 3])?; // wrong length: the error drops the writer
    w.finish()?;
    Ok(())
}

#[test]
fn writer_dropped_by_an_error_leaves_no_temporary_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.kiln");
    assert!(failing_conversion(&path).is_err());
    assert!(entries(dir.path()).is_empty(), "{:?}", entries(dir.path()));
}

#[test]
fn writer_dropped_by_a_panic_leaves_no_temporary_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.kiln");
    let r = std::panic::catch_unwind(|| {
        let w = create(&path, false);
        assert_eq!(
            entries(dir.path()).len(),
            1,
            "the temporary file exists while writing"
        );
        w.write_tensor(0, &tensor_bytes(0, w.tensor_len(0)))
            .unwrap();
        panic!("simulated failure");
    });
    assert!(r.is_err());
    assert!(entries(dir.path()).is_empty(), "{:?}", entries(dir.path()));
}

#[test]
fn temporary_file_is_hidden_beside_the_destination() {
    let dir = tempfile::tempdir().unwrap();
    let w = create(&dir.path().join("m.kiln"), false);
    let names = entries(dir.path());
    assert_eq!(names.len(), 1);
    assert!(names[0].starts_with(".m.kiln.tmp-"), "{names:?}");
    drop(w);
    assert!(entries(dir.path()).is_empty());
}

#[test]
fn parallel_writes_from_rayon_threads_produce_a_valid_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("par.kiln");
    let dtypes = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
    ];
    let specs: Vec<TensorSpec> = (0..300)
        .map(|i| {
            let dtype = dtypes[i % dtypes.len()];
            let cols = if dtype.is_quantized() {
                32 * (1 + i % 3)
            } else {
                1 + i % 37
            };
            TensorSpec {
                name: format!("layers.{}.t{}", i / 10, i % 10),
                dtype,
                shape: vec![1 + (i % 7) as u64, cols as u64],
            }
        })
        .collect();
    let w = KilnWriter::create(&path, &sample_metadata(), specs.clone(), false).unwrap();
    // Chunked sinks, in reverse order, from the pool: interleaved positioned writes.
    (0..w.len()).into_par_iter().rev().for_each(|i| {
        let data = tensor_bytes(i, w.tensor_len(i));
        let mut sink = w.tensor_sink(i).unwrap();
        for chunk in data.chunks(7) {
            sink.write(chunk).unwrap();
        }
        sink.finish().unwrap();
    });
    w.finish().unwrap();
    let f = KilnFile::open(&path).unwrap();
    assert!(f.verify_checksums(&|_| {}).is_empty());
    assert_eq!(f.tensors().len(), specs.len());
    for (i, (info, spec)) in f.tensors().iter().zip(&specs).enumerate() {
        assert_eq!(info.name, spec.name);
        assert_eq!(info.offset % 64, 0);
        assert_eq!(
            f.view(info).bytes(),
            &tensor_bytes(i, info.len)[..],
            "{}",
            info.name
        );
    }
    assert_eq!(entries(dir.path()), ["par.kiln"]);
}

/// Flushing written data (`sync_data`) while other threads are still writing tensors changes
/// nothing in the result, and the unfinished file is still removed if the writer is dropped.
#[test]
fn sync_data_during_parallel_writes_keeps_the_file_intact() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.kiln");
    let w = create(&path, false);
    std::thread::scope(|s| {
        s.spawn(|| {
            for _ in 0..4 {
                w.sync_data().unwrap();
            }
        });
        (0..w.len()).into_par_iter().for_each(|i| {
            let bytes = tensor_bytes(i, w.tensor_len(i));
            let mut sink = w.tensor_sink(i).unwrap();
            let half = bytes.len() / 2;
            sink.write(&bytes[..half]).unwrap();
            w.sync_data().unwrap();
            sink.write(&bytes[half..]).unwrap();
            sink.finish().unwrap();
        });
    });
    w.finish().unwrap();
    let f = KilnFile::open(&path).unwrap();
    f.verify().unwrap();
    for (i, t) in f.tensors().iter().enumerate() {
        assert_eq!(
            f.view(t).bytes(),
            tensor_bytes(i, t.len).as_slice(),
            "{}",
            t.name
        );
    }

    let other = dir.path().join("n.kiln");
    let w = create(&other, false);
    w.write_tensor(0, &tensor_bytes(0, w.tensor_len(0)))
        .unwrap();
    w.sync_data().unwrap();
    drop(w);
    assert_eq!(entries(dir.path()), ["m.kiln"]);
}
