//! Packed metadata fields (format 1.3): the writer moves large tokenizer files into the files
//! section, zlib-compressed; the reader puts them back; and a damaged, truncated or hostile
//! files section is refused naming the file and the field, without a panic and without an
//! allocation sized by a declared length.

mod common;

use common::{
    assemble, assemble_with_files, at, largest_allocation_during, open, reseal, sample_metadata,
    sample_specs, set_u64, tensor_bytes, u64_at, write_file, TrackingAlloc, LABEL,
};
use kiln_format::layout::{MAX_FILES_LEN, MAX_METADATA_LEN};
use kiln_format::packed::{Encoding, PackedField, MAX_DEFLATE_RATIO, PACK_LEVEL, PACK_MIN_LEN};
use kiln_format::{DType, FormatError, KilnWriter, Metadata, TensorSpec};

#[global_allocator]
static ALLOC: TrackingAlloc = TrackingAlloc;

/// Largest single allocation the reader may make while refusing a crafted file of a few
/// kilobytes: far below any length the hostile records declare.
const ALLOC_BOUND: usize = 1 << 20;

/// A tokenizer.json past [`PACK_MIN_LEN`], with quotes and backslashes (escaped in JSON) and
/// non-ASCII text, as real vocabularies have.
fn big_tokenizer_json() -> String {
    let mut s = String::from(r#"{"model":{"type":"BPE","vocab":{"#);
    let mut i = 0;
    while s.len() < PACK_MIN_LEN + 5000 {
        s.push_str(&format!(r#""▁t\"ok\\{i}":{i},"#));
        i += 1;
    }
    s.push_str(r#""end":0},"merges":["a b"]}}"#);
    s
}

/// The sample metadata with a large `tokenizer.json` and `tokenizer_config.json`.
fn packed_metadata() -> Metadata {
    let mut m = sample_metadata();
    m.tokenizer.tokenizer_json = Some(big_tokenizer_json());
    m.tokenizer.tokenizer_config_json = Some(format!(
        r#"{{"added_tokens_decoder":{{{}}}}}"#,
        (0..4000)
            .map(|i| format!(r#""{i}":{{"content":"<unused{i}>","special":true}}"#))
            .collect::<Vec<_>>()
            .join(",")
    ));
    m
}

fn zlib(text: &str) -> Vec<u8> {
    miniz_oxide::deflate::compress_to_vec_zlib(text.as_bytes(), PACK_LEVEL)
}

/// One files-section record.
fn record(key: &str, encoding: u32, len: u64, stored: &[u8]) -> Vec<u8> {
    let mut r = Vec::new();
    r.extend_from_slice(&(key.len() as u32).to_le_bytes());
    r.extend_from_slice(key.as_bytes());
    r.extend_from_slice(&encoding.to_le_bytes());
    r.extend_from_slice(&len.to_le_bytes());
    r.extend_from_slice(&(stored.len() as u64).to_le_bytes());
    r.extend_from_slice(stored);
    r
}

/// The sample metadata as JSON with `tokenizer_json` left out (to be packed).
fn json_without_tokenizer_json() -> Vec<u8> {
    let mut m = sample_metadata();
    m.tokenizer.tokenizer_json = None;
    serde_json::to_vec(&m).unwrap()
}

/// A file without tensors whose files section is `files`.
fn crafted(files: &[u8]) -> Vec<u8> {
    assemble_with_files(&json_without_tokenizer_json(), &[], 0, files, &[])
}

/// Open `bytes`, which must be refused with `BadMetadata` for `field`, `needle` in the reason,
/// the file named, and no allocation over [`ALLOC_BOUND`].
#[track_caller]
fn refuse_field(bytes: Vec<u8>, field: &str, needle: &str) -> String {
    let (result, largest) = largest_allocation_during(|| open(bytes));
    let e = match result {
        Ok(_) => panic!("a corrupt files section was accepted ({field}, {needle})"),
        Err(e) => e,
    };
    let msg = e.to_string();
    assert!(msg.contains(LABEL), "{msg}");
    assert!(largest <= ALLOC_BOUND, "allocated {largest} bytes: {msg}");
    match e {
        FormatError::BadMetadata {
            field: f, reason, ..
        } => {
            assert_eq!(f, field, "{msg}");
            assert!(reason.contains(needle), "expected {needle:?} in: {msg}");
        }
        other => panic!("expected BadMetadata {{ field: {field} }}, got {other:?}"),
    }
    msg
}

// ---------------------------------------------------------------------------------------------
// Writing and reading back.

#[test]
fn large_tokenizer_files_are_packed_and_read_back_exactly() {
    let meta = packed_metadata();
    let bytes = write_file(&meta, sample_specs());
    let f = open(bytes.clone()).unwrap();
    assert_eq!(
        f.version(),
        (1, 3),
        "a file with packed fields is format 1.3"
    );
    assert_eq!(f.metadata(), &meta, "every field reads back as written");
    f.verify().unwrap();
    let packed: Vec<_> = f.packed_fields().iter().map(|p| p.field).collect();
    assert_eq!(
        packed,
        [PackedField::TokenizerJson, PackedField::TokenizerConfigJson],
        "the short chat template stays in the JSON"
    );
    for p in f.packed_fields() {
        assert_eq!(p.encoding, Encoding::Zlib);
        assert!(p.stored_len * 3 < p.len, "{p:?}");
    }
    // The JSON document holds neither file, and the files section is far smaller than the text.
    let json = &bytes[128..128 + u64_at(&bytes, at::METADATA_LEN) as usize];
    let doc: serde_json::Value = serde_json::from_slice(json).unwrap();
    assert!(doc["tokenizer"]["tokenizer_json"].is_null());
    assert!(doc["tokenizer"]["tokenizer_config_json"].is_null());
    assert!(doc["tokenizer"]["chat_template"].is_string());
    let text: u64 = f.packed_fields().iter().map(|p| p.len).sum();
    let files_len = u64_at(&bytes, at::FILES_LEN);
    assert!(files_len * 4 < text, "{files_len} bytes for {text}");
    // Written twice, the same bytes: compression is deterministic.
    assert_eq!(write_file(&meta, sample_specs()), bytes);
}

#[test]
fn small_metadata_is_not_packed_and_keeps_the_old_minor() {
    let (bytes, _) = common::sample();
    assert_eq!(u64_at(&bytes, at::FILES_LEN), 0);
    let f = open(bytes).unwrap();
    assert_eq!(f.version(), (1, 0));
    assert!(f.packed_fields().is_empty());
    // Exactly at the threshold a field is packed; one byte short it is not.
    for (len, packed) in [(PACK_MIN_LEN - 1, false), (PACK_MIN_LEN, true)] {
        let mut m = sample_metadata();
        m.tokenizer.chat_template = Some("x".repeat(len));
        let f = open(write_file(&m, sample_specs())).unwrap();
        assert_eq!(f.packed_fields().len(), usize::from(packed), "{len}");
        assert_eq!(f.version(), (1, if packed { 3 } else { 0 }), "{len}");
        assert_eq!(f.metadata(), &m);
    }
}

#[test]
fn packed_fields_with_newer_dtypes_take_the_larger_minor() {
    let mut specs = sample_specs();
    specs.push(TensorSpec {
        name: "extra.weight".into(),
        dtype: DType::Q4_K,
        shape: vec![1, 256],
    });
    let f = open(write_file(&packed_metadata(), specs)).unwrap();
    assert_eq!(f.version(), (1, 3));
}

#[test]
fn replace_metadata_keeps_the_packed_fields() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.kiln");
    let meta = packed_metadata();
    let mut w = KilnWriter::create(&path, &meta, sample_specs(), false).unwrap();
    // Same length, other provenance: accepted.
    let mut same_len = meta.clone();
    same_len.provenance[0].sources[0].sha256 = "11".repeat(32);
    w.replace_metadata(&same_len).unwrap();
    // Another packed text, even of the same length: refused, naming the field.
    let mut other = same_len.clone();
    let t = other.tokenizer.tokenizer_json.as_mut().unwrap();
    t.replace_range(t.len() - 3..t.len() - 2, "x");
    let e = w.replace_metadata(&other).unwrap_err();
    assert!(e.to_string().contains("packed tokenizer files"), "{e}");
    for i in 0..w.len() {
        w.write_tensor(i, &tensor_bytes(i, w.tensor_len(i)))
            .unwrap();
    }
    w.finish().unwrap();
    let f = kiln_format::KilnFile::open(&path).unwrap();
    assert_eq!(f.metadata(), &same_len);
}

#[test]
fn a_stored_record_reads_as_is() {
    let text = big_tokenizer_json();
    let files = record(
        PackedField::TokenizerJson.key(),
        0,
        text.len() as u64,
        text.as_bytes(),
    );
    let f = open(crafted(&files)).unwrap();
    assert_eq!(
        f.metadata().tokenizer.tokenizer_json.as_deref(),
        Some(&*text)
    );
    assert_eq!(f.packed_fields()[0].encoding, Encoding::Stored);
}

// ---------------------------------------------------------------------------------------------
// Damaged and hostile files sections.

const KEY: &str = "tokenizer.tokenizer_json";

fn zlib_record() -> (String, Vec<u8>) {
    let text = big_tokenizer_json();
    let z = zlib(&text);
    (text.clone(), record(KEY, 1, text.len() as u64, &z))
}

#[test]
fn a_crafted_zlib_record_reads() {
    let (text, files) = zlib_record();
    let f = open(crafted(&files)).unwrap();
    assert_eq!(f.metadata().tokenizer.tokenizer_json, Some(text));
}

#[test]
fn any_flipped_files_byte_fails_the_header_checksum() {
    let (_, files) = zlib_record();
    let bytes = crafted(&files);
    let start = (u64_at(&bytes, at::INDEX_OFFSET) + u64_at(&bytes, at::INDEX_LEN)) as usize;
    assert_eq!(&bytes[start..start + files.len()], &files[..]);
    for i in (start..start + files.len()).step_by(97) {
        let mut b = bytes.clone();
        b[i] ^= 0x10;
        match open(b) {
            Err(FormatError::HeaderChecksum { file, .. }) => assert_eq!(file, LABEL),
            other => panic!("byte {i}: expected HeaderChecksum, got {other:?}"),
        }
    }
}

#[test]
fn a_corrupt_zlib_stream_is_refused_naming_the_field() {
    let text = big_tokenizer_json();
    let mut z = zlib(&text);
    let mid = z.len() / 2;
    for b in &mut z[mid..mid + 16] {
        *b ^= 0xA5;
    }
    let files = record(KEY, 1, text.len() as u64, &z);
    refuse_field(crafted(&files), KEY, "zlib stream");
}

#[test]
fn a_truncated_zlib_stream_is_refused_naming_the_field() {
    let text = big_tokenizer_json();
    let z = zlib(&text);
    for cut in [z.len() / 3, z.len() - 5, z.len() - 1] {
        let files = record(KEY, 1, text.len() as u64, &z[..cut]);
        refuse_field(crafted(&files), KEY, "zlib stream");
    }
}

#[test]
fn a_declared_length_that_differs_from_the_text_is_refused() {
    let text = big_tokenizer_json();
    let z = zlib(&text);
    let n = text.len() as u64;
    refuse_field(crafted(&record(KEY, 1, n - 1, &z)), KEY, "more than the");
    refuse_field(crafted(&record(KEY, 1, n + 1, &z)), KEY, "decodes to");
    refuse_field(
        crafted(&record(KEY, 0, n + 1, text.as_bytes())),
        KEY,
        "declares",
    );
}

#[test]
fn an_oversized_declared_length_is_refused_before_allocating() {
    // A zip bomb's claims: past the metadata limit, and within it but past what deflate can
    // expand the stored bytes to. Neither allocates the declared length.
    let z = zlib("tiny");
    for len in [u64::MAX, MAX_METADATA_LEN, MAX_METADATA_LEN / 2] {
        let msg = refuse_field(crafted(&record(KEY, 1, len, &z)), KEY, "");
        assert!(
            msg.contains("limit") || msg.contains("deflate can expand"),
            "{msg}"
        );
    }
    let len = z.len() as u64 * MAX_DEFLATE_RATIO + 1;
    refuse_field(
        crafted(&record(KEY, 1, len, &z)),
        KEY,
        "more than deflate can expand",
    );
}

#[test]
fn a_stored_length_past_the_section_is_refused() {
    let (_, mut files) = zlib_record();
    let stored_len_at = 4 + KEY.len() + 4 + 8;
    for len in [u64::MAX, files.len() as u64] {
        files[stored_len_at..stored_len_at + 8].copy_from_slice(&len.to_le_bytes());
        refuse_field(crafted(&files), KEY, "remain in the files section");
    }
}

#[test]
fn a_record_cut_short_is_refused() {
    let (_, files) = zlib_record();
    // Before the key is read the record is named by its section, after it by its field.
    for cut in [1, 4] {
        refuse_field(
            crafted(&files[..cut]),
            "(files section)",
            "files section offset",
        );
    }
    for cut in [4 + KEY.len(), 4 + KEY.len() + 4, 4 + KEY.len() + 12] {
        refuse_field(crafted(&files[..cut]), KEY, "files section offset");
    }
    refuse_field(
        crafted(&files[..4 + KEY.len() + 20]),
        KEY,
        "remain in the files section",
    );
}

#[test]
fn unknown_keys_and_encodings_are_refused_as_newer() {
    let z = zlib("{}");
    refuse_field(
        crafted(&record("tokenizer.vocab", 1, 2, &z)),
        "tokenizer.vocab",
        "newer Kiln",
    );
    refuse_field(crafted(&record(KEY, 2, 2, &z)), KEY, "newer Kiln");
    let e = refuse_field(
        crafted(&record("", 1, 2, &z)),
        "(files section)",
        "key length",
    );
    assert!(e.contains("1..="), "{e}");
    let mut bad_utf8 = record("tokenizer.x", 1, 2, &z);
    bad_utf8[4] = 0xFF;
    refuse_field(crafted(&bad_utf8), "(files section)", "UTF-8");
}

#[test]
fn a_field_packed_twice_or_also_in_the_json_is_refused() {
    let z = zlib("{}");
    let mut twice = record(KEY, 1, 2, &z);
    twice.extend(record(KEY, 1, 2, &z));
    refuse_field(crafted(&twice), KEY, "twice");
    let json = serde_json::to_vec(&sample_metadata()).unwrap();
    let both = assemble_with_files(&json, &[], 0, &record(KEY, 1, 2, &z), &[]);
    refuse_field(
        both,
        KEY,
        "both in the JSON document and in the files section",
    );
}

#[test]
fn decoded_text_that_is_not_utf8_is_refused() {
    let bytes = [b'{', 0xC3, 0x28, b'}'];
    refuse_field(crafted(&record(KEY, 0, 4, &bytes)), KEY, "not UTF-8");
    let z = miniz_oxide::deflate::compress_to_vec_zlib(&bytes, PACK_LEVEL);
    refuse_field(crafted(&record(KEY, 1, 4, &z)), KEY, "not UTF-8");
}

#[test]
fn files_len_past_the_end_or_over_the_limit_is_refused() {
    let (_, files) = zlib_record();
    let bytes = crafted(&files);
    let mut past = bytes.clone();
    let len = u64_at(&past, at::FILES_LEN) + 4096;
    set_u64(&mut past, at::FILES_LEN, len);
    let data_offset =
        (u64_at(&past, at::INDEX_OFFSET) + u64_at(&past, at::INDEX_LEN) + len).div_ceil(64) * 64;
    set_u64(&mut past, at::DATA_OFFSET, data_offset);
    reseal(&mut past);
    match open(past) {
        Err(FormatError::Truncated { what, file, .. }) => {
            assert_eq!(what, "the files section");
            assert_eq!(file, LABEL);
        }
        other => panic!("expected Truncated, got {other:?}"),
    }
    let mut over = bytes;
    set_u64(&mut over, at::FILES_LEN, MAX_FILES_LEN + 1);
    reseal(&mut over);
    match open(over) {
        Err(FormatError::BadHeader { field, .. }) => assert_eq!(field, "files_len"),
        other => panic!("expected BadHeader files_len, got {other:?}"),
    }
}

#[test]
fn truncation_anywhere_in_a_packed_file_is_refused() {
    let (_, files) = zlib_record();
    let bytes = crafted(&files);
    for cut in (0..bytes.len()).step_by(61) {
        assert!(open(bytes[..cut].to_vec()).is_err(), "cut at {cut}");
    }
}

#[test]
fn a_file_without_a_files_section_is_unchanged_by_1_3() {
    // What a 1.0-1.2 writer produced: reserved bytes 72..96 zero, which 1.3 reads as an empty
    // files section.
    let json = serde_json::to_vec(&sample_metadata()).unwrap();
    let f = open(assemble(&json, &[], 0, &[])).unwrap();
    assert_eq!(f.version(), (1, 0));
    assert_eq!(f.metadata(), &sample_metadata());
}
