//! Corrupt, truncated and hostile `.kiln` files.
//!
//! Every case starts from a valid file made by [`KilnWriter`] (five tensors, one of each dtype,
//! metadata with a tokenizer), damages it in one place, and checks that the reader
//! - returns the right error variant, naming the file and the field or tensor at fault;
//! - never panics (a panic fails the test);
//! - never allocates more than [`ALLOC_BOUND`] while doing so, whatever length the damaged
//!   bytes claim (checked with a per-thread allocation tracker).
//!
//! Cases that patch a length or count re-seal the header checksum ([`common::reseal`]), so the
//! structural check itself has to catch them.

mod common;

use common::{
    assemble, at, largest_allocation_during, open, reseal, sample, set_u16, set_u32, set_u64,
    u64_at, Map, TrackingAlloc, LABEL,
};
use kiln_format::layout::{
    MAX_DIM, MAX_DIMS, MAX_INDEX_LEN, MAX_METADATA_LEN, MAX_NAME_LEN, MAX_TENSORS,
};
use kiln_format::{DType, FormatError, KilnFile};

#[global_allocator]
static ALLOC: TrackingAlloc = TrackingAlloc;

/// Largest single allocation the reader may make while refusing a corrupt ~2 KB file. Parsing
/// allocates only the index entries and the metadata strings, all bounded by the file's length;
/// any allocation sized by a corrupt length or count would be orders of magnitude larger.
const ALLOC_BOUND: usize = 64 << 10;

/// Open `bytes`, which must be refused: returns the error after checking that its message names
/// the file and that no allocation exceeded [`ALLOC_BOUND`].
#[track_caller]
fn refuse(bytes: Vec<u8>) -> FormatError {
    let (result, largest) = largest_allocation_during(|| open(bytes));
    let err = match result {
        Ok(f) => panic!("a corrupt file was accepted: {f:?}"),
        Err(e) => e,
    };
    let msg = err.to_string();
    assert!(msg.contains(LABEL), "message does not name the file: {msg}");
    assert!(
        largest <= ALLOC_BOUND,
        "refusing the file allocated {largest} bytes at once ({msg})"
    );
    err
}

/// Expect `BadHeader` for `field`; returns the message.
#[track_caller]
fn expect_bad_header(bytes: Vec<u8>, field: &str) -> String {
    match refuse(bytes) {
        e @ FormatError::BadHeader { field: f, .. } if f == field => {
            let msg = e.to_string();
            assert!(msg.contains(field), "{msg}");
            msg
        }
        other => panic!("expected BadHeader {{ field: {field} }}, got {other:?}"),
    }
}

/// Expect `BadTensor` naming `tensor`, with `needle` in the reason; returns the message.
#[track_caller]
fn expect_bad_tensor(bytes: Vec<u8>, tensor: &str, needle: &str) -> String {
    match refuse(bytes) {
        e @ FormatError::BadTensor { .. } => {
            let FormatError::BadTensor {
                tensor: ref t,
                ref reason,
                ..
            } = e
            else {
                unreachable!()
            };
            assert_eq!(t, tensor, "{e}");
            assert!(reason.contains(needle), "expected {needle:?} in: {e}");
            let msg = e.to_string();
            assert!(msg.contains(tensor), "{msg}");
            msg
        }
        other => panic!("expected BadTensor {{ tensor: {tensor} }}, got {other:?}"),
    }
}

/// Expect `BadIndexEntry` for entry `entry`, with `needle` in the reason.
#[track_caller]
fn expect_bad_entry(bytes: Vec<u8>, entry: usize, needle: &str) {
    match refuse(bytes) {
        FormatError::BadIndexEntry {
            entry: e, reason, ..
        } => {
            assert_eq!(e, entry, "{reason}");
            assert!(reason.contains(needle), "expected {needle:?} in: {reason}");
        }
        other => panic!("expected BadIndexEntry #{entry}, got {other:?}"),
    }
}

#[track_caller]
fn expect_header_checksum(bytes: Vec<u8>) {
    match refuse(bytes) {
        FormatError::HeaderChecksum {
            stored, computed, ..
        } => assert_ne!(stored, computed),
        other => panic!("expected HeaderChecksum, got {other:?}"),
    }
}

/// Patch with `f`, then re-seal the header checksum.
fn patched(bytes: &[u8], f: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut b = bytes.to_vec();
    f(&mut b);
    reseal(&mut b);
    b
}

/// Index of a tensor in the sample by name.
fn rec<'m>(map: &'m Map, name: &str) -> &'m common::RecordMap {
    map.records
        .iter()
        .find(|r| r.name == name)
        .unwrap_or_else(|| panic!("no {name} in the sample"))
}

// ---------------------------------------------------------------------------------------------
// The baseline.

#[test]
fn allocation_tracker_sees_a_large_allocation() {
    // Guards the guard: without this, a tracker that saw nothing would pass every test.
    let (v, largest) = largest_allocation_during(|| vec![0u8; 1 << 20]);
    assert_eq!(v.len(), 1 << 20);
    assert!(largest >= 1 << 20, "{largest}");
}

