//! Texts from the command line, a file or a stream → vectors as JSON lines or a `.npy`
//! array, in memory flat in the number and length of the texts: `kiln-run embed`'s pipeline.
//!
//! - [`InputTokenizer`] cuts a text to a prefix that surely holds the tokens an [`Embedder`]
//!   keeps before tokenizing it: tokenizing costs about 190 bytes per byte of text, and one
//!   40 MB line once took 8 GB and two minutes only to keep its first 64 tokens.
//! - A [`TextSource`] gives the texts: [`GivenTexts`] (`-p`) or [`Lines`] (a file or standard
//!   input, one text a line, each line at most [`MAX_LINE_BYTES`], of which only what the
//!   tokenizer needs is kept).
//! - A [`RowWriter`] takes the vectors: [`JsonLines`] or [`NpyWriter`], which streams rows and
//!   patches the row count into a fixed-width header at the end.
//! - [`EmbedStream::run`] reads, tokenizes, embeds and writes a batch at a time, so a million
//!   lines cost what one batch does; every empty text shares one vector, computed once.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Seek, SeekFrom, Write};
use std::path::Path;

use serde::Serialize;

use crate::embed::Embedder;
use crate::error::{Result, RunnerError};
use crate::generate::Interrupt;
use crate::tokenizer::Tokenizer;

/// Longest line [`Lines`] reads: 64 MiB, the limit `kiln-run` puts on any text file, far
/// beyond what a model keeps of a text. A line is never held whole (only what the tokenizer
/// needs of it is kept), so this only ends an endless line (`/dev/zero` piped in) with an
/// error instead of a hang.
pub const MAX_LINE_BYTES: usize = 64 << 20;

/// Texts needing a forward pass per batch: what the batch holds is their tokens, at most
/// this many times [`Embedder::max_tokens`] ids.
const BATCH_TEXTS: usize = 256;

/// Texts per batch at most, counting empty ones (which need no pass): bounds the batch's
/// bookkeeping when the input is mostly empty lines.
const BATCH_LINES: usize = 8192;

/// Bytes tokenized at first per token kept: English averages about 4.5 bytes a token; a text
/// that needs more gets its prefix doubled.
const FIRST_BYTES_PER_TOKEN: usize = 6;

/// Fewest bytes of a text tokenized at first: shorter texts are tokenized whole.
const FIRST_BYTES_MIN: usize = 4096;

/// Tokens tokenized past the ones kept, so that where the prefix was cut cannot change a kept
/// token. A cut (made at a space where one is near) changes only the tokens of the word it
/// splits, and a WordPiece word of at most 100 characters (longer ones become one unknown
/// token) gives at most 100 tokens.
const MARGIN_TOKENS: usize = 128;

/// Fewest bytes of one text tokenized in search of the tokens it keeps before it is refused:
/// 1 MiB, about 200 MB while tokenized.
const SCAN_BYTES_MIN: usize = 1 << 20;

/// Bytes tokenized per token kept before a text is refused, for models that keep more than
/// the 1 MiB of [`SCAN_BYTES_MIN`] covers.
const SCAN_BYTES_PER_TOKEN: usize = 32;

/// Tokenizes texts for an [`Embedder`], cutting each to its token limit as transformers'
/// `truncation=True` cuts, in memory bounded by the limit rather than by the text.
///
/// A text longer than a few bytes per kept token is cut (at a space, where one is in the
/// prefix's second half) to a prefix that is tokenized on its own; once a prefix gives
/// [`MARGIN_TOKENS`] more tokens than are kept, the kept tokens are the prefix's, which are
/// the ones the whole text would give. Otherwise the prefix doubles, up to
/// [`InputTokenizer::scan_limit`] bytes: a text longer than that whose prefix still holds too
/// few tokens (a run of characters a WordPiece vocabulary maps to one unknown token) is
/// refused, not tokenized whole.
#[derive(Debug)]
pub struct InputTokenizer<'t> {
    whole: &'t Tokenizer,
    cut: Tokenizer,
    max_tokens: usize,
}

