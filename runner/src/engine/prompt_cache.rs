//! Finished conversations' KV caches, kept so that the next turn reads only what is new.
//!
//! A chat client sends the whole conversation every turn, so the next request's prompt starts
//! with the previous request's prompt and answer. Instead of recomputing that prefix, the
//! engine takes the kept [`Sequence`] sharing the longest prefix with the new prompt, rewinds
//! it to that prefix and feeds only the rest. What is kept is bounded in bytes (`--cache-mb`),
//! and the least recently used entries are dropped first. Each entry is charged the memory it
//! holds ([`Sequence::held_bytes`]), not the keys and values its tokens need: a cache's rows
//! are stored head by head, so a short conversation still holds a whole page per head and
//! layer (SmolLM2 at 40 tokens holds 1.6 times its values' bytes), and that is what the
//! process's memory grows by. A dropped entry gives its pages back at once.
//!
//! Reusing a prefix changes how the rest of the prompt is batched: a cold request reads its
//! prompt in chunks of `-b` tokens from position 0, a warm one from the reuse point, and the
//! prefill kernels' bits depend on the chunk (the lanes kernels from 8 tokens, attention's
//! blocks). So by default ([`Reuse::Exact`]) only positions that were read in whole chunks
//! from position 0 are reused, and only up to a chunk boundary: the warm request then
//! computes exactly what the cold one would, and its output equals `kiln-run generate`'s.
//! [`Reuse::Prefix`] reuses the whole common prefix, as a `kiln-run chat` turn does: faster
//! for short conversations, at the price of last-bit differences that can flip a near-tie.

use crate::model::{common_prefix, Sequence};

/// Which part of a kept sequence a new prompt may reuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reuse {
    /// Only whole prefill chunks from the start: the output is what a cold request gives.
    #[default]
    Exact,
    /// The whole common prefix, generated tokens included.
    Prefix,
}

impl Reuse {
    /// The name `--cache-reuse` takes.
    pub fn name(self) -> &'static str {
        match self {
            Reuse::Exact => "exact",
            Reuse::Prefix => "prefix",
        }
    }
}

impl std::str::FromStr for Reuse {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        [Reuse::Exact, Reuse::Prefix]
            .into_iter()
            .find(|r| r.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| format!("unknown reuse {s:?}: expected exact or prefix"))
    }
}

impl std::fmt::Display for Reuse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How many tokens of `prompt` a sequence holding `held` may give, of which the first
/// `exact` were read in whole chunks of `chunk` from position 0: at least one prompt token is
/// always left to read (its logits are needed).
pub fn reusable(reuse: Reuse, held: &[u32], exact: usize, prompt: &[u32], chunk: usize) -> usize {
    let same = common_prefix(held, prompt).min(prompt.len().saturating_sub(1));
    match reuse {
        Reuse::Prefix => same,
        Reuse::Exact => {
            let chunk = chunk.max(1);
            same.min(exact) / chunk * chunk
        }
    }
}

/// One kept sequence.
#[derive(Debug)]
struct Entry {
    seq: Sequence,
    /// Leading positions read in whole prefill chunks from position 0.
    exact: usize,
    /// Bytes charged: the memory the sequence holds, and the entry itself.
    bytes: usize,
    /// When it was last put back (a counter, larger is newer).
    used: u64,
}

/// Idle sequences with their tokens, at most `budget` bytes of them.
#[derive(Debug)]
pub struct PromptCache {
    entries: Vec<Entry>,
    budget: usize,
    clock: u64,
}

impl PromptCache {
    /// An empty cache holding at most `budget` bytes of keys and values.
    pub fn new(budget: usize) -> PromptCache {
        PromptCache {
            entries: Vec::new(),
            budget,
            clock: 0,
        }
    }

