//! Packed metadata fields: the large text fields of the metadata (the tokenizer files) stored
//! outside the JSON document, zlib-compressed, in the files section (format 1.3).
//!
//! Why: inside the JSON document a tokenizer file is a JSON string, so every quote and
//! backslash it holds is escaped and nothing is compressed. The `tokenizer.json` that a GGUF
//! import rebuilds for Gemma 3 (262 144 tokens, 514 906 merges) is 14.4 MB of text that way;
//! deflated it is 4.7 MB, which is what brings the `.kiln` of a Q4_K_M GGUF within 2% of the
//! GGUF's size (docs/FORMAT.md, section 6a).
//!
//! - `split` and `pack` (the writer) take the fields of [`PackedField::ALL`] that are at
//!   least [`PACK_MIN_LEN`] bytes out of a [`Metadata`], and encode them as the files section.
//! - `unpack` (the reader) validates the section, inflates each field into an allocation of
//!   its declared, bounded size, and puts it back where it came from, so every program reads
//!   `metadata().tokenizer` the same whatever the encoding.
//!
//! A section record is `u32 key_len, key, u32 encoding, u64 len, u64 stored_len, stored bytes`;
//! the records fill the section exactly.

use sha2::{Digest, Sha256};

use crate::error::{FormatError, Result};
use crate::layout::Cursor;
use crate::metadata::{Metadata, TokenizerFiles};

/// Fields at least this long are packed. Shorter ones stay in the JSON document: packing them
/// would save at most a few kilobytes, and a file with nothing packed stays readable by every
/// 1.x reader (it needs no 1.3).
pub const PACK_MIN_LEN: usize = 64 << 10;

/// The zlib level the writer uses: miniz's default. On Gemma 3's 14.4 MB `tokenizer.json`,
/// level 9 saves 2% more at about five times the time.
pub const PACK_LEVEL: u8 = 6;

/// The most a deflate stream can expand: a 258-byte match costs at least two bits, so a stored
/// length times 1032 bounds the decoded length. A record declaring more is refused before
/// anything is allocated for it.
pub const MAX_DEFLATE_RATIO: u64 = 1032;

/// Longest key accepted in a record (the known keys are under 40 bytes).
pub const MAX_KEY_LEN: u32 = 256;

/// A metadata field that may be packed, named in the files section by its JSON path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PackedField {
    /// `tokenizer.tokenizer_json`.
    TokenizerJson,
    /// `tokenizer.tokenizer_config_json`.
    TokenizerConfigJson,
    /// `tokenizer.chat_template`.
    ChatTemplate,
}

impl PackedField {
    /// Every field a writer may pack, in the order it writes them.
    pub const ALL: [PackedField; 3] = [
        PackedField::TokenizerJson,
        PackedField::TokenizerConfigJson,
        PackedField::ChatTemplate,
    ];

    /// The key stored in the files section: the field's path in the JSON document.
    pub const fn key(self) -> &'static str {
        match self {
            PackedField::TokenizerJson => "tokenizer.tokenizer_json",
            PackedField::TokenizerConfigJson => "tokenizer.tokenizer_config_json",
            PackedField::ChatTemplate => "tokenizer.chat_template",
        }
    }

    /// The field stored under `key`, if this build knows it.
    pub fn from_key(key: &str) -> Option<PackedField> {
        PackedField::ALL.into_iter().find(|f| f.key() == key)
    }

    fn get(self, t: &TokenizerFiles) -> Option<&str> {
        match self {
            PackedField::TokenizerJson => t.tokenizer_json.as_deref(),
            PackedField::TokenizerConfigJson => t.tokenizer_config_json.as_deref(),
            PackedField::ChatTemplate => t.chat_template.as_deref(),
        }
    }

    fn slot(self, t: &mut TokenizerFiles) -> &mut Option<String> {
        match self {
            PackedField::TokenizerJson => &mut t.tokenizer_json,
            PackedField::TokenizerConfigJson => &mut t.tokenizer_config_json,
            PackedField::ChatTemplate => &mut t.chat_template,
        }
    }
}

/// How a packed field's bytes are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// The text as is (id 0): for writers without a compressor.
    Stored,
    /// A zlib stream (RFC 1950: deflate with an Adler-32 of the text; id 1). Kiln writes this.
    Zlib,
}

impl Encoding {
    /// The id stored in a record.
    pub const fn id(self) -> u32 {
        match self {
            Encoding::Stored => 0,
            Encoding::Zlib => 1,
        }
    }