impl<'t> InputTokenizer<'t> {
    /// Cut texts to `max_tokens` tokens (an [`Embedder::max_tokens`]) with `tokenizer`.
    pub fn new(tokenizer: &'t Tokenizer, max_tokens: usize) -> Result<InputTokenizer<'t>> {
        Ok(InputTokenizer {
            whole: tokenizer,
            cut: tokenizer.truncating(max_tokens)?,
            max_tokens,
        })
    }

    /// The most bytes of one text tokenized to find the tokens it keeps.
    pub fn scan_limit(&self) -> usize {
        self.max_tokens
            .saturating_add(MARGIN_TOKENS)
            .saturating_mul(SCAN_BYTES_PER_TOKEN)
            .max(SCAN_BYTES_MIN)
    }

    /// `text`'s tokens (special tokens included, at most the limit) and whether it was cut.
    pub fn encode(&self, text: &str) -> Result<(Vec<u32>, bool)> {
        self.encode_kept(text, text.len())
    }

    /// [`InputTokenizer::encode`] for a text of `len` bytes of which only `kept` was kept
    /// (a line read in part): `kept` must be whole if `len` is at most
    /// [`InputTokenizer::scan_limit`], else hold at least that many bytes less the pieces of
    /// one character.
    pub fn encode_kept(&self, kept: &str, len: usize) -> Result<(Vec<u32>, bool)> {
        let enough = self.max_tokens.saturating_add(MARGIN_TOKENS);
        let limit = self.scan_limit();
        let mut want = enough
            .saturating_mul(FIRST_BYTES_PER_TOKEN)
            .clamp(FIRST_BYTES_MIN, limit);
        while want < len {
            let prefix = &kept[..cut_before(kept, want)];
            let tokens = self.whole.encode(prefix)?.len();
            if tokens >= enough {
                let (ids, _) = self.cut.encode_cut(prefix)?;
                return Ok((ids, true));
            }
            if want >= limit {
                return Err(RunnerError::TextTooSparse {
                    bytes: len,
                    scanned: prefix.len(),
                    tokens,
                    max_tokens: self.max_tokens,
                });
            }
            want = want.saturating_mul(2).min(limit);
        }
        self.cut.encode_cut(kept)
    }
}

/// Where to cut `text` to at most `want` bytes: before the last whitespace of the prefix's
/// second half (a word boundary, so only the last word's tokens can differ from the whole
/// text's), else at the last character boundary.
fn cut_before(text: &str, want: usize) -> usize {
    let mut end = want.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let half = end / 2;
    text.as_bytes()[half..end]
        .iter()
        .rposition(u8::is_ascii_whitespace)
        .map_or(end, |i| half + i)
}

/// A text as a [`TextSource`] gives it: all of it, or its first bytes and its length.
#[derive(Debug, Clone, Copy)]
pub struct Text<'a> {
    /// The text, or as much of it as was kept (whole characters).
    pub kept: &'a str,
    /// Its whole length in bytes.
    pub len: usize,
}

/// Where texts come from.
pub trait TextSource {
    /// The next text, or `None` after the last: whole, or its first `keep` bytes at least
    /// (less the pieces of one character) when it is longer. An error names the text's place.
    fn next_text(&mut self, keep: usize) -> Result<Option<Text<'_>>>;

    /// Where text `index` (counting from 0) came from, for messages: "line 12 of a.txt".
    fn place(&self, index: u64) -> String;
}

/// Texts given one by one (`-p`), already in memory: each is given whole.
#[derive(Debug)]
pub struct GivenTexts {
    texts: Vec<String>,
    next: usize,
}

impl GivenTexts {
    /// The texts, in order.
    pub fn new(texts: Vec<String>) -> GivenTexts {
        GivenTexts { texts, next: 0 }
    }
}

impl TextSource for GivenTexts {
    fn next_text(&mut self, _keep: usize) -> Result<Option<Text<'_>>> {
        let text = self.texts.get(self.next).map(|t| Text {
            kept: t,
            len: t.len(),
        });
        self.next += 1;
        Ok(text)
    }

    fn place(&self, index: u64) -> String {
        format!("text {} (-p)", index + 1)
    }
}

/// One text per line of a file or stream, as `str::lines` splits them (`\n` or `\r\n`; a
/// last line without a newline counts, and no empty text follows a final newline), each read
/// only when the previous batch is done. Only the part of a line that is asked for is kept:
/// the rest is read through, checked as UTF-8 and counted, so a long line costs no more
/// memory than a short one.
#[derive(Debug)]
pub struct Lines<R> {
    reader: R,
    name: String,
    line: u64,
    buf: Vec<u8>,
}

