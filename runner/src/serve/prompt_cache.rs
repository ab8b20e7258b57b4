//! Finished conversations' KV caches, kept so that the next turn reads only what is new.
//!
//! A chat client sends the whole conversation every turn, so the next request's prompt starts
//! with the previous request's prompt and answer. Instead of recomputing that prefix, the
//! engine takes the kept [`Sequence`] sharing the longest prefix with the new prompt, rewinds
//! it to that prefix and feeds only the rest. What is kept is bounded in bytes (`--cache-mb`):
//! each entry counts the keys and values its longest run wrote (the pages it has touched),
//! and the least recently used entries are dropped first.

use crate::model::{common_prefix, Sequence};

/// One kept sequence.
#[derive(Debug)]
struct Entry {
    seq: Sequence,
    /// Bytes charged: the KV of the most positions the sequence has held.
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

    /// Take out the kept sequence sharing the longest prefix with `prompt` (at least one
    /// token), with that length; the most recently used wins a tie.
    pub fn take(&mut self, prompt: &[u32]) -> Option<(Sequence, usize)> {
        let (i, same) = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (i, common_prefix(e.seq.tokens(), prompt), e.used))
            .filter(|&(_, same, _)| same > 0)
            .max_by_key(|&(_, same, used)| (same, used))
            .map(|(i, same, _)| (i, same))?;
        Some((self.entries.swap_remove(i).seq, same))
    }

    /// Keep `seq`, charged for the KV its longest run occupied, dropping the least recently
    /// used entries until the budget holds; a sequence larger than the whole budget is dropped
    /// at once.
    pub fn put(&mut self, seq: Sequence) {
        let bytes = seq.peak_bytes();
        if bytes > self.budget || seq.tokens().is_empty() {
            return;
        }
        self.clock += 1;
        self.entries.push(Entry {
            seq,
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
        let per = a.peak_bytes();
        assert!(per > 0 && b.peak_bytes() < per);
        let mut cache = PromptCache::new(per * 2);
        cache.put(a);
        cache.put(b);
        assert_eq!(cache.len(), 2);
        // [1, 2, 3, 9] shares three tokens with a, two with b.
        let (s, same) = cache.take(&[1, 2, 3, 9]).unwrap();
        assert_eq!((s.tokens(), same), (&[1, 2, 3, 4][..], 3));
        assert!(cache.take(&[7]).is_none());
        cache.put(s);
        // A third sequence over budget evicts the least recently used (b).
        cache.put(run(&mut c, &[8, 8, 8]));
        assert!(cache.bytes() <= per * 2);
        assert!(cache
            .take(&[1, 2, 5])
            .is_none_or(|(s, _)| s.tokens() != [1, 2, 5]));
        // Larger than the whole budget: not kept.
        let mut small = PromptCache::new(per / 2);
        small.put(run(&mut c, &[1, 2, 3, 4]));
        assert!(small.is_empty());
    }
}