    /// Sequences kept.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is kept.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes charged for what is kept.
    pub fn bytes(&self) -> usize {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    /// Take out the kept sequence that can give `prompt` the most tokens (at least one) as
    /// `reuse` and [`reusable`] say for prefill chunks of `chunk`, with that count and its
    /// exact prefix; the most recently used wins a tie.
    pub fn take(
        &mut self,
        prompt: &[u32],
        reuse: Reuse,
        chunk: usize,
    ) -> Option<(Sequence, usize, usize)> {
        let (i, n) = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let n = reusable(reuse, e.seq.tokens(), e.exact, prompt, chunk);
                (i, n, e.used)
            })
            .filter(|&(_, n, _)| n > 0)
            .max_by_key(|&(_, n, used)| (n, used))
            .map(|(i, n, _)| (i, n))?;
        let e = self.entries.swap_remove(i);
        Some((e.seq, n, e.exact))
    }

    /// Keep `seq`, charged for the memory it holds, dropping the least recently used entries
    /// until the budget holds; a sequence larger than the whole budget is dropped at once.
    /// `exact` is how many leading positions were read in whole chunks from position 0.
    pub fn put(&mut self, seq: Sequence, exact: usize) {
        let bytes = seq.held_bytes() + std::mem::size_of::<Entry>();
        if bytes > self.budget || seq.tokens().is_empty() {
            return;
        }
        self.clock += 1;
        self.entries.push(Entry {
            seq,
            exact,
            bytes,
            used: self.clock,
        });
        while self.bytes() > self.budget {
            let Some(oldest) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.used)
                .map(|(i, _)| i)
            else {
                break;
            };
            self.entries.swap_remove(oldest);
        }
    }

    /// Drop everything kept.
    pub fn clear(&mut self) {
        self.entries.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::{CacheType, SlidingCache};
    use crate::model::{Compute, Logits, Model};

    #[test]
    fn longest_prefix_wins_and_the_budget_evicts_least_recent() {
        let dir = tempfile::tempdir().unwrap();
        let path = crate::model::tests_support::tiny_model(dir.path());
        let file = kiln_format::KilnFile::open(&path).unwrap();
        let model = Model::load(&file).unwrap();
        let mut c = Compute::new(&model, 32, 1, CacheType::F32, SlidingCache::default()).unwrap();
        let run = |c: &mut Compute<'_>, ids: &[u32]| {
            let mut s = c.sequence().unwrap();
            c.forward(&mut s, ids, Logits::Last, None).unwrap();
            s
        };
        let a = run(&mut c, &[1, 2, 3, 4]);
        let b = run(&mut c, &[1, 2, 5]);
        let per = a.held_bytes() + std::mem::size_of::<Entry>();
        assert!(per > 0 && b.held_bytes() <= a.held_bytes());
        let mut cache = PromptCache::new(per * 2);
        let prefix = |c: &mut PromptCache, p: &[u32]| c.take(p, Reuse::Prefix, 2);
        cache.put(a, 4);
        cache.put(b, 2);
        assert_eq!(cache.len(), 2);
        // [1, 2, 3, 9] shares three tokens with a, two with b.
        let (s, same, exact) = prefix(&mut cache, &[1, 2, 3, 9]).unwrap();
        assert_eq!((s.tokens(), same, exact), (&[1, 2, 3, 4][..], 3, 4));
        assert!(prefix(&mut cache, &[7]).is_none());
        cache.put(s, 4);
        // Exact reuse stops at a chunk boundary (2 here) within the exact prefix.
        let (s, same, _) = cache.take(&[1, 2, 3, 9], Reuse::Exact, 2).unwrap();
        assert_eq!((s.tokens(), same), (&[1, 2, 3, 4][..], 2));
        cache.put(s, 4);
        // A third sequence over budget evicts the least recently used (b).
        cache.put(run(&mut c, &[8, 8, 8]), 2);
        assert!(cache.bytes() <= per * 2);
        let left = prefix(&mut cache, &[1, 2, 5]);
        assert!(left.is_none_or(|(s, ..)| s.tokens() != [1, 2, 5]));
        // Larger than the whole budget: not kept.
        let mut small = PromptCache::new(per / 2);
        small.put(run(&mut c, &[1, 2, 3, 4]), 4);
        assert!(small.is_empty());
    }

    /// The charge covers what a kept sequence really holds: whole pages of every head's
    /// keys and values, not just the values' bytes, and its token list's capacity, not its
    /// length; and however many sequences come, the charges stay within the budget.
    #[test]
    fn the_cache_charges_what_it_holds_and_stays_within_its_budget() {
        let dir = tempfile::tempdir().unwrap();
        let path = crate::model::tests_support::tiny_model(dir.path());
        let file = kiln_format::KilnFile::open(&path).unwrap();
        let model = Model::load(&file).unwrap();
        let mut c = Compute::new(&model, 256, 1, CacheType::F16, SlidingCache::default()).unwrap();
        let cfg = &model.config;
        // f16 rows of one head, and the head's 4 KiB pages (at least) they touch: a head's
        // rows are contiguous, 256 positions of them 8 KiB, so regions start on pages.
        let row = cfg.head_dim * 2;
        assert_eq!(256 * row % 4096, 0);
        let regions = 2 * cfg.layers * cfg.kv_heads;
        let mut filled = |n: usize| {
            let mut s = c.sequence().unwrap();
            let ids: Vec<u32> = (0..n as u32).map(|t| t % 300 + 3).collect();
            c.forward(&mut s, &ids, Logits::Last, None).unwrap();
            s
        };
        let charge = |s: &Sequence| s.held_bytes() + std::mem::size_of::<Entry>();
        let budget = 4 * charge(&filled(40));
        let mut cache = PromptCache::new(budget);
        for i in 0..40 {
            let n = 1 + (i * 37) % 200;
            let mut s = filled(n);
            // A rewind keeps the pages written and the token list's capacity.
            s.rewind(n / 2);
            let values = regions * n * row;
            let pages = regions * (n * row).div_ceil(4096) * 4096;
            let held = s.held_bytes();
            assert!(
                held >= pages && pages >= values,
                "{n} tokens: {held} < {pages}"
            );
            assert_eq!(s.peak_bytes(), values);
            assert!(held >= pages + n * std::mem::size_of::<u32>(), "{n} tokens");
            cache.put(s, 0);
            assert!(cache.bytes() <= budget, "{} > {budget}", cache.bytes());
        }
        assert!((1..40).contains(&cache.len()), "{} kept", cache.len());
        // A short sequence is charged several times its values: the pages it holds.
        let short = filled(3);
        assert!(short.held_bytes() >= 20 * short.peak_bytes());
    }

    #[test]
    fn exact_reuse_keeps_whole_chunks_and_leaves_a_token_to_read() {
        let held = [1, 2, 3, 4, 5, 6, 7, 8, 9];
        let r = |reuse, exact, prompt: &[u32]| reusable(reuse, &held, exact, prompt, 4);
        let longer = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];
        // Common prefix 9 (of a longer prompt), exact 8: two chunks of 4.
        assert_eq!(r(Reuse::Exact, 8, &longer), 8);
        assert_eq!(r(Reuse::Prefix, 8, &longer), 9);
        // Only 6 positions exact: one chunk.
        assert_eq!(r(Reuse::Exact, 6, &longer), 4);
        // The prompt is the held tokens themselves: one must still be read.
        assert_eq!(r(Reuse::Prefix, 9, &held), 8);
        assert_eq!(r(Reuse::Exact, 9, &held[..8]), 4);
        assert_eq!(r(Reuse::Exact, 9, &[1, 2, 3]), 0);
    }
}