    /// The encoding of id `id`, if this build knows it.
    pub const fn from_id(id: u32) -> Option<Encoding> {
        match id {
            0 => Some(Encoding::Stored),
            1 => Some(Encoding::Zlib),
            _ => None,
        }
    }

    /// Lower-case name for reports.
    pub const fn name(self) -> &'static str {
        match self {
            Encoding::Stored => "stored",
            Encoding::Zlib => "zlib",
        }
    }
}

/// One packed field as a file stores it (for reports such as `kiln-convert inspect`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedInfo {
    /// Which field.
    pub field: PackedField,
    /// How it is stored.
    pub encoding: Encoding,
    /// Decoded length in bytes (the text's UTF-8 length).
    pub len: u64,
    /// Bytes it takes in the files section.
    pub stored_len: u64,
}

/// A metadata document split for writing: the document without its packed fields, and those.
#[derive(Debug)]
pub(crate) struct Split<'m> {
    /// The document with every packed field set to null.
    pub json: Vec<u8>,
    /// The fields taken out, in [`PackedField::ALL`] order.
    pub fields: Vec<(PackedField, &'m str)>,
}

impl Split<'_> {
    /// Total decoded length of the packed fields.
    pub fn packed_len(&self) -> u64 {
        self.fields.iter().map(|(_, t)| t.len() as u64).sum()
    }

    /// A digest of the packed fields (keys and texts), so that a replacement document can be
    /// checked to pack exactly the same text without compressing it again.
    pub fn digest(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        for (f, text) in &self.fields {
            h.update(f.key().as_bytes());
            h.update((text.len() as u64).to_le_bytes());
            h.update(text.as_bytes());
        }
        h.finalize().into()
    }

    /// Encode the packed fields as the files section: each one zlib-compressed at
    /// [`PACK_LEVEL`]. Deterministic for a given build, so a file written twice is identical.
    pub fn section(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for (f, text) in &self.fields {
            let stored = miniz_oxide::deflate::compress_to_vec_zlib(text.as_bytes(), PACK_LEVEL);
            out.extend_from_slice(&(f.key().len() as u32).to_le_bytes());
            out.extend_from_slice(f.key().as_bytes());
            out.extend_from_slice(&Encoding::Zlib.id().to_le_bytes());
            out.extend_from_slice(&(text.len() as u64).to_le_bytes());
            out.extend_from_slice(&(stored.len() as u64).to_le_bytes());
            out.extend_from_slice(&stored);
        }
        out
    }
}

/// Take the fields of at least [`PACK_MIN_LEN`] bytes out of `metadata` and serialize the rest.
pub(crate) fn split(metadata: &Metadata) -> serde_json::Result<Split<'_>> {
    let fields: Vec<(PackedField, &str)> = PackedField::ALL
        .into_iter()
        .filter_map(|f| f.get(&metadata.tokenizer).map(|t| (f, t)))
        .filter(|(_, t)| t.len() >= PACK_MIN_LEN)
        .collect();
    let json = if fields.is_empty() {
        serde_json::to_vec(metadata)?
    } else {
        // Only the small fields are cloned; the packed ones are left out of the copy.
        let keep = |f: PackedField| {
            (!fields.iter().any(|(p, _)| *p == f))
                .then(|| f.get(&metadata.tokenizer).map(str::to_string))
                .flatten()
        };
        let slim = Metadata {
            config: metadata.config.clone(),
            tokenizer: TokenizerFiles {
                tokenizer_json: keep(PackedField::TokenizerJson),
                tokenizer_config_json: keep(PackedField::TokenizerConfigJson),
                chat_template: keep(PackedField::ChatTemplate),
                special_tokens: metadata.tokenizer.special_tokens.clone(),
                add_bos_token: metadata.tokenizer.add_bos_token,
            },
            generation: metadata.generation.clone(),
            provenance: metadata.provenance.clone(),
        };
        serde_json::to_vec(&slim)?
    };
    Ok(Split { json, fields })
}

