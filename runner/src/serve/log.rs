//! The server's log: one line on stderr per event, every one written by [`line`].
//!
//! Log lines quote what clients send: request targets, header values, and error messages that
//! name a field's value (an unknown `role`, a schema's bad `type`). Written raw, a newline in
//! one would start a line that looks like the server's own (`kiln-run serve: GET /admin 200`),
//! and an escape sequence would reach the terminal of whoever reads the log. So [`line`]
//! writes every character that can end a line or drive a terminal as a visible escape
//! ([`Escaped`]: `\n`, `\u{1b}`) and caps the line's length: whatever a call site passes, the
//! server writes one bounded line of printable text. Call sites pass the raw values; escaping
//! in one place means none can forget it.

use std::fmt::{self, Display, Write as _};
use std::sync::atomic::{AtomicBool, Ordering};

/// Most characters of a message a log line carries: far above any message the server writes
/// itself, and small enough that a client quoting a megabyte field cannot flood the log.
pub const MAX_MESSAGE_CHARS: usize = 2000;

/// Whether `c` is written as an escape: the C0 controls (line feed, carriage return, ESC…),
/// DEL and the C1 controls (NEL, CSI…), which end lines or drive terminals; the Unicode line
/// and paragraph separators, which some viewers break lines at; and the bidirectional
/// formatting characters, which make a terminal show text in an order other than its bytes'.
pub fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{2028}'
                | '\u{2029}'
                | '\u{061c}'
                | '\u{200e}'
                | '\u{200f}'
                | '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
        )
}

/// Text to be written into a log line: [`needs_escape`] characters as `\n`, `\r`, `\t` or
/// `\u{hex}`, everything else as is.
#[derive(Debug, Clone, Copy)]
pub struct Escaped<'a>(pub &'a str);

impl Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in self.0.chars() {
            match c {
                '\n' => f.write_str("\\n")?,
                '\r' => f.write_str("\\r")?,
                '\t' => f.write_str("\\t")?,
                c if needs_escape(c) => write!(f, "\\u{{{:x}}}", u32::from(c))?,
                c => f.write_char(c)?,
            }
        }
        Ok(())
    }
}

/// The log line for `what`, without its line ending: the prefix, then at most
/// [`MAX_MESSAGE_CHARS`] characters of `what`, escaped, and how many more were cut.
pub fn render(what: impl Display) -> String {
    let text = what.to_string();
    let (kept, cut) = match text.char_indices().nth(MAX_MESSAGE_CHARS) {
        Some((at, _)) => (&text[..at], text.len() - at),
        None => (text.as_str(), 0),
    };
    let mut out = format!("kiln-run serve: {}", Escaped(kept));
    if cut > 0 {
        let _ = write!(out, "… ({cut} more bytes)");
    }
    out
}

/// Whether [`line`] writes: on for `kiln-run`, which logs; an embedding program (the Python
/// package) turns it off so that its users' stderr stays theirs unless they ask.
static ENABLED: AtomicBool = AtomicBool::new(true);

/// Turn the log on or off for the whole process.
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Write one log line about `what` on stderr (see the module doc), unless the log is off.
pub fn line(what: impl Display) {
    if ENABLED.load(Ordering::Relaxed) {
        eprintln!("{}", render(what));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forged_line_and_terminal_controls_stay_on_one_printable_line() {
        let role = "x\nkiln-run serve: GET /admin 200: forged\u{1b}[2J";
        let out = render(format_args!("POST /v1/chat/completions 400: role `{role}`"));
        assert_eq!(
            out,
            "kiln-run serve: POST /v1/chat/completions 400: role \
             `x\\nkiln-run serve: GET /admin 200: forged\\u{1b}[2J`"
        );
        for bad in [
            "\r", "\t", "\0", "\u{7}", "\u{7f}", "\u{85}", "\u{9b}", "\u{2028}", "\u{2029}",
            "\u{202e}", "\u{2066}",
        ] {
            let out = render(format_args!("a{bad}b"));
            assert!(out.chars().all(|c| !needs_escape(c)), "{out:?}");
            assert!(out.contains('\\') && out.ends_with('b'), "{out:?}");
        }
        // Ordinary text, non-ASCII included, is written as is.
        assert_eq!(render("é ✓ `q` \\"), "kiln-run serve: é ✓ `q` \\");
    }

    #[test]
    fn a_long_message_is_cut_and_says_how_much_was_cut() {
        let long = "\n".repeat(MAX_MESSAGE_CHARS + 10);
        let out = render(&long);
        assert!(
            out.ends_with("… (10 more bytes)"),
            "{}",
            &out[out.len() - 40..]
        );
        assert_eq!(out.matches("\\n").count(), MAX_MESSAGE_CHARS);
        assert!(!out.contains('\n'));
        let exact = "a".repeat(MAX_MESSAGE_CHARS);
        assert!(render(&exact).ends_with('a'));
    }
}
