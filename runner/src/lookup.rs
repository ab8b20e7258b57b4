//! Prompt lookup: guesses for speculative decoding taken from the text itself, with no draft
//! model. When the last few tokens occurred before (in the prompt or in what was generated),
//! the tokens that followed them then are a good guess for what follows now: an edit, a
//! rewrite, code or a summary repeats long stretches of its input.
//!
//! The guess is only a guess: the engine ([`crate::engine`]) checks it in its batched pass
//! and keeps what the model itself would have produced, so the output does not depend on it;
//! how many tokens are guessed is the engine's one policy ([`crate::engine::speculate`]).

/// The longest n-gram looked up: the last this many tokens are tried first.
pub const NGRAM_MAX: usize = 3;
/// The shortest: a single repeated token predicts too little to be worth a check.
pub const NGRAM_MIN: usize = 2;

/// Up to `max` tokens guessed to follow `history`: what followed the most recent earlier
/// occurrence of its last n-gram, trying the longest n-gram first ([`NGRAM_MAX`] down to
/// [`NGRAM_MIN`]); empty when none occurred before. Where that continuation runs into the
/// present, the text repeats itself with the occurrence's distance as period, and the guess
/// goes on repeating it (a loop of one token guesses `max` of them).
pub fn guess(history: &[u32], max: usize) -> Vec<u32> {
    let len = history.len();
    if max == 0 {
        return Vec::new();
    }
    for n in (NGRAM_MIN..=NGRAM_MAX).rev() {
        if len <= n {
            continue;
        }
        let tail = &history[len - n..];
        // Earlier occurrences only (one starting at len - n is the tail itself).
        if let Some(start) = (0..len - n).rev().find(|&s| &history[s..s + n] == tail) {
            let from = start + n;
            let mut out: Vec<u32> = Vec::with_capacity(max);
            for i in 0..max {
                let at = from + i;
                out.push(if at < len { history[at] } else { out[at - len] });
            }
            return out;
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_most_recent_match_gives_what_followed_it() {
        // "1 2 3" occurs at 0 and ends the history: what followed it is 4 5 9 ...
        let h = [1, 2, 3, 4, 5, 9, 7, 2, 3, 8, 1, 2, 3];
        assert_eq!(guess(&h, 3), [4, 5, 9]);
        // Only "2 3" matches: its most recent earlier occurrence is at 7, followed by 8 1 6.
        let h = [1, 2, 3, 4, 5, 9, 7, 2, 3, 8, 1, 6, 2, 3];
        assert_eq!(guess(&h, 3), [8, 1, 6]);
        // Running into the present, the repetition goes on: 7 5 6 with period 3.
        let h = [5, 6, 7, 5, 6];
        assert_eq!(guess(&h, 8), [7, 5, 6, 7, 5, 6, 7, 5]);
        // A loop of one token.
        assert_eq!(guess(&[7, 7, 7], 4), [7, 7, 7, 7]);
    }

    #[test]
    fn no_earlier_match_or_no_room_guesses_nothing() {
        assert!(guess(&[1, 2, 3, 4], 4).is_empty());
        assert!(guess(&[1, 2], 4).is_empty());
        assert!(guess(&[], 4).is_empty());
        assert!(guess(&[1, 2, 1, 2], 0).is_empty());
        // A single repeated token is not enough.
        assert!(guess(&[1, 9, 8, 1], 4).is_empty());
    }
}
