//! Tokens of a text file given on the command line (a calibration text, a perplexity text),
//! read and tokenized in bounded memory.
//!
//! Tokenizing costs far more memory than the text: the `tokenizers` crate keeps offsets,
//! alignments and a string per token, about 190 bytes per byte of input (a 20 MB text took
//! 3.8 GB). So a file is never tokenized whole just to keep its first N tokens: only a prefix
//! that surely holds them is read and tokenized, doubled until it does; a text used whole is
//! refused above [`MAX_WHOLE_TEXT_BYTES`]. The file must be a regular file
//! ([`kiln_format::open_regular`]): `/dev/zero` or a FIFO is refused at once.

use std::io::Read;
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::error::{Result, RunnerError};

/// Largest text tokenized whole (when every token is wanted): 16 MiB, about 3 GB while it is
/// tokenized; twelve times wikitext-2's test set. Ask for fewer tokens (a chunk or token
/// limit) to use a longer file: then only the prefix that holds them is read.
pub const MAX_WHOLE_TEXT_BYTES: u64 = 16 << 20;

/// Bytes read per wanted token at first: English BPE averages about 4.5 bytes a token; a text
/// that needs more gets its prefix doubled.
const FIRST_BYTES_PER_TOKEN: u64 = 6;

/// Tokens tokenized past the ones kept, so that none of the kept tokens can be changed by where
/// the prefix was cut (a cut moves at most the last few tokens).
const MARGIN_TOKENS: usize = 64;

/// The tokens of a text file and what was read to make them.
#[derive(Debug, Clone)]
pub struct TextTokens {
    /// At most the number of tokens asked for.
    pub tokens: Vec<u32>,
    /// The sha256 of the text tokenized: the whole file, or the prefix that was read.
    pub sha256: [u8; 32],
    /// Bytes of the file that were tokenized.
    pub bytes: u64,
    /// Whether that was the whole file.
    pub whole: bool,
}

/// Tokenize `path` (`what` names it in errors: "calibration text", "perplexity text") with
/// `encode` (a [`crate::Tokenizer::encode`]; called only once the text has been read and found to be
/// UTF-8, so a caller may load its tokenizer lazily and report the text's faults first), keeping at most `max_tokens` tokens (`None`: all, for a file of at most
/// [`MAX_WHOLE_TEXT_BYTES`]).
///
/// The kept tokens are the ones tokenizing the whole file would start with: a prefix is cut at
/// the end of a line and used only if it gives [`MARGIN_TOKENS`] more tokens than kept.
pub fn tokenize_file(
    encode: &mut dyn FnMut(&str) -> Result<Vec<u32>>,
    path: &Path,
    max_tokens: Option<usize>,
    what: &'static str,
) -> Result<TextTokens> {
    let file = kiln_format::open_regular(path, what)?;
    let size = file
        .metadata()
        .map_err(|e| RunnerError::io(path.display().to_string(), e))?
        .len();
    let Some(max_tokens) = max_tokens else {
        let bytes = kiln_format::read_bounded(path, MAX_WHOLE_TEXT_BYTES, what)?;
        let text = utf8(path, what, &bytes)?;
        return Ok(TextTokens {
            tokens: encode(text)?,
            sha256: Sha256::digest(&bytes).into(),
            bytes: bytes.len() as u64,
            whole: true,
        });
    };
    let mut reader = file.take(size);
    let mut bytes = Vec::new();
    let mut want = (max_tokens.saturating_add(MARGIN_TOKENS) as u64)
        .saturating_mul(FIRST_BYTES_PER_TOKEN)
        .max(4096);
    loop {
        let target = want.min(size);
        let have = bytes.len() as u64;
        if target > have {
            bytes.reserve((target - have) as usize);
            (&mut reader)
                .take(target - have)
                .read_to_end(&mut bytes)
                .map_err(|e| RunnerError::io(path.display().to_string(), e))?;
        }
        // The file ended early (it shrank while read): what was read is the whole text.
        let whole = (bytes.len() as u64) < want || bytes.len() as u64 >= size;
        let used = if whole {
            &bytes[..]
        } else {
            &bytes[..line_cut(&bytes)]
        };
        let text = utf8(path, what, used)?;
        let mut tokens = encode(text)?;
        if whole || tokens.len() >= max_tokens + MARGIN_TOKENS {
            tokens.truncate(max_tokens);
            return Ok(TextTokens {
                tokens,
                sha256: Sha256::digest(used).into(),
                bytes: used.len() as u64,
                whole,
            });
        }
        want = want.saturating_mul(2);
    }
}

/// Where to cut a prefix: after its last newline, else after its last space, else at the
/// last character boundary (a file with no line breaks at all).
fn line_cut(bytes: &[u8]) -> usize {
    if let Some(i) = bytes.iter().rposition(|&b| b == b'\n') {
        return i + 1;
    }
    if let Some(i) = bytes.iter().rposition(|&b| b == b' ') {
        return i + 1;
    }
    // A character split by the cut is left out; an invalid sequence is kept for `utf8` to
    // report.
    match std::str::from_utf8(bytes) {
        Err(e) if e.error_len().is_none() => e.valid_up_to(),
        _ => bytes.len(),
    }
}

fn utf8<'a>(path: &Path, what: &'static str, bytes: &'a [u8]) -> Result<&'a str> {
    std::str::from_utf8(bytes).map_err(|e| {
        RunnerError::Format(kiln_format::FormatError::NotUtf8 {
            file: path.display().to_string(),
            what,
            offset: e.valid_up_to(),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_after_the_last_line() {
        assert_eq!(line_cut(b"ab\ncd\nef"), 6);
        assert_eq!(line_cut(b"ab cd"), 3);
        assert_eq!(line_cut("abé".as_bytes()), 4);
        // A split two-byte character is left out whole.
        assert_eq!(line_cut(&"abé".as_bytes()[..3]), 2);
        assert_eq!(line_cut(b"abc"), 3);
    }
}