impl<R: BufRead> Lines<R> {
    /// The lines of `reader`, called `name` in messages ("a.txt", "standard input").
    pub fn new(reader: R, name: impl Into<String>) -> Lines<R> {
        Lines {
            reader,
            name: name.into(),
            line: 0,
            buf: Vec::new(),
        }
    }

    /// Read the next line's first `keep` bytes into `buf`, through its end; its length (less
    /// a `\r` before the newline) and its first invalid byte, if any. `None` at the end.
    fn read_line(&mut self, keep: usize) -> Result<Option<(usize, Result<(), usize>)>> {
        let (mut len, mut check, mut last, mut any) = (0usize, Utf8Check::default(), None, false);
        loop {
            let chunk = match self.reader.fill_buf() {
                Ok(c) => c,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(RunnerError::io(format!("reading {}", self.name), e)),
            };
            if chunk.is_empty() {
                break;
            }
            any = true;
            let newline = chunk.iter().position(|&b| b == b'\n');
            let piece = &chunk[..newline.unwrap_or(chunk.len())];
            let room = keep.saturating_sub(self.buf.len()).min(piece.len());
            self.buf.extend_from_slice(&piece[..room]);
            check.feed(piece);
            last = piece.last().copied().or(last);
            len += piece.len();
            let used = piece.len() + usize::from(newline.is_some());
            self.reader.consume(used);
            if len > MAX_LINE_BYTES {
                return Err(self.in_line(RunnerError::LineTooLong {
                    limit: MAX_LINE_BYTES,
                }));
            }
            if newline.is_some() {
                if last == Some(b'\r') {
                    len -= 1;
                    self.buf.truncate(len.min(self.buf.len()));
                }
                break;
            }
        }
        Ok(any.then(|| (len, check.finish())))
    }

    fn in_line(&self, e: RunnerError) -> RunnerError {
        RunnerError::InText {
            place: format!("line {} of {}", self.line + 1, self.name),
            source: Box::new(e),
        }
    }
}

impl Lines<BufReader<File>> {
    /// The lines of `path`, a regular file (a FIFO or a device is refused at once).
    pub fn open(path: &Path) -> Result<Lines<BufReader<File>>> {
        let file = kiln_format::open_regular(path, "texts")?;
        Ok(Lines::new(
            BufReader::with_capacity(1 << 16, file),
            path.display().to_string(),
        ))
    }
}

impl<R: BufRead> TextSource for Lines<R> {
    fn next_text(&mut self, keep: usize) -> Result<Option<Text<'_>>> {
        self.buf.clear();
        let Some((len, utf8)) = self.read_line(keep)? else {
            return Ok(None);
        };
        if let Err(offset) = utf8 {
            return Err(self.in_line(RunnerError::TextNotUtf8 { offset }));
        }
        self.line += 1;
        // A cut may have split the last character kept.
        let kept = match std::str::from_utf8(&self.buf) {
            Ok(t) => t,
            Err(e) => std::str::from_utf8(&self.buf[..e.valid_up_to()]).unwrap_or_default(),
        };
        Ok(Some(Text { kept, len }))
    }

    fn place(&self, index: u64) -> String {
        format!("line {} of {}", index + 1, self.name)
    }
}

/// UTF-8 checked a piece at a time: a character split between two pieces is checked whole.
#[derive(Debug, Default)]
struct Utf8Check {
    /// The start of a character the last piece ended in.
    pending: [u8; 4],
    pending_len: usize,
    /// Bytes checked and found whole.
    offset: usize,
    /// The offset of the first invalid byte.
    bad: Option<usize>,
}

impl Utf8Check {
    /// Check `bytes`, the text's next piece.
    fn feed(&mut self, mut bytes: &[u8]) {
        while self.bad.is_none() && self.pending_len > 0 && !bytes.is_empty() {
            self.pending[self.pending_len] = bytes[0];
            self.pending_len += 1;
            bytes = &bytes[1..];
            match std::str::from_utf8(&self.pending[..self.pending_len]) {
                Ok(_) => {
                    self.offset += self.pending_len;
                    self.pending_len = 0;
                }
                Err(e) if e.error_len().is_none() => {}
                Err(_) => self.bad = Some(self.offset),
            }
        }
        if self.bad.is_some() || bytes.is_empty() {
            return;
        }
        match std::str::from_utf8(bytes) {
            Ok(_) => self.offset += bytes.len(),
            Err(e) => {
                let valid = e.valid_up_to();
                if e.error_len().is_some() {
                    self.bad = Some(self.offset + valid);
                    return;
                }
                let rest = &bytes[valid..];
                self.pending[..rest.len()].copy_from_slice(rest);
                self.pending_len = rest.len();
                self.offset += valid;
            }
        }
    }

