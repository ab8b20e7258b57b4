//! SentencePiece vocabularies as BPE: the merges a scored vocabulary implies (in token order
//! for Gemma, by score for Llama 2 and Phi-3, as transformers derives each), Gemma's respelling
//! of blank tokens, and the scores export writes so that llama.cpp joins pieces in a
//! `tokenizer.json`'s merge order. Used by [`super::tokenizer`] in both directions.

use std::collections::HashMap;

use super::tokenizer::token_type;

/// Scores and token types for a SentencePiece vocabulary written from BPE merges. llama.cpp's
/// SentencePiece tokenizer joins, at each step, the adjacent pair whose joined text is the
/// best-scoring token; a token therefore scores minus the rank of the first merge that makes it,
/// so that joins happen in the merges' order (tokens no merge makes score below all of them).
/// `<0xNN>` tokens become byte tokens. When the merges are not in the vocabulary's order, a
/// re-import (which derives merges in token order, as transformers does) may tokenize some
/// text differently: that is returned as a notice.
pub(super) fn sentencepiece_scores(
    tokens: &[String],
    mut types: Vec<i32>,
    merges: &[String],
) -> (Vec<f32>, Vec<i32>, Option<String>) {
    let mut first: HashMap<String, usize> = HashMap::new();
    for (rank, m) in merges.iter().enumerate() {
        if let Some((a, b)) = m.split_once(' ') {
            first.entry(format!("{a}{b}")).or_insert(rank);
        }
    }
    let floor = -(merges.len() as f32) - 1.0;
    let scores = tokens
        .iter()
        .map(|t| first.get(t).map_or(floor, |&r| -(r as f32)))
        .collect();
    for (t, ty) in tokens.iter().zip(types.iter_mut()) {
        let byte = t.len() == 6
            && t.starts_with("<0x")
            && t.ends_with('>')
            && t[3..5].chars().all(|c| c.is_ascii_hexdigit());
        if byte && *ty == token_type::NORMAL {
            *ty = token_type::BYTE;
        }
    }
    let vocab: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let derived = merges_from_vocab(tokens, &vocab);
    let same = derived.len() == merges.len()
        && derived.iter().zip(merges).all(|((a, b), m)| {
            m.len() == a.len() + 1 + b.len() && m.starts_with(a.as_str()) && m.ends_with(b.as_str())
        });
    let notice = (!same).then(|| {
        "the merges are not in the vocabulary's order: llama.cpp joins pieces by the score \
         written for each token (minus the rank of the first merge making it), and a re-import \
         derives merges in token order, so some text may tokenize differently"
            .to_string()
    });
    (scores, types, notice)
}

/// Python's `str.isspace`, which decides what Gemma's respelling touches: Unicode white space
/// plus the four ASCII separators `\x1c`..`\x1f`, which Rust's `char::is_whitespace` leaves out.
fn python_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Gemma's GGUF spells a token of two or more blanks with real spaces (`"  "`), where its BPE
/// vocabulary (spaces normalized to `▁`) needs `"▁▁"`: a token that holds a space and nothing
/// but white space becomes that many `▁`, as transformers' GGUF loader respells it.
pub(super) fn gemma_spelling(t: &str) -> std::borrow::Cow<'_, str> {
    if t.contains(' ') && t.chars().all(python_isspace) {
        std::borrow::Cow::Owned("\u{2581}".repeat(t.chars().count()))
    } else {
        std::borrow::Cow::Borrowed(t)
    }
}

/// The merges a SentencePiece vocabulary implies when the file lists none: every split of a
/// token into two pieces that are both tokens, best first. Gemma's scores do not follow its
/// merge order, but the order of the tokens in the file does, so tokens rank by id and, within
/// a token, the longer left piece comes first: the order transformers' `generate_merges`
/// gives for the same file, so that both tokenize alike.
pub(super) fn merges_from_vocab(
    tokens: &[String],
    vocab: &HashMap<&str, usize>,
) -> Vec<(String, String)> {
    let mut merges = Vec::new();
    for t in tokens {
        let cuts: Vec<usize> = t.char_indices().map(|(i, _)| i).skip(1).collect();
        for &cut in cuts.iter().rev() {
            let (l, r) = t.split_at(cut);
            if vocab.contains_key(l) && vocab.contains_key(r) {
                merges.push((l.to_string(), r.to_string()));
            }
        }
    }
    merges
}

/// The merges a SentencePiece vocabulary implies, ranked as transformers'
/// `SentencePieceExtractor` ranks them for `LlamaConverter`: every split of a token into two
/// pieces that are both tokens, ordered by the score of the token they make (best first; equal
/// scores keep token order, Python's sort being stable), the splits of one token by the pieces'
/// ids. Llama's scores follow its merge order except where a token was added by hand (`▁▁`
/// scores -1e9 and must join last, or `" Hello"` would become `▁▁` `Hello`).
pub(super) fn merges_by_score(
    tokens: &[String],
    scores: &[f32],
    vocab: &HashMap<&str, usize>,
) -> Vec<(String, String)> {
    let mut ranked: Vec<(f32, String, String)> = Vec::new();
    for (t, &score) in tokens.iter().zip(scores) {
        let mut local: Vec<(usize, usize, &str, &str)> = t
            .char_indices()
            .skip(1)
            .filter_map(|(cut, _)| {
                let (l, r) = t.split_at(cut);
                Some((*vocab.get(l)?, *vocab.get(r)?, l, r))
            })
            .collect();
        local.sort_by_key(|&(l, r, _, _)| (l, r));
        ranked.extend(
            local
                .into_iter()
                .map(|(_, _, l, r)| (score, l.to_string(), r.to_string())),
        );
    }
    // Stable: ties keep the token order.
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0));
    ranked.into_iter().map(|(_, l, r)| (l, r)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentencepiece_scores_follow_the_first_merge_making_each_token() {
        let tokens: Vec<String> = ["<unk>", "a", "b", "c", "ab", "abc", "<0x0A>"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let types = vec![token_type::CONTROL, 1, 1, 1, 1, 1, 1];
        let in_order = ["a b".to_string(), "ab c".to_string()];
        let (scores, types, notice) = sentencepiece_scores(&tokens, types, &in_order);
        let floor = -3.0;
        assert_eq!(scores, [floor, floor, floor, floor, 0.0, -1.0, floor]);
        assert_eq!(types[6], token_type::BYTE);
        assert_eq!(types[0], token_type::CONTROL);
        assert!(
            notice.is_none(),
            "merges in token order re-import unchanged"
        );
        let reversed = ["ab c".to_string(), "a b".to_string()];
        let (_, _, notice) = sentencepiece_scores(&tokens, vec![1; 7], &reversed);
        assert!(notice.is_some_and(|n| n.contains("not in the vocabulary's order")));
    }

    #[test]
    fn gemma_respelling_follows_python_isspace() {
        assert_eq!(gemma_spelling("   "), "\u{2581}\u{2581}\u{2581}");
        assert_eq!(gemma_spelling(" \n"), "\u{2581}\u{2581}");
        assert_eq!(gemma_spelling(" \u{1f}"), "\u{2581}\u{2581}");
        assert_eq!(gemma_spelling("\n\n"), "\n\n", "no space: unchanged");
        assert_eq!(gemma_spelling(" a"), " a", "not all blank: unchanged");
    }
}