/// Read the files section into `metadata`, whose JSON document must leave each packed field
/// null. `budget` is how many decoded bytes the fields may add up to (the metadata limit
/// minus the JSON document): checked against each record's declared length before inflating.
pub(crate) fn unpack(
    label: &str,
    section: &[u8],
    metadata: &mut Metadata,
    budget: u64,
) -> Result<Vec<PackedInfo>> {
    let bad = |field: &str, reason: String| FormatError::BadMetadata {
        file: label.to_string(),
        field: field.to_string(),
        reason,
    };
    const SECTION: &str = "(files section)";
    let mut cur = Cursor::over(section, "files section");
    let mut left = budget;
    let mut infos: Vec<PackedInfo> = Vec::new();
    while cur.remaining() > 0 {
        let key_len = cur.u32("key length").map_err(|e| bad(SECTION, e))?;
        if key_len == 0 || key_len > MAX_KEY_LEN {
            return Err(bad(
                SECTION,
                format!("key length {key_len} is outside 1..={MAX_KEY_LEN}"),
            ));
        }
        let key = cur
            .take(key_len as usize, "key")
            .map_err(|e| bad(SECTION, e))?;
        let key = std::str::from_utf8(key)
            .map_err(|e| bad(SECTION, format!("a key is not UTF-8: {e}")))?;
        let field = PackedField::from_key(key).ok_or_else(|| {
            bad(
                key,
                format!(
                    "unknown packed field (this build knows {}); the file may come from a \
                     newer Kiln",
                    PackedField::ALL.map(PackedField::key).join(", ")
                ),
            )
        })?;
        if infos.iter().any(|i| i.field == field) {
            return Err(bad(key, "packed twice in the files section".into()));
        }
        let id = cur.u32("encoding").map_err(|e| bad(key, e))?;
        let encoding = Encoding::from_id(id).ok_or_else(|| {
            bad(
                key,
                format!(
                    "unknown encoding id {id} (this build knows 0 = stored, 1 = zlib); the \
                     file may come from a newer Kiln"
                ),
            )
        })?;
        let len = cur.u64("decoded length").map_err(|e| bad(key, e))?;
        let stored_len = cur.u64("stored length").map_err(|e| bad(key, e))?;
        if len > left {
            return Err(bad(
                key,
                format!(
                    "declares {len} decoded bytes; with the JSON document and the fields before \
                     it the metadata would pass its limit of {} bytes",
                    crate::layout::MAX_METADATA_LEN
                ),
            ));
        }
        let stored = usize::try_from(stored_len)
            .ok()
            .and_then(|n| cur.take(n, "stored bytes").ok())
            .ok_or_else(|| {
                bad(
                    key,
                    format!(
                        "{stored_len} stored bytes declared, but only {} remain in the files \
                         section",
                        cur.remaining()
                    ),
                )
            })?;
        let bytes = decode(encoding, stored, len).map_err(|e| bad(key, e))?;
        let text = String::from_utf8(bytes).map_err(|e| {
            bad(
                key,
                format!("the decoded text is not UTF-8: {}", e.utf8_error()),
            )
        })?;
        let slot = field.slot(&mut metadata.tokenizer);
        if slot.is_some() {
            return Err(bad(
                key,
                "is both in the JSON document and in the files section".into(),
            ));
        }
        *slot = Some(text);
        left -= len;
        infos.push(PackedInfo {
            field,
            encoding,
            len,
            stored_len,
        });
    }
    Ok(infos)
}

/// Decode one record's stored bytes to exactly `len` bytes. The output is allocated once, at
/// the declared length, after checking that the stored bytes could decode to that much.
fn decode(encoding: Encoding, stored: &[u8], len: u64) -> std::result::Result<Vec<u8>, String> {
    match encoding {
        Encoding::Stored => {
            if stored.len() as u64 != len {
                return Err(format!(
                    "stored (uncompressed) with {} bytes, but declares {len}",
                    stored.len()
                ));
            }
            Ok(stored.to_vec())
        }
        Encoding::Zlib => {
            let most = (stored.len() as u64).saturating_mul(MAX_DEFLATE_RATIO);
            if len > most {
                return Err(format!(
                    "declares {len} decoded bytes from {} zlib bytes, more than deflate can \
                     expand to ({most})",
                    stored.len()
                ));
            }
            inflate_zlib(stored, len as usize)
        }
    }
}