    /// The end of the text: the offset of its first invalid byte, if any (a character left
    /// unfinished is invalid).
    fn finish(&self) -> Result<(), usize> {
        match self.bad {
            Some(at) => Err(at),
            None if self.pending_len > 0 => Err(self.offset),
            None => Ok(()),
        }
    }
}

/// One text's vector and what it took, as the output records it.
#[derive(Debug, Clone, Copy)]
pub struct Row<'a> {
    /// The text's place in the input, counting from 0 (a line's number less one).
    pub index: u64,
    /// Tokens the model read.
    pub tokens: usize,
    /// Whether the text was cut to the token limit.
    pub truncated: bool,
    /// The vector.
    pub vector: &'a [f32],
}

/// Where vectors go, one row at a time.
pub trait RowWriter {
    /// Write one row.
    fn row(&mut self, row: &Row<'_>) -> Result<()>;

    /// Write what the rows left to write (called once, after the last row).
    fn finish(&mut self) -> Result<()>;
}

/// One JSON object per row: `{"index", "tokens", "truncated", "embedding"}`, each value
/// written as the f64 it widens to (as `serde_json::json!` writes an f32, so files stay
/// byte for byte what they were). A row with the same vector as the last written one (every
/// empty text) reuses its text instead of formatting it again.
#[derive(Debug)]
pub struct JsonLines<W: Write> {
    out: W,
    name: String,
    last: Vec<f32>,
    last_json: Vec<u8>,
}

impl<W: Write> JsonLines<W> {
    /// Rows to `out`, called `name` in messages.
    pub fn new(out: W, name: impl Into<String>) -> JsonLines<W> {
        JsonLines {
            out,
            name: name.into(),
            last: Vec::new(),
            last_json: Vec::new(),
        }
    }

    fn write(&mut self, row: &Row<'_>) -> std::io::Result<()> {
        let same = self.last.len() == row.vector.len()
            && !self.last_json.is_empty()
            && self
                .last
                .iter()
                .zip(row.vector)
                .all(|(a, b)| a.to_bits() == b.to_bits());
        if !same {
            self.last_json.clear();
            serde_json::to_writer(&mut self.last_json, &AsF64(row.vector))?;
            self.last.clear();
            self.last.extend_from_slice(row.vector);
        }
        write!(
            self.out,
            "{{\"index\":{},\"tokens\":{},\"truncated\":{},\"embedding\":",
            row.index, row.tokens, row.truncated
        )?;
        self.out.write_all(&self.last_json)?;
        self.out.write_all(b"}\n")
    }
}

impl<W: Write> RowWriter for JsonLines<W> {
    fn row(&mut self, row: &Row<'_>) -> Result<()> {
        self.write(row)
            .map_err(|e| RunnerError::io(format!("writing the embeddings to {}", self.name), e))
    }

    fn finish(&mut self) -> Result<()> {
        self.out
            .flush()
            .map_err(|e| RunnerError::io(format!("writing the embeddings to {}", self.name), e))
    }
}

/// f32 values serialized as f64, as `serde_json::json!` writes an f32.
struct AsF64<'a>(&'a [f32]);

impl Serialize for AsF64<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().map(|&x| f64::from(x)))
    }
}

/// A `.npy` file (format 1.0) of one little-endian float32 array `(rows, dim)`, written as
/// rows come: the header is written first with room for any row count and rewritten with the
/// real one by [`RowWriter::finish`].
#[derive(Debug)]
pub struct NpyWriter<'f> {
    file: &'f File,
    out: BufWriter<&'f File>,
    name: String,
    rows: u64,
    dim: usize,
}