#[test]
fn the_sample_file_is_valid_and_every_view_reads() {
    let (bytes, map) = sample();
    assert!(
        map.data_offset > map.index.end,
        "the sample must have padding before its data section"
    );
    let f = open(bytes.clone()).unwrap();
    assert_eq!(f.tensors().len(), 5);
    assert_eq!(f.metadata(), &common::sample_metadata());
    assert!(f.verify_checksums(&|_| {}).is_empty());
    f.verify().unwrap();
    assert_eq!(
        f.tensor("embed.weight").unwrap().as_f32().unwrap().len(),
        20
    );
    assert_eq!(
        f.tensor("layers.0.attn_norm.weight")
            .unwrap()
            .as_f16()
            .unwrap()
            .len(),
        7
    );
    assert_eq!(
        f.tensor("layers.0.attn.q.weight")
            .unwrap()
            .as_q8_0()
            .unwrap()
            .len(),
        4
    );
    assert_eq!(
        f.tensor("layers.0.attn.k.weight")
            .unwrap()
            .as_q4_0()
            .unwrap()
            .len(),
        1
    );
    assert_eq!(
        f.tensor("final_norm.weight")
            .unwrap()
            .as_bf16()
            .unwrap()
            .len(),
        3
    );
    for r in &map.records {
        assert_eq!(f.tensor(&r.name).unwrap().bytes(), &bytes[r.data.clone()]);
    }
}

// ---------------------------------------------------------------------------------------------
// Truncation.

#[test]
fn empty_file_is_truncated_not_bad_magic() {
    match refuse(Vec::new()) {
        FormatError::Truncated { what, len, .. } => {
            assert_eq!(len, 0);
            assert!(what.contains("fixed header"), "{what}");
        }
        other => panic!("expected Truncated, got {other:?}"),
    }
}

/// The section a truncated file must be reported as missing, by where it was cut.
fn section_cut_at(map: &Map, cut: usize) -> &'static str {
    if cut < 128 {
        "the fixed header"
    } else if cut < map.index.end {
        "the metadata and tensor index"
    } else {
        "the tensor data"
    }
}

#[test]
fn truncation_at_every_section_boundary_is_truncated_naming_the_section() {
    let (bytes, map) = sample();
    let mut cuts = vec![
        0,
        1,
        7,
        8,
        127,
        128,
        map.meta.end - 1,
        map.meta.end,
        map.index.end - 1,
        map.index.end,
        map.data_offset - 1,
        map.data_offset,
        map.file_len - 1,
    ];
    for r in &map.records {
        cuts.extend([r.data.start, r.data.start + 1, r.data.end - 1, r.data.end]);
    }
    for cut in cuts.into_iter().filter(|&c| c < map.file_len) {
        match refuse(bytes[..cut].to_vec()) {
            FormatError::Truncated { what, len, end, .. } => {
                assert_eq!(what, section_cut_at(&map, cut), "cut at {cut}");
                assert_eq!(len, cut as u64);
                assert!(
                    end > len,
                    "cut at {cut}: the missing range must end past the file"
                );
            }
            other => panic!("cut at {cut}: expected Truncated, got {other:?}"),
        }
    }
}