/// Inflate a whole zlib stream into exactly `len` bytes: the stream must end, check its
/// Adler-32, fill the buffer exactly and be followed by nothing.
fn inflate_zlib(stored: &[u8], len: usize) -> std::result::Result<Vec<u8>, String> {
    use miniz_oxide::inflate::core::inflate_flags::{
        TINFL_FLAG_PARSE_ZLIB_HEADER, TINFL_FLAG_USING_NON_WRAPPING_OUTPUT_BUF,
    };
    use miniz_oxide::inflate::core::{decompress, DecompressorOxide};
    use miniz_oxide::inflate::TINFLStatus;

    let mut out = vec![0u8; len];
    let mut state = Box::<DecompressorOxide>::default();
    let flags = TINFL_FLAG_PARSE_ZLIB_HEADER | TINFL_FLAG_USING_NON_WRAPPING_OUTPUT_BUF;
    let (status, read, written) = decompress(&mut state, stored, &mut out, 0, flags);
    match status {
        TINFLStatus::Done if written != len => Err(format!(
            "the zlib stream decodes to {written} bytes, but {len} are declared"
        )),
        TINFLStatus::Done if read != stored.len() => Err(format!(
            "{} bytes follow the end of the zlib stream",
            stored.len() - read
        )),
        TINFLStatus::Done => Ok(out),
        TINFLStatus::HasMoreOutput => Err(format!(
            "the zlib stream decodes to more than the {len} bytes declared"
        )),
        TINFLStatus::Adler32Mismatch => Err(
            "the zlib stream's Adler-32 does not match the decoded text: the stream is corrupt"
                .into(),
        ),
        TINFLStatus::NeedsMoreInput | TINFLStatus::FailedCannotMakeProgress => Err(format!(
            "the zlib stream is truncated: it ends after {written} of {len} decoded bytes"
        )),
        other => Err(format!(
            "the zlib stream is corrupt ({other:?} after {written} decoded bytes)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zlib(text: &[u8]) -> Vec<u8> {
        miniz_oxide::deflate::compress_to_vec_zlib(text, PACK_LEVEL)
    }

    fn text(n: usize) -> Vec<u8> {
        (0..n).map(|i| b"merges ab cd\n"[i % 13]).collect()
    }

    #[test]
    fn inflate_gives_back_the_text() {
        for n in [0, 1, 100, PACK_MIN_LEN, 3 << 20] {
            let t = text(n);
            assert_eq!(decode(Encoding::Zlib, &zlib(&t), n as u64).unwrap(), t);
            assert_eq!(decode(Encoding::Stored, &t, n as u64).unwrap(), t);
        }
    }

    #[test]
    fn a_wrong_declared_length_is_refused_either_way() {
        let t = text(5000);
        let z = zlib(&t);
        let short = decode(Encoding::Zlib, &z, 4999).unwrap_err();
        assert!(short.contains("more than the 4999 bytes"), "{short}");
        let long = decode(Encoding::Zlib, &z, 5001).unwrap_err();
        assert!(long.contains("decodes to 5000 bytes"), "{long}");
        let stored = decode(Encoding::Stored, &t, 5001).unwrap_err();
        assert!(stored.contains("declares 5001"), "{stored}");
    }

    #[test]
    fn a_length_past_deflates_ratio_is_refused_before_allocating() {
        let e = decode(Encoding::Zlib, &[0x78, 0x9c], u64::MAX / 2).unwrap_err();
        assert!(e.contains("more than deflate can expand"), "{e}");
    }

    #[test]
    fn corrupt_truncated_and_trailing_streams_are_errors() {
        let t = text(70_000);
        let z = zlib(&t);
        let n = t.len() as u64;
        for cut in [0, 1, 2, z.len() / 2, z.len() - 4, z.len() - 1] {
            let e = decode(Encoding::Zlib, &z[..cut], n.min(cut as u64 * 1032)).unwrap_err();
            assert!(!e.is_empty(), "cut at {cut}");
        }
        let mut trailing = z.clone();
        trailing.push(0);
        let e = decode(Encoding::Zlib, &trailing, n).unwrap_err();
        assert!(e.contains("1 bytes follow"), "{e}");
        let mut adler = z.clone();
        *adler.last_mut().unwrap() ^= 1;
        let e = decode(Encoding::Zlib, &adler, n).unwrap_err();
        assert!(e.contains("Adler-32"), "{e}");
        // A changed byte anywhere is an error (or, for padding bits after the last block, the
        // same text): never a panic, never another length.
        let mut refused = 0;
        for i in 0..z.len() {
            let mut b = z.clone();
            b[i] ^= 0x55;
            match decode(Encoding::Zlib, &b, n) {
                Ok(d) => assert_eq!(d, t, "byte {i}"),
                Err(_) => refused += 1,
            }
        }
        assert!(refused + 2 >= z.len(), "{refused} of {} refused", z.len());
    }

    #[test]
    fn keys_and_encodings_round_trip() {
        for f in PackedField::ALL {
            assert_eq!(PackedField::from_key(f.key()), Some(f));
        }
        assert_eq!(PackedField::from_key("tokenizer.merges"), None);
        for e in [Encoding::Stored, Encoding::Zlib] {
            assert_eq!(Encoding::from_id(e.id()), Some(e));
        }
        assert_eq!(Encoding::from_id(2), None);
    }
}