impl<'f> NpyWriter<'f> {
    /// Rows of `dim` values to `file` (at its start), called `name` in messages.
    pub fn new(file: &'f File, dim: usize, name: impl Into<String>) -> Result<NpyWriter<'f>> {
        let name = name.into();
        let mut out = BufWriter::with_capacity(1 << 16, file);
        out.write_all(&npy_header(0, dim))
            .map_err(|e| RunnerError::io(format!("writing {name}"), e))?;
        Ok(NpyWriter {
            file,
            out,
            name,
            rows: 0,
            dim,
        })
    }

    fn patch_header(&mut self) -> std::io::Result<()> {
        self.out.flush()?;
        let mut file = self.file;
        file.seek(SeekFrom::Start(0))?;
        file.write_all(&npy_header(self.rows, self.dim))?;
        file.seek(SeekFrom::End(0)).map(drop)
    }
}

impl RowWriter for NpyWriter<'_> {
    fn row(&mut self, row: &Row<'_>) -> Result<()> {
        if row.vector.len() != self.dim {
            return Err(RunnerError::InvalidArgument {
                arg: "--format",
                reason: format!(
                    "a vector of {} values in a .npy of {} columns",
                    row.vector.len(),
                    self.dim
                ),
            });
        }
        self.rows += 1;
        row.vector
            .iter()
            .try_for_each(|x| self.out.write_all(&x.to_le_bytes()))
            .map_err(|e| RunnerError::io(format!("writing {}", self.name), e))
    }

    fn finish(&mut self) -> Result<()> {
        self.patch_header()
            .map_err(|e| RunnerError::io(format!("writing {}", self.name), e))
    }
}

/// The `.npy` header for `(rows, dim)` float32 values, padded with spaces to the length the
/// largest row count needs (a multiple of 64, as the format asks), so that every count gives
/// the same length and the real one can replace a placeholder.
pub fn npy_header(rows: u64, dim: usize) -> Vec<u8> {
    let dict = |rows: u64| {
        format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {dim}), }}")
    };
    // Magic (6) + version (2) + length (2) + dictionary + '\n', padded to a multiple of 64.
    let total = (10 + dict(u64::MAX).len() + 1).div_ceil(64) * 64;
    let mut header = dict(rows);
    header.push_str(&" ".repeat(total - 11 - header.len()));
    header.push('\n');
    let mut out = Vec::with_capacity(total);
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out
}

/// What [`EmbedStream::run`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Summary {
    /// Texts embedded and written.
    pub texts: u64,
    /// Tokens the model read for them.
    pub tokens: u64,
    /// Whether the interrupt stopped the run between batches (the output is then partial).
    pub interrupted: bool,
}

/// The vector every empty text gets (its tokens are the prefix's alone), computed once.
#[derive(Debug)]
struct Shared {
    vector: Vec<f32>,
    tokens: usize,
    truncated: bool,
}

/// A text of a batch waiting for its vector.
#[derive(Debug, Clone, Copy)]
struct Pending {
    index: u64,
    tokens: usize,
    truncated: bool,
    /// An empty text: its vector is the [`Shared`] one, not the batch's next.
    empty: bool,
}

/// Texts through an [`Embedder`], a batch at a time: `prefix` (a model's prompt, `--prefix`)
/// put before every text, each cut by an [`InputTokenizer`].
#[derive(Debug)]
pub struct EmbedStream<'e, 'm, 't> {
    /// The embedder.
    pub embedder: &'e mut Embedder<'m>,
    /// Its tokenizer, cutting to its limit.
    pub tokenizer: &'e InputTokenizer<'t>,
    /// Put before every text.
    pub prefix: &'e str,
    shared: Option<Shared>,
}