#[test]
fn truncation_at_every_offset_is_truncated() {
    let (bytes, map) = sample();
    for cut in 0..map.file_len {
        match refuse(bytes[..cut].to_vec()) {
            FormatError::Truncated { what, .. } => {
                assert_eq!(what, section_cut_at(&map, cut), "cut at {cut}");
            }
            other => panic!("cut at {cut}: expected Truncated, got {other:?}"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Flipped bytes.

#[test]
fn bad_magic_names_the_bytes_found() {
    let (bytes, _) = sample();
    let mut b = bytes.clone();
    b[0] = b'G';
    match refuse(b) {
        FormatError::BadMagic {
            found, expected, ..
        } => {
            assert!(found.contains("47"), "{found}");
            assert_ne!(found, expected);
        }
        other => panic!("expected BadMagic, got {other:?}"),
    }
    // A short file that is not a prefix of the magic is not a .kiln file at all.
    assert!(matches!(
        refuse(b"GGUF".to_vec()),
        FormatError::BadMagic { .. }
    ));
    // A short prefix of the magic is a truncated .kiln file.
    assert!(matches!(
        refuse(b"KILN\r".to_vec()),
        FormatError::Truncated { .. }
    ));
}

/// Which outcomes flipping a bit of header byte `i` may have. Fields the structural check
/// reads are refused by name; the rest (minor version, checksum) by the header checksum.
fn header_flip_allows(i: usize, e: &FormatError) -> bool {
    use FormatError::*;
    let field = |want: &[&str]| matches!(e, BadHeader { field, .. } if want.contains(field));
    match i {
        0..8 => matches!(e, BadMagic { .. }),
        8..10 => matches!(e, UnsupportedVersion { major, supported: 1, .. } if *major != 1),
        10..12 => matches!(e, HeaderChecksum { .. }),
        12..16 => field(&["flags"]),
        16..24 => field(&["metadata_offset"]),
        24..32 => field(&["metadata_len", "index_offset"]),
        32..40 => field(&["index_offset"]),
        40..48 => field(&["index_len", "data_offset"]) || matches!(e, HeaderChecksum { .. }),
        48..56 => field(&["data_offset"]),
        56..64 => field(&["data_len"]) || matches!(e, Truncated { .. }),
        64..68 => field(&["tensor_count"]) || matches!(e, HeaderChecksum { .. }),
        68..72 => field(&["alignment"]),
        72..80 => {
            field(&["files_len", "data_offset"])
                || matches!(e, Truncated { .. } | HeaderChecksum { .. })
        }
        80..96 => field(&["reserved"]),
        96..128 => matches!(e, HeaderChecksum { .. }),
        _ => unreachable!(),
    }
}

#[test]
fn flipping_any_fixed_header_bit_is_refused_by_the_right_check() {
    let (bytes, _) = sample();
    for i in 0..128 {
        for mask in [0x01u8, 0x10, 0x80] {
            let mut b = bytes.clone();
            b[i] ^= mask;
            let e = refuse(b);
            assert!(
                header_flip_allows(i, &e),
                "header byte {i} ^ {mask:#04x}: unexpected {e:?}"
            );
        }
    }
}

#[test]
fn flipping_any_metadata_byte_fails_the_header_checksum() {
    let (bytes, map) = sample();
    for i in map.meta.clone() {
        let mut b = bytes.clone();
        b[i] ^= 0x20;
        expect_header_checksum(b);
    }
}

#[test]
fn flipping_any_index_byte_fails_the_header_checksum() {
    let (bytes, map) = sample();
    for i in map.index.clone() {
        let mut b = bytes.clone();
        b[i] ^= 0x01;
        expect_header_checksum(b);
    }
}

#[test]
fn flipped_tensor_byte_opens_but_verify_reports_exactly_that_tensor() {
    let (bytes, map) = sample();
    for r in &map.records {
        for at in [
            r.data.start,
            r.data.start + r.data.len() / 2,
            r.data.end - 1,
        ] {
            let mut b = bytes.clone();
            b[at] ^= 0x40;
            let f = open(b).unwrap_or_else(|e| panic!("{}: open must not hash data: {e}", r.name));
            let failures = f.verify_checksums(&|_| {});
            assert_eq!(failures.len(), 1, "{failures:?}");
            assert_eq!(failures[0].tensor, r.name);
            assert_ne!(failures[0].stored, failures[0].computed);
            match f.verify() {
                Err(e @ FormatError::TensorChecksum { .. }) => {
                    let msg = e.to_string();
                    assert!(msg.contains(LABEL) && msg.contains(&r.name), "{msg}");
                }
                other => panic!("expected TensorChecksum, got {other:?}"),
            }
        }
    }
}

#[test]
fn verify_checksums_reports_every_corrupt_tensor_sorted_by_name() {
    let (bytes, map) = sample();
    let mut b = bytes.clone();
    for r in &map.records {
        b[r.data.start] ^= 1;
    }
    let f = open(b).unwrap();
    let failed: Vec<String> = f
        .verify_checksums(&|_| {})
        .into_iter()
        .map(|c| c.tensor)
        .collect();
    let mut names: Vec<String> = map.records.iter().map(|r| r.name.clone()).collect();
    names.sort();
    assert_eq!(failed, names);
}

#[test]
fn verify_checksums_reports_progress_for_every_byte() {
    let (bytes, _) = sample();
    let f = open(bytes).unwrap();
    let total = std::sync::atomic::AtomicU64::new(0);
    f.verify_checksums(&|n| {
        total.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    });
    let expect: u64 = f.tensors().iter().map(|t| t.len).sum();
    assert_eq!(total.into_inner(), expect);
}

// ---------------------------------------------------------------------------------------------
// Absurd lengths and counts, with the header checksum re-sealed.

#[test]
fn metadata_len_over_the_limit_is_refused_naming_the_limit() {
    let (bytes, _) = sample();
    for v in [u64::MAX, MAX_METADATA_LEN + 1, 1 << 62] {
        let msg = expect_bad_header(
            patched(&bytes, |b| set_u64(b, at::METADATA_LEN, v)),
            "metadata_len",
        );
        assert!(msg.contains(&MAX_METADATA_LEN.to_string()), "{msg}");
    }
}

/// A consistent header whose metadata section would be `len` bytes: the offsets that follow
/// it are moved to match, so only the file's length contradicts it.
fn with_metadata_len(bytes: &[u8], len: u64) -> Vec<u8> {
    patched(bytes, |b| {
        let index_len = u64_at(b, at::INDEX_LEN);
        set_u64(b, at::METADATA_LEN, len);
        set_u64(b, at::INDEX_OFFSET, 128 + len);
        set_u64(
            b,
            at::DATA_OFFSET,
            (128 + len + index_len).div_ceil(64) * 64,
        );
    })
}

#[test]
fn metadata_len_within_the_limit_but_past_the_end_is_truncated_without_allocating_it() {
    let (bytes, _) = sample();
    for len in [MAX_METADATA_LEN, MAX_METADATA_LEN / 2, 1 << 20] {
        match refuse(with_metadata_len(&bytes, len)) {
            FormatError::Truncated { what, .. } => {
                assert_eq!(what, "the metadata and tensor index")
            }
            other => panic!("expected Truncated, got {other:?}"),
        }
    }
}

#[test]
fn index_len_over_the_limit_is_refused_naming_the_limit() {
    let (bytes, _) = sample();
    for v in [u64::MAX, MAX_INDEX_LEN + 1] {
        let msg = expect_bad_header(
            patched(&bytes, |b| set_u64(b, at::INDEX_LEN, v)),
            "index_len",
        );
        assert!(msg.contains(&MAX_INDEX_LEN.to_string()), "{msg}");
    }
}

#[test]
fn index_len_within_the_limit_but_past_the_end_is_truncated_without_allocating_it() {
    let (bytes, _) = sample();
    let b = patched(&bytes, |b| {
        let meta_len = u64_at(b, at::METADATA_LEN);
        set_u64(b, at::INDEX_LEN, MAX_INDEX_LEN);
        set_u64(
            b,
            at::DATA_OFFSET,
            (128 + meta_len + MAX_INDEX_LEN).div_ceil(64) * 64,
        );
    });
    assert!(matches!(refuse(b), FormatError::Truncated { .. }));
}

#[test]
fn tensor_count_over_the_limit_is_refused() {
    let (bytes, _) = sample();
    for v in [u32::MAX, MAX_TENSORS + 1] {
        expect_bad_header(
            patched(&bytes, |b| set_u32(b, at::TENSOR_COUNT, v)),
            "tensor_count",
        );
    }
}

#[test]
fn tensor_count_larger_than_the_index_holds_runs_out_of_index_bytes() {
    let (bytes, map) = sample();
    let n = map.records.len();
    for v in [MAX_TENSORS, n as u32 + 1] {
        expect_bad_entry(
            patched(&bytes, |b| set_u32(b, at::TENSOR_COUNT, v)),
            n,
            "name length needs 4 bytes",
        );
    }
}

#[test]
fn tensor_count_smaller_than_the_index_leaves_bytes_over() {
    let (bytes, map) = sample();
    let n = map.records.len() as u32;
    let msg = expect_bad_header(
        patched(&bytes, |b| set_u32(b, at::TENSOR_COUNT, n - 1)),
        "index_len",
    );
    assert!(msg.contains("left in the index"), "{msg}");
}

#[test]
fn name_len_out_of_range_is_refused() {
    let (bytes, map) = sample();
    let r = &map.records[1];
    for v in [u32::MAX, MAX_NAME_LEN + 1, 0] {
        expect_bad_entry(
            patched(&bytes, |b| set_u32(b, r.name_len_at, v)),
            1,
            "name length",
        );
    }
}

#[test]
fn name_len_within_the_limit_but_past_the_index_end_is_refused() {
    let (bytes, map) = sample();
    let r = &map.records[2];
    expect_bad_entry(
        patched(&bytes, |b| set_u32(b, r.name_len_at, MAX_NAME_LEN)),
        2,
        "name needs 1024 bytes",
    );
}

#[test]
fn name_that_is_not_utf8_is_refused() {
    let (bytes, map) = sample();
    let r = &map.records[0];
    expect_bad_entry(patched(&bytes, |b| b[r.name_at] = 0xff), 0, "not UTF-8");
}

#[test]
fn name_with_control_characters_is_refused() {
    let (bytes, map) = sample();
    let r = &map.records[0];
    expect_bad_entry(
        patched(&bytes, |b| b[r.name_at + 2] = b'\n'),
        0,
        "control characters",
    );
}

#[test]
fn rank_out_of_range_is_refused_naming_the_tensor() {
    let (bytes, map) = sample();
    let r = rec(&map, "layers.0.attn.q.weight");
    for v in [u32::MAX, MAX_DIMS + 1, 0] {
        expect_bad_tensor(
            patched(&bytes, |b| set_u32(b, r.ndim_at, v)),
            &r.name,
            "rank",
        );
    }
}

#[test]
fn dimension_out_of_range_is_refused_naming_the_tensor() {
    let (bytes, map) = sample();
    let r = rec(&map, "embed.weight");
    for v in [u64::MAX, MAX_DIM + 1, 0] {
        expect_bad_tensor(
            patched(&bytes, |b| set_u64(b, r.dims_at, v)),
            &r.name,
            "dimension",
        );
    }
}

#[test]
fn shape_whose_size_overflows_64_bits_is_refused() {
    let (bytes, map) = sample();
    let r = rec(&map, "embed.weight");
    assert_eq!(r.ndim, 2);
    expect_bad_tensor(
        patched(&bytes, |b| {
            set_u64(b, r.dims_at, MAX_DIM);
            set_u64(b, r.dims_at + 8, MAX_DIM);
        }),
        &r.name,
        "overflows 64 bits",
    );
}

#[test]
fn unknown_dtype_id_is_refused_listing_the_known_ids() {
    let (bytes, map) = sample();
    let r = rec(&map, "layers.0.attn_norm.weight");
    for id in [3u32, 9, 29, u32::MAX] {
        let msg = expect_bad_tensor(
            patched(&bytes, |b| set_u32(b, r.dtype_at, id)),
            &r.name,
            &format!("unknown dtype id {id}"),
        );
        assert!(msg.contains("q8_0=8") && msg.contains("bf16=30"), "{msg}");
    }
}

#[test]
fn byte_length_not_matching_dtype_and_shape_is_refused() {
    let (bytes, map) = sample();
    let r = rec(&map, "layers.0.attn.q.weight");
    for delta in [1i64, -1, 34, -34] {
        expect_bad_tensor(
            patched(&bytes, |b| {
                let len = u64_at(b, r.len_at);
                set_u64(b, r.len_at, len.wrapping_add_signed(delta));
            }),
            &r.name,
            "byte length",
        );
    }
    // Another valid dtype id with the same length: the shape no longer fits the bytes.
    expect_bad_tensor(
        patched(&bytes, |b| set_u32(b, r.dtype_at, DType::F32.id())),
        &r.name,
        "byte length",
    );
}

#[test]
fn block_dtype_with_a_row_not_a_multiple_of_32_is_refused() {
    let (bytes, map) = sample();
    let r = rec(&map, "layers.0.attn.k.weight");
    expect_bad_tensor(
        patched(&bytes, |b| set_u64(b, r.dims_at + 8, 33)),
        &r.name,
        "multiple of 32",
    );
}

/// The 1.2 block types in the index of a tensor whose rows cannot hold them: refused naming
/// the tensor and the block length (256 weights for the K-quants, 32 for Q5_0/Q5_1).
#[test]
fn k_quant_and_q5_dtypes_with_rows_of_partial_blocks_are_refused() {
    let (bytes, map) = sample();
    let r = rec(&map, "layers.0.attn.q.weight"); // (2, 64)
    for d in [DType::Q4_K, DType::Q5_K, DType::Q6_K] {
        expect_bad_tensor(
            patched(&bytes, |b| set_u32(b, r.dtype_at, d.id())),
            &r.name,
            "multiple of 256",
        );
    }
    let r = rec(&map, "layers.0.attn.k.weight"); // (1, 32)
    for d in [DType::Q5_0, DType::Q5_1] {
        expect_bad_tensor(
            patched(&bytes, |b| {
                set_u32(b, r.dtype_at, d.id());
                set_u64(b, r.dims_at + 8, 48);
            }),
            &r.name,
            "multiple of 32",
        );
    }
}

#[test]
fn overlapping_offset_is_refused() {
    let (bytes, map) = sample();
    let r = &map.records[1];
    let msg = expect_bad_tensor(
        patched(&bytes, |b| set_u64(b, r.offset_at, 0)),
        &r.name,
        "overlaps the previous tensor",
    );
    assert!(msg.contains("expected 128"), "{msg}");
}

#[test]
fn misaligned_offset_is_refused() {
    let (bytes, map) = sample();
    let r = &map.records[2];
    let off = u64_at(&bytes, r.offset_at);
    for v in [off + 1, off - 1, off + 32] {
        let e = refuse(patched(&bytes, |b| set_u64(b, r.offset_at, v)));
        assert!(
            matches!(&e, FormatError::BadTensor { tensor, .. } if *tensor == r.name),
            "{e:?}"
        );
    }
}

#[test]
fn gap_between_tensors_is_refused() {
    let (bytes, map) = sample();
    let r = &map.records[1];
    expect_bad_tensor(
        patched(&bytes, |b| set_u64(b, r.offset_at, 192)),
        &r.name,
        "leaves a gap",
    );
}

#[test]
fn offset_past_the_end_of_the_file_is_refused() {
    let (bytes, map) = sample();
    let r = map.records.last().unwrap();
    for v in [u64::MAX, u64::MAX - 63, map.file_len as u64 + 64] {
        let e = refuse(patched(&bytes, |b| set_u64(b, r.offset_at, v)));
        assert!(
            matches!(&e, FormatError::BadTensor { tensor, .. } if *tensor == r.name),
            "{e:?}"
        );
    }
}

#[test]
fn tensor_running_past_the_data_section_is_refused() {
    let (bytes, map) = sample();
    // The last tensor (bf16 [3], 6 bytes) grows to bf16 [100], 200 bytes, consistently.
    let r = map.records.last().unwrap();
    assert_eq!(r.ndim, 1);
    expect_bad_tensor(
        patched(&bytes, |b| {
            set_u64(b, r.dims_at, 100);
            set_u64(b, r.len_at, 200);
        }),
        &r.name,
        "run past the end of the data section",
    );
}

#[test]
fn duplicate_names_are_refused() {
    let (bytes, map) = sample();
    let q = rec(&map, "layers.0.attn.q.weight");
    let k = rec(&map, "layers.0.attn.k.weight");
    assert_eq!(q.name.len(), k.name.len());
    expect_bad_tensor(
        patched(&bytes, |b| {
            b.copy_within(q.name_at..q.name_at + q.name.len(), k.name_at)
        }),
        &q.name,
        "appears twice",
    );
}

#[test]
fn unknown_major_version_is_refused_naming_the_supported_version() {
    let (bytes, _) = sample();
    for major in [0u16, 2, u16::MAX] {
        let e = refuse(patched(&bytes, |b| {
            set_u16(b, at::MAJOR, major);
            set_u16(b, at::MINOR, 3);
        }));
        let msg = e.to_string();
        match e {
            FormatError::UnsupportedVersion {
                major: m,
                minor,
                supported,
                ..
            } => {
                assert_eq!((m, minor, supported), (major, 3, 1));
                assert!(msg.contains(&format!("{major}.3")), "{msg}");
                assert!(msg.contains("major version 1"), "{msg}");
                assert!(msg.contains("upgrade"), "{msg}");
            }
            other => panic!("expected UnsupportedVersion, got {other:?}"),
        }
    }
}

#[test]
fn any_minor_version_is_read() {
    let (bytes, _) = sample();
    for minor in [1u16, 9, u16::MAX] {
        let f = open(patched(&bytes, |b| set_u16(b, at::MINOR, minor))).unwrap();
        assert_eq!(f.version(), (1, minor));
        f.verify().unwrap();
    }
}

#[test]
fn non_zero_flags_are_refused() {
    let (bytes, _) = sample();
    for v in [1u32, 0x8000_0000] {
        expect_bad_header(patched(&bytes, |b| set_u32(b, at::FLAGS, v)), "flags");
    }
}

#[test]
fn non_zero_reserved_bytes_are_refused() {
    let (bytes, _) = sample();
    for i in at::RESERVED..at::SHA {
        expect_bad_header(patched(&bytes, |b| b[i] = 1), "reserved");
    }
}

#[test]
fn alignment_other_than_64_is_refused() {
    let (bytes, _) = sample();
    for v in [0u32, 32, 128, u32::MAX] {
        expect_bad_header(
            patched(&bytes, |b| set_u32(b, at::ALIGNMENT, v)),
            "alignment",
        );
    }
}

#[test]
fn metadata_offset_other_than_128_is_refused() {
    let (bytes, _) = sample();
    for v in [0u64, 127, 192, u64::MAX] {
        expect_bad_header(
            patched(&bytes, |b| set_u64(b, at::METADATA_OFFSET, v)),
            "metadata_offset",
        );
    }
}

#[test]
fn index_offset_not_following_the_metadata_is_refused() {
    let (bytes, map) = sample();
    for v in [0u64, map.meta.end as u64 + 1, u64::MAX] {
        expect_bad_header(
            patched(&bytes, |b| set_u64(b, at::INDEX_OFFSET, v)),
            "index_offset",
        );
    }
}

#[test]
fn data_offset_not_the_aligned_index_end_is_refused() {
    let (bytes, map) = sample();
    for v in [map.index.end as u64, map.data_offset as u64 + 64, u64::MAX] {
        expect_bad_header(
            patched(&bytes, |b| set_u64(b, at::DATA_OFFSET, v)),
            "data_offset",
        );
    }
}

#[test]
fn data_len_overflowing_64_bits_is_refused() {
    let (bytes, _) = sample();
    let msg = expect_bad_header(
        patched(&bytes, |b| set_u64(b, at::DATA_LEN, u64::MAX)),
        "data_len",
    );
    assert!(msg.contains("overflows"), "{msg}");
}

#[test]
fn data_len_past_the_end_of_the_file_is_truncated() {
    let (bytes, _) = sample();
    let b = patched(&bytes, |b| {
        let v = u64_at(b, at::DATA_LEN);
        set_u64(b, at::DATA_LEN, v + (1 << 40));
    });
    match refuse(b) {
        FormatError::Truncated { what, .. } => assert_eq!(what, "the tensor data"),
        other => panic!("expected Truncated, got {other:?}"),
    }
}

#[test]
fn data_len_beyond_the_last_tensor_is_refused() {
    // The file grows by 64 zero bytes and data_len follows, so only the index contradicts it.
    let (bytes, _) = sample();
    let mut b = bytes.clone();
    b.extend_from_slice(&[0; 64]);
    let b = patched(&b, |b| {
        let v = u64_at(b, at::DATA_LEN);
        set_u64(b, at::DATA_LEN, v + 64);
    });
    let msg = expect_bad_header(b, "data_len");
    assert!(msg.contains("last tensor ends at"), "{msg}");
}

#[test]
fn trailing_bytes_after_the_data_section_are_refused() {
    let (bytes, _) = sample();
    for extra in [1usize, 63, 64, 4096] {
        let mut b = bytes.clone();
        b.extend(std::iter::repeat_n(0u8, extra));
        let msg = expect_bad_header(b, "data_len");
        assert!(msg.contains(&format!("{extra} bytes after")), "{msg}");
    }
}

#[test]
fn non_zero_padding_before_the_data_section_is_refused() {
    let (bytes, map) = sample();
    for i in map.index.end..map.data_offset {
        let mut b = bytes.clone();
        b[i] = 0x5a;
        let msg = expect_bad_header(b, "data_offset");
        assert!(msg.contains("padding"), "{msg}");
    }
}

#[test]
fn non_zero_padding_between_tensors_is_refused_naming_the_tensor_before_it() {
    let (bytes, map) = sample();
    let mut checked = 0;
    for pair in map.records.windows(2) {
        for i in pair[0].data.end..pair[1].data.start {
            let mut b = bytes.clone();
            b[i] = 1;
            expect_bad_tensor(b, &pair[0].name, "padding");
            checked += 1;
        }
    }
    assert!(checked > 0, "the sample must have padding between tensors");
}

// ---------------------------------------------------------------------------------------------
// Metadata documents.

fn with_metadata(bytes: &[u8], map: &Map, metadata: &[u8]) -> Vec<u8> {
    assemble(
        metadata,
        &bytes[map.index.clone()],
        map.records.len() as u32,
        &bytes[map.data_offset..],
    )
}

#[test]
fn assembled_sample_is_byte_identical_to_the_writers() {
    let (bytes, map) = sample();
    assert_eq!(with_metadata(&bytes, &map, &bytes[map.meta.clone()]), bytes);
}

/// The sample with `edit` applied to its metadata JSON (header rebuilt and sealed).
fn with_config(bytes: &[u8], map: &Map, edit: impl FnOnce(&mut serde_json::Value)) -> Vec<u8> {
    let mut doc: serde_json::Value = serde_json::from_slice(&bytes[map.meta.clone()]).unwrap();
    edit(&mut doc);
    with_metadata(bytes, map, &serde_json::to_vec(&doc).unwrap())
}

/// Regression: a file whose metadata claims 2^24 layers opened, and the programs that list the
/// tensors a configuration implies (the runner, GGUF export) then allocated past 5 GB. The
/// implied tensors are counted, not listed, at open: more than any file can hold is refused,
/// naming `num_layers`, the count, the limit and the tensors this file declares.
#[test]
fn a_layer_count_implying_more_tensors_than_a_file_holds_is_refused_at_open() {
    let (bytes, map) = sample();
    let b = with_config(&bytes, &map, |d| {
        d["config"]["num_layers"] = (1u64 << 24).into()
    });
    match refuse(b) {
        e @ FormatError::BadMetadata { .. } => {
            let msg = e.to_string();
            for needle in ["config.num_layers", "16777216", "1048576", "declares 5"] {
                assert!(msg.contains(needle), "{needle:?} not in {msg}");
            }
        }
        other => panic!("expected BadMetadata, got {other:?}"),
    }
}

/// Values that are finite or in range as the metadata stores them (f64, u64) but not as the
/// runner narrows them (f32, usize) are refused at open, naming the field.
#[test]
fn config_values_that_overflow_when_narrowed_are_refused_at_open() {
    let (bytes, map) = sample();
    let cases: [(&str, serde_json::Value); 4] = [
        ("max_position_embeddings", (1u64 << 32).into()),
        ("sliding_window", (1u64 << 32).into()),
        ("rope_theta", 1.0.into()),
        ("attn_scale", 1e150.into()),
    ];
    for (field, value) in cases {
        let b = with_config(&bytes, &map, |d| d["config"][field] = value);
        match refuse(b) {
            FormatError::BadMetadata { field: f, .. } => assert_eq!(f, format!("config.{field}")),
            other => panic!("{field}: expected BadMetadata, got {other:?}"),
        }
    }
}

/// The writer runs the check every reader runs, before creating anything: no writer can
/// produce a file its readers refuse.
#[test]
fn the_writer_refuses_a_config_every_reader_refuses() {
    type Edit = fn(&mut kiln_format::ModelConfig);
    let cases: [(Edit, &str); 5] = [
        (|c| c.num_layers = 1 << 24, "num_layers"),
        (
            |c| c.max_position_embeddings = 1 << 32,
            "max_position_embeddings",
        ),
        (|c| c.sliding_window = Some(1 << 32), "sliding_window"),
        (|c| c.rope_theta = 1.0, "rope_theta"),
        (|c| c.family.attn_scale = Some(1e150), "attn_scale"),
    ];
    for (edit, field) in cases {
        let dir = tempfile::tempdir().unwrap();
        let mut meta = common::sample_metadata();
        edit(&mut meta.config);
        let e = kiln_format::KilnWriter::create(
            dir.path().join("m.kiln"),
            &meta,
            common::sample_specs(),
            false,
        )
        .unwrap_err();
        match &e {
            FormatError::BadMetadata { field: f, .. } => assert_eq!(*f, format!("config.{field}")),
            other => panic!("{field}: expected BadMetadata, got {other:?}"),
        }
        assert!(e.to_string().contains("m.kiln"), "{e}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "{field}");
    }
}

#[test]
fn metadata_that_is_not_json_is_refused() {
    let (bytes, map) = sample();
    let mut trailing = bytes[map.meta.clone()].to_vec();
    trailing.extend_from_slice(b" x");
    for doc in [&b"not json"[..], b"", b"{\"config\": ", &trailing] {
        match refuse(with_metadata(&bytes, &map, doc)) {
            FormatError::BadMetadata { field, .. } => assert_eq!(field, "(json)"),
            other => panic!("expected BadMetadata, got {other:?}"),
        }
    }
}

#[test]
fn metadata_that_is_not_utf8_is_refused() {
    let (bytes, map) = sample();
    let mut doc = bytes[map.meta.clone()].to_vec();
    let at = doc.windows(3).position(|w| w == b"BPE").unwrap();
    doc[at] = 0xff;
    assert!(matches!(
        refuse(with_metadata(&bytes, &map, &doc)),
        FormatError::BadMetadata { .. }
    ));
}

#[test]
fn metadata_missing_a_field_is_refused_naming_it() {
    let (bytes, map) = sample();
    let doc = String::from_utf8(bytes[map.meta.clone()].to_vec()).unwrap();
    let doc = doc.replace("\"hidden_size\"", "\"hidden_sizX\"");
    match refuse(with_metadata(&bytes, &map, doc.as_bytes())) {
        e @ FormatError::BadMetadata { .. } => {
            let msg = e.to_string();
            // The object missing it is named, and serde's line and column are left out.
            assert!(msg.contains("metadata field `config`"), "{msg}");
            assert!(msg.contains("hidden_size"), "{msg}");
            assert!(!msg.contains("column"), "{msg}");
        }
        other => panic!("expected BadMetadata, got {other:?}"),
    }
}

#[test]
fn metadata_with_a_wrongly_typed_field_is_refused() {
    let (bytes, map) = sample();
    let doc = String::from_utf8(bytes[map.meta.clone()].to_vec()).unwrap();
    let doc = doc.replace("\"hidden_size\":64", "\"hidden_size\":-64");
    assert!(matches!(
        refuse(with_metadata(&bytes, &map, doc.as_bytes())),
        FormatError::BadMetadata { .. }
    ));
}

#[test]
fn deeply_nested_metadata_is_refused_without_overflowing_the_stack() {
    let (bytes, map) = sample();
    let doc = String::from_utf8(bytes[map.meta.clone()].to_vec()).unwrap();
    let deep = format!("{}{}", "[".repeat(20_000), "]".repeat(20_000));
    let doc = doc.replace(
        "\"generation\":{",
        &format!("\"generation\":{{\"x\":{deep},"),
    );
    assert!(doc.contains(&deep));
    match refuse(with_metadata(&bytes, &map, doc.as_bytes())) {
        FormatError::BadMetadata { reason, .. } => {
            assert!(reason.contains("deeper than 128"), "{reason}")
        }
        other => panic!("expected BadMetadata, got {other:?}"),
    }
}

#[test]
fn unknown_metadata_fields_are_ignored_for_forward_compatibility() {
    let (bytes, map) = sample();
    let doc = String::from_utf8(bytes[map.meta.clone()].to_vec()).unwrap();
    let doc = doc.replacen('{', "{\"added_in_1_1\":{\"x\":[1,2]},", 1);
    let f = open(with_metadata(&bytes, &map, doc.as_bytes())).unwrap();
    assert_eq!(f.metadata(), &common::sample_metadata());
}

#[test]
fn file_with_no_tensors_is_valid() {
    let bytes = common::write_file(&common::sample_metadata(), vec![]);
    let f = open(bytes).unwrap();
    assert!(f.tensors().is_empty());
    assert_eq!(f.data_len(), 0);
    assert_eq!(f.file_len() % 64, 0);
    f.verify().unwrap();
}

// ---------------------------------------------------------------------------------------------
// Errors of a valid file's accessors.

#[test]
fn missing_file_is_an_io_error_naming_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("absent.kiln");
    match KilnFile::open(&path) {
        Err(e @ FormatError::Io { .. }) => {
            assert!(e.to_string().contains("absent.kiln"), "{e}");
        }
        other => panic!("expected Io, got {other:?}"),
    }
}

#[test]
fn corrupt_file_on_disk_names_its_path() {
    let (bytes, _) = sample();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("on-disk.kiln");
    std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
    let e = KilnFile::open(&path).unwrap_err();
    assert!(matches!(e, FormatError::Truncated { .. }), "{e:?}");
    assert!(e.to_string().contains(&path.display().to_string()), "{e}");
}

#[test]
fn unknown_tensor_name_is_tensor_not_found() {
    let (bytes, _) = sample();
    let f = open(bytes).unwrap();
    match f.tensor("layers.9.attn.q.weight") {
        Err(e @ FormatError::TensorNotFound { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains(LABEL) && msg.contains("layers.9.attn.q.weight"),
                "{msg}"
            );
        }
        other => panic!("expected TensorNotFound, got {other:?}"),
    }
}

#[test]
fn typed_view_of_the_wrong_dtype_is_dtype_mismatch() {
    let (bytes, _) = sample();
    let f = open(bytes).unwrap();
    let v = f.tensor("embed.weight").unwrap();
    match v.as_q4_0() {
        Err(e @ FormatError::DTypeMismatch { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("embed.weight") && msg.contains("f32") && msg.contains("q4_0"));
        }
        other => panic!("expected DTypeMismatch, got {other:?}"),
    }
    assert!(v.as_f16().is_err() && v.as_bf16().is_err() && v.as_q8_0().is_err());
}

#[test]
fn metadata_nested_deeper_than_the_spec_allows_is_refused_under_any_key() {
    let (bytes, map) = sample();
    let doc = String::from_utf8(bytes[map.meta.clone()].to_vec()).unwrap();
    for depth in [129usize, 200, 1_000_000] {
        // An unknown key, which a reader otherwise skips.
        let deep = format!("{}{}", "[".repeat(depth - 1), "]".repeat(depth - 1));
        let doc = doc.replacen('{', &format!("{{\"x-unknown\":{deep},"), 1);
        match refuse(with_metadata(&bytes, &map, doc.as_bytes())) {
            e @ FormatError::BadMetadata { .. } => {
                assert!(e.to_string().contains("deeper than 128"), "{e}")
            }
            other => panic!("depth {depth}: expected BadMetadata, got {other:?}"),
        }
    }
    // 128 levels in all (the document's object and 127 arrays) are within the limit.
    let ok = format!("{}{}", "[".repeat(127), "]".repeat(127));
    let doc = doc.replacen('{', &format!("{{\"x-unknown\":{ok},"), 1);
    open(with_metadata(&bytes, &map, doc.as_bytes())).unwrap();
}

#[test]
fn a_config_the_runner_cannot_build_is_refused_at_open() {
    let (bytes, map) = sample();
    let doc = String::from_utf8(bytes[map.meta.clone()].to_vec()).unwrap();
    let doc = doc.replace("\"hidden_size\":64", "\"hidden_size\":0");
    match refuse(with_metadata(&bytes, &map, doc.as_bytes())) {
        FormatError::BadMetadata { field, .. } => assert_eq!(field, "config.hidden_size"),
        other => panic!("expected BadMetadata, got {other:?}"),
    }
}