impl<'e, 'm, 't> EmbedStream<'e, 'm, 't> {
    /// A stream through `embedder`.
    pub fn new(
        embedder: &'e mut Embedder<'m>,
        tokenizer: &'e InputTokenizer<'t>,
        prefix: &'e str,
    ) -> EmbedStream<'e, 'm, 't> {
        EmbedStream {
            embedder,
            tokenizer,
            prefix,
            shared: None,
        }
    }

    /// Embed every text of `source` into `out`, in order, a batch at a time; `progress` is
    /// told the texts done after each batch, and `interrupt` is checked between batches.
    /// `out` is not finished: the caller does that, unless the run was interrupted.
    pub fn run(
        &mut self,
        source: &mut dyn TextSource,
        out: &mut dyn RowWriter,
        interrupt: Option<&Interrupt>,
        progress: &mut dyn FnMut(u64),
    ) -> Result<Summary> {
        let mut summary = Summary::default();
        let (mut ids, mut pending) = (Vec::new(), Vec::new());
        loop {
            if interrupt.is_some_and(Interrupt::is_raised) {
                summary.interrupted = true;
                return Ok(summary);
            }
            ids.clear();
            pending.clear();
            let more = self.read_batch(source, summary.texts, &mut ids, &mut pending)?;
            let vectors = self.embedder.embed_ids(&ids, &mut |_| {})?;
            self.write_batch(&pending, &vectors, out)?;
            summary.texts += pending.len() as u64;
            summary.tokens += pending.iter().map(|p| p.tokens as u64).sum::<u64>();
            progress(summary.texts);
            if !more {
                // A signal during the last batch still keeps the output from being published.
                summary.interrupted = interrupt.is_some_and(Interrupt::is_raised);
                return Ok(summary);
            }
        }
    }

    /// Read and tokenize texts until the batch is full; whether more may follow.
    fn read_batch(
        &mut self,
        source: &mut dyn TextSource,
        first: u64,
        ids: &mut Vec<Vec<u32>>,
        pending: &mut Vec<Pending>,
    ) -> Result<bool> {
        while ids.len() < BATCH_TEXTS && pending.len() < BATCH_LINES {
            let index = first + pending.len() as u64;
            let Some(text) = source.next_text(self.tokenizer.scan_limit())? else {
                return Ok(false);
            };
            let (tokens, truncated, empty) = if text.len == 0 {
                let shared = self.shared(source, index)?;
                (shared.tokens, shared.truncated, true)
            } else {
                let encoded = self.encode(text);
                let (i, cut) = encoded.map_err(|e| in_text(source, index, e))?;
                let n = i.len();
                ids.push(i);
                (n, cut, false)
            };
            pending.push(Pending {
                index,
                tokens,
                truncated,
                empty,
            });
        }
        Ok(true)
    }

    /// A text's tokens, the prefix before it; at least one.
    fn encode(&self, text: Text<'_>) -> Result<(Vec<u32>, bool)> {
        let (ids, cut) = if self.prefix.is_empty() {
            self.tokenizer.encode_kept(text.kept, text.len)?
        } else {
            let kept = format!("{}{}", self.prefix, text.kept);
            let len = self.prefix.len().saturating_add(text.len);
            self.tokenizer.encode_kept(&kept, len)?
        };
        if ids.is_empty() {
            return Err(RunnerError::EmptyPrompt);
        }
        Ok((ids, cut))
    }

    /// The empty text's row, embedding it the first time.
    fn shared(&mut self, source: &dyn TextSource, index: u64) -> Result<&Shared> {
        let shared = match self.shared.take() {
            Some(s) => s,
            None => {
                let empty = Text { kept: "", len: 0 };
                let (ids, truncated) = self.encode(empty).map_err(|e| in_text(source, index, e))?;
                let tokens = ids.len();
                let vector = self
                    .embedder
                    .embed_ids(&[ids], &mut |_| {})?
                    .pop()
                    .unwrap_or_default();
                Shared {
                    vector,
                    tokens,
                    truncated,
                }
            }
        };
        Ok(self.shared.insert(shared))
    }

    fn write_batch(
        &self,
        pending: &[Pending],
        vectors: &[Vec<f32>],
        out: &mut dyn RowWriter,
    ) -> Result<()> {
        let mut fresh = vectors.iter();
        for p in pending {
            let vector = match (&self.shared, p.empty) {
                (Some(s), true) => &s.vector[..],
                _ => fresh.next().map_or(&[][..], Vec::as_slice),
            };
            out.row(&Row {
                index: p.index,
                tokens: p.tokens,
                truncated: p.truncated,
                vector,
            })?;
        }
        Ok(())
    }
}

/// `error`, naming the place of text `index` of `source`.
fn in_text(source: &dyn TextSource, index: u64, error: RunnerError) -> RunnerError {
    RunnerError::InText {
        place: source.place(index),
        source: Box::new(error),
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;

    /// A BERT-style WordPiece tokenizer over a few words and the letters, adding `[CLS]` and
    /// `[SEP]`; a word of more than 100 characters is one `[UNK]`, as BERT's are.
    fn wordpiece() -> Tokenizer {
        let special = |id: u32, content: &str| {
            format!(
                "{{\"id\": {id}, \"content\": \"{content}\", \"single_word\": false, \
                 \"lstrip\": false, \"rstrip\": false, \"normalized\": false, \"special\": true}}"
            )
        };
        let mut vocab = vec![
            "\"[UNK]\": 0".to_string(),
            "\"[CLS]\": 1".into(),
            "\"[SEP]\": 2".into(),
        ];
        let mut words: Vec<String> = ["the", "quick", "fox", "jumps"].map(String::from).to_vec();
        words.extend(('a'..='z').map(|c| c.to_string()));
        words.extend(('a'..='z').map(|c| format!("##{c}")));
        for (i, w) in words.iter().enumerate() {
            vocab.push(format!("\"{w}\": {}", 3 + i));
        }
        let piece =
            |kind: &str, id: &str| format!("{{\"{kind}\": {{\"id\": \"{id}\", \"type_id\": 0}}}}");
        let single = [
            piece("SpecialToken", "[CLS]"),
            piece("Sequence", "A"),
            piece("SpecialToken", "[SEP]"),
        ]
        .join(", ");
        let json = format!(
            "{{\"version\": \"1.0\", \"truncation\": null, \"padding\": null, \
             \"added_tokens\": [{}, {}, {}], \
             \"normalizer\": {{\"type\": \"BertNormalizer\", \"clean_text\": true, \
                \"handle_chinese_chars\": true, \"strip_accents\": null, \"lowercase\": true}}, \
             \"pre_tokenizer\": {{\"type\": \"BertPreTokenizer\"}}, \
             \"post_processor\": {{\"type\": \"TemplateProcessing\", \"single\": [{single}], \
                \"pair\": [{single}], \"special_tokens\": {{\
                \"[CLS]\": {{\"id\": \"[CLS]\", \"ids\": [1], \"tokens\": [\"[CLS]\"]}}, \
                \"[SEP]\": {{\"id\": \"[SEP]\", \"ids\": [2], \"tokens\": [\"[SEP]\"]}}}}}}, \
             \"decoder\": {{\"type\": \"WordPiece\", \"prefix\": \"##\", \"cleanup\": true}}, \
             \"model\": {{\"type\": \"WordPiece\", \"unk_token\": \"[UNK]\", \
                \"continuing_subword_prefix\": \"##\", \"max_input_chars_per_word\": 100, \
                \"vocab\": {{{}}}}}}}",
            special(0, "[UNK]"),
            special(1, "[CLS]"),
            special(2, "[SEP]"),
            vocab.join(", ")
        );
        let files = kiln_format::TokenizerFiles {
            tokenizer_json: Some(json),
            ..kiln_format::TokenizerFiles::default()
        };
        Tokenizer::from_parts("wordpiece", &files, None, &[]).unwrap()
    }

    /// Regression: a long text was tokenized whole only to keep its first tokens. Now a prefix
    /// is, and its kept tokens are the whole text's, for every length around the cut.
    #[test]
    fn a_cut_text_keeps_the_tokens_the_whole_text_gives() {
        let t = wordpiece();
        let max = 16;
        let cut = InputTokenizer::new(&t, max).unwrap();
        let truncating = t.truncating(max).unwrap();
        // Words of every length, so that cuts land inside words too.
        let text: String = (0..3000)
            .map(|i| ["the ", "quick ", "fox ", "jumps ", "abcdefghij "][i % 5])
            .collect();
        for len in [0, 5, 60, 4095, 4096, 4097, 9000, text.len()] {
            let part = &text[..len];
            assert_eq!(
                cut.encode(part).unwrap(),
                truncating.encode_cut(part).unwrap(),
                "{len}"
            );
        }
        let (ids, truncated) = cut.encode(&text).unwrap();
        assert!(truncated);
        assert_eq!((ids.len(), ids[0], ids[max - 1]), (max, 1, 2));
    }

    /// A text whose prefix holds too few tokens to cut it safely (one 2 MiB word, a single
    /// `[UNK]`) is refused rather than tokenized whole; a shorter one is tokenized whole.
    #[test]
    fn a_text_too_sparse_to_cut_is_refused() {
        let t = wordpiece();
        let cut = InputTokenizer::new(&t, 16).unwrap();
        let word = "a".repeat(cut.scan_limit() + 1);
        match cut.encode(&word) {
            Err(RunnerError::TextTooSparse {
                tokens, max_tokens, ..
            }) => assert_eq!((tokens, max_tokens), (3, 16)),
            other => panic!("{other:?}"),
        }
        let (ids, truncated) = cut.encode(&word[..cut.scan_limit()]).unwrap();
        assert_eq!((ids, truncated), (vec![1, 0, 2], false));
    }

    #[test]
    fn cuts_before_a_space_in_the_second_half() {
        assert_eq!(cut_before("ab cd ef", 7), 5);
        assert_eq!(
            cut_before("a bcdefgh", 8),
            8,
            "the only space is in the first half"
        );
        assert_eq!(cut_before("abcdé", 5), 4, "a split character is left out");
        assert_eq!(cut_before("abc", 10), 3);
    }

    fn all_lines(input: &[u8]) -> Result<Vec<String>> {
        let mut lines = Lines::new(input, "in.txt");
        let mut out = Vec::new();
        while let Some(t) = lines.next_text(usize::MAX)? {
            assert_eq!(t.kept.len(), t.len);
            out.push(t.kept.to_string());
        }
        Ok(out)
    }

    #[test]
    fn lines_split_as_str_lines_does() {
        for input in ["", "a", "a\n", "a\r\nb", "\n\n", "a\n\nb\r\n", "x\r"] {
            let want: Vec<String> = input.lines().map(String::from).collect();
            assert_eq!(all_lines(input.as_bytes()).unwrap(), want, "{input:?}");
        }
    }

    #[test]
    fn a_bad_line_is_named() {
        let e = all_lines(b"ok\nfine\nbad \xff here\n").unwrap_err();
        assert!(matches!(&e, RunnerError::InText { .. }), "{e}");
        assert_eq!(
            e.to_string(),
            "line 3 of in.txt: not valid UTF-8 (first invalid byte at byte 4 of the line)"
        );
        // One byte past the limit, with no newline: refused after reading the limit.
        let long = std::io::repeat(b'a').take(MAX_LINE_BYTES as u64 + 1);
        let mut lines = Lines::new(BufReader::new(long), "big.txt");
        let e = lines.next_text(16).unwrap_err();
        assert!(
            e.to_string().starts_with("line 1 of big.txt: longer than"),
            "{e}"
        );
    }

    #[test]
    fn npy_headers_have_one_length_and_read_back() {
        let small = npy_header(0, 384);
        let large = npy_header(u64::MAX, 384);
        assert_eq!(small.len(), large.len());
        assert_eq!(small.len() % 64, 0);
        let text = String::from_utf8_lossy(&small[10..]).into_owned();
        assert!(text.starts_with("{'descr': '<f4', 'fortran_order': False, 'shape': (0, 384), }"));
        assert!(text.ends_with(" \n"));
        let len = u16::from_le_bytes([small[8], small[9]]) as usize;
        assert_eq!(10 + len, small.len());
    }

    #[test]
    fn npy_rows_stream_and_the_count_is_patched() {
        let file = tempfile::tempfile().unwrap();
        let mut w = NpyWriter::new(&file, 2, "v.npy").unwrap();
        for (i, v) in [[1.0f32, 2.0], [3.0, 4.0], [5.0, 6.0]].iter().enumerate() {
            let row = Row {
                index: i as u64,
                tokens: 1,
                truncated: false,
                vector: v,
            };
            w.row(&row).unwrap();
        }
        w.finish().unwrap();
        let mut bytes = Vec::new();
        (&file).seek(SeekFrom::Start(0)).unwrap();
        (&file).read_to_end(&mut bytes).unwrap();
        let header = npy_header(3, 2);
        assert_eq!(&bytes[..header.len()], &header[..]);
        let values: Vec<f32> = bytes[header.len()..]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(values, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    }

    #[test]
    fn json_lines_match_the_json_macro_and_reuse_a_repeated_vector() {
        let mut out = Vec::new();
        let mut w = JsonLines::new(&mut out, "stdout");
        let v = [0.1f32, -2.5, f32::NAN];
        for index in [0, 7] {
            w.row(&Row {
                index,
                tokens: 3,
                truncated: true,
                vector: &v,
            })
            .unwrap();
        }
        w.finish().unwrap();
        let want: String = [0, 7]
            .iter()
            .map(|i| {
                let line = serde_json::json!({
                    "index": i, "tokens": 3, "truncated": true, "embedding": v.to_vec(),
                });
                format!("{line}\n")
            })
            .collect();
        assert_eq!(String::from_utf8(out).unwrap(), want);
    }
}
