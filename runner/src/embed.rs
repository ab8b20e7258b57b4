//! Text → one vector, for embedding models (encoders): tokens through the one forward pass
//! with bidirectional attention, then the model's pooling and normalisation, as
//! sentence-transformers computes them.
//!
//! Texts are batched into forward passes of up to [`EmbedOptions::batch_tokens`] tokens, each
//! text its own sequence. Every product runs with [`kiln_kernels::Batching::Texts`] (one
//! kernel path for a matrix at every batch size, the lanes kernels where the tier has them)
//! and each text's attention over its own keys only, so a text's vector is the same bits
//! alone or in any batch: nothing is padded, and nothing a neighbour holds reaches it.

use kiln_format::{EmbeddingSpec, Pooling};

use crate::error::{Result, RunnerError};
use crate::kv_cache::{CacheType, SlidingCache};
use crate::model::{Compute, Model, Sequence};

/// How [`Embedder`] embeds, beyond what the model's file states.
#[derive(Debug, Clone, Default)]
pub struct EmbedOptions {
    /// Pool this way instead of the model's way.
    pub pooling: Option<Pooling>,
    /// Normalise (or not) instead of what the model does.
    pub normalize: Option<bool>,
    /// Cut inputs to this many tokens (special tokens included) instead of the model's
    /// `max_seq_length`; at most its trained context.
    pub truncate: Option<usize>,
    /// Tokens per forward pass (0: [`DEFAULT_BATCH_TOKENS`]). A text longer than it runs alone.
    pub batch_tokens: usize,
}

/// One text's embedding, with what it took.
#[derive(Debug, Clone, PartialEq)]
pub struct Embedding {
    /// The vector.
    pub vector: Vec<f32>,
    /// Tokens the model read (special tokens included).
    pub tokens: usize,
    /// Whether the text was cut to the token limit.
    pub truncated: bool,
}

/// An encoder, ready to embed texts: its compute (threads, buffers) and one reusable
/// sequence per text of a batch.
#[derive(Debug)]
pub struct Embedder<'m> {
    compute: Compute<'m>,
    seqs: Vec<Sequence>,
    pooling: Pooling,
    normalize: bool,
    max_tokens: usize,
    batch_tokens: usize,
}

/// Most texts in one forward pass, whatever the token budget: each holds a sequence (its
/// KV cache) for the pass, so a huge `--batch-tokens` over many short texts stays bounded.
pub const MAX_TEXTS_PER_PASS: usize = 256;

/// Tokens per forward pass when [`EmbedOptions::batch_tokens`] is 0. Memory grows with the
/// pass (every text of it holds its keys and values for every layer, and the activations are
/// the pass's), speed hardly does: a pass of 512 tokens already holds a few dozen groups of
/// sixteen tokens for the lanes kernels, and every weight matrix of a small encoder stays in
/// cache between them. all-MiniLM-L6-v2 Q4_0 over 1,000 mixed texts, 2 threads: 119 texts/s
/// and 107 MB at 512 tokens, 120 texts/s and 258 MB at 2048.
pub const DEFAULT_BATCH_TOKENS: usize = 512;

impl<'m> Embedder<'m> {
    /// An embedder for `model` on `threads` threads. Refuses a model that is not an embedding
    /// model (a generator has no pooling), naming `label`.
    pub fn new(
        model: &'m Model<'m>,
        label: &str,
        threads: usize,
        opts: &EmbedOptions,
    ) -> Result<Embedder<'m>> {
        let c = &model.config;
        let spec: &EmbeddingSpec =
            c.embedding
                .as_ref()
                .ok_or_else(|| RunnerError::InvalidArgument {
                    arg: "MODEL",
                    reason: format!(
                        "{label} is a {} generator, not an embedding model (convert a \
                         sentence-transformers or BERT checkpoint)",
                        c.architecture.spec().display
                    ),
                })?;
        let trained = c.max_position_embeddings;
        let max_tokens = match opts.truncate {
            Some(0) => {
                return Err(RunnerError::InvalidArgument {
                    arg: "--truncate",
                    reason: "an input needs at least one token".into(),
                })
            }
            Some(n) if n > trained => {
                return Err(RunnerError::InvalidArgument {
                    arg: "--truncate",
                    reason: format!("{n} exceeds the model's trained context of {trained} tokens"),
                })
            }
            Some(n) => n,
            None => spec
                .max_seq_length
                .map_or(trained, |m| (m as usize).min(trained)),
        };
        let batch_tokens = match opts.batch_tokens {
            0 => DEFAULT_BATCH_TOKENS,
            n => n,
        };
        let compute = Compute::new(
            model,
            max_tokens,
            threads,
            CacheType::F32,
            SlidingCache::default(),
        )?;
        Ok(Embedder {
            compute,
            seqs: Vec::new(),
            pooling: opts.pooling.unwrap_or(spec.pooling),
            normalize: opts.normalize.unwrap_or(spec.normalize),
            max_tokens,
            batch_tokens,
        })
    }

    /// The vectors' width: the last dense layer's, or the hidden states'.
    pub fn dim(&self) -> usize {
        let c = &self.compute.model().config;
        c.embedding
            .as_ref()
            .and_then(|e| e.dense.last())
            .map_or(c.hidden, |d| d.out_features as usize)
    }

    /// The most tokens an input keeps.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// The pooling in use.
    pub fn pooling(&self) -> Pooling {
        self.pooling
    }

    /// Whether vectors are normalised.
    pub fn normalizes(&self) -> bool {
        self.normalize
    }

    /// Embed tokenized texts (each at most [`Embedder::max_tokens`] long, at least one token),
    /// in order, batching them into passes of about `batch_tokens` tokens; `done` is called
    /// with the count embedded so far after each pass.
    pub fn embed_ids(
        &mut self,
        texts: &[Vec<u32>],
        done: &mut dyn FnMut(usize),
    ) -> Result<Vec<Vec<f32>>> {
        if let Some(ids) = texts
            .iter()
            .find(|t| t.is_empty() || t.len() > self.max_tokens)
        {
            return Err(RunnerError::InvalidArgument {
                arg: "input",
                reason: format!(
                    "a text of {} tokens; each must have 1..={} tokens",
                    ids.len(),
                    self.max_tokens
                ),
            });
        }
        let mut out = Vec::with_capacity(texts.len());
        let mut start = 0;
        while start < texts.len() {
            let mut end = start + 1;
            let mut tokens = texts[start].len();
            while end < texts.len()
                && end - start < MAX_TEXTS_PER_PASS
                && tokens + texts[end].len() <= self.batch_tokens
            {
                tokens += texts[end].len();
                end += 1;
            }
            out.extend(self.pass(&texts[start..end])?);
            start = end;
            done(start);
        }
        Ok(out)
    }

    /// One forward pass over `batch`, each text its own sequence.
    fn pass(&mut self, batch: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        // Each text's sequence holds what it needs (rounded up, so that it is reused), not the
        // model's whole context: a decoder embedder's is thousands of positions.
        for (i, ids) in batch.iter().enumerate() {
            let need = ids.len().next_power_of_two().max(64);
            match self.seqs.get(i) {
                Some(s) if s.ctx() >= ids.len() => {}
                Some(_) => self.seqs[i] = self.compute.sequence_of(need)?,
                None => self.seqs.push(self.compute.sequence_of(need)?),
            }
        }
        let h = self.compute.model().config.hidden;
        let (pooling, normalize) = (self.pooling, self.normalize);
        let seqs = &mut self.seqs[..batch.len()];
        for s in seqs.iter_mut() {
            s.rewind(0);
        }
        let mut refs: Vec<&mut Sequence> = seqs.iter_mut().collect();
        let inputs: Vec<&[u32]> = batch.iter().map(Vec::as_slice).collect();
        let states = self.compute.encode(&mut refs, &inputs)?;
        let mut pooled = Vec::with_capacity(batch.len() * h);
        let mut first = 0;
        for ids in batch {
            let rows = &states[first * h..(first + ids.len()) * h];
            first += ids.len();
            pooled.extend(pool(rows, h, pooling));
        }
        // Dense, then Normalize, as the modules run.
        let projected = self.compute.project(pooled, batch.len());
        let dim = projected.len() / batch.len();
        Ok(projected
            .chunks_exact(dim)
            .map(|v| {
                let mut v = v.to_vec();
                if normalize {
                    l2_normalize(&mut v);
                }
                v
            })
            .collect())
    }
}

/// The text put before every input: `prefix` if given (`--prefix`), else the model's prompt
/// named `prompt_name` (`--prompt-name`; an unknown name is refused, listing the model's),
/// else the model's default prompt, else nothing.
pub fn input_prefix(
    spec: Option<&EmbeddingSpec>,
    prefix: Option<&str>,
    prompt_name: Option<&str>,
) -> Result<String> {
    let Some(spec) = spec else {
        return Ok(prefix.unwrap_or_default().to_string());
    };
    match (prefix, prompt_name) {
        (Some(p), _) => Ok(p.to_string()),
        (None, Some(name)) => {
            spec.prompts
                .get(name)
                .cloned()
                .ok_or_else(|| RunnerError::InvalidArgument {
                    arg: "--prompt-name",
                    reason: format!(
                        "`{name}`: the model names {}",
                        if spec.prompts.is_empty() {
                            "no prompts".to_string()
                        } else {
                            spec.prompts.keys().cloned().collect::<Vec<_>>().join(", ")
                        }
                    ),
                })
        }
        (None, None) => Ok(spec
            .default_prompt_name
            .as_ref()
            .and_then(|n| spec.prompts.get(n))
            .cloned()
            .unwrap_or_default()),
    }
}

/// Reduce `(n, h)` token states to one vector, as sentence-transformers' `Pooling` does
/// (every token counts: nothing is padded).
pub fn pool(states: &[f32], h: usize, pooling: Pooling) -> Vec<f32> {
    let n = states.len() / h;
    match pooling {
        Pooling::Cls => states[..h].to_vec(),
        Pooling::LastToken => states[(n - 1) * h..].to_vec(),
        Pooling::Mean => {
            let mut sum = vec![0.0f64; h];
            for row in states.chunks_exact(h) {
                for (s, &v) in sum.iter_mut().zip(row) {
                    *s += f64::from(v);
                }
            }
            sum.iter().map(|s| (s / n as f64) as f32).collect()
        }
    }
}

/// Scale `v` to unit length, as `torch.nn.functional.normalize` (a norm below 1e-12 divides
/// by 1e-12).
pub fn l2_normalize(v: &mut [f32]) {
    let norm = v
        .iter()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt();
    let d = norm.max(1e-12);
    v.iter_mut().for_each(|x| *x = (f64::from(*x) / d) as f32);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooling_takes_the_right_rows() {
        let states = [1.0f32, 2.0, 3.0, 4.0, 5.0, 9.0];
        assert_eq!(pool(&states, 2, Pooling::Cls), [1.0, 2.0]);
        assert_eq!(pool(&states, 2, Pooling::LastToken), [5.0, 9.0]);
        assert_eq!(pool(&states, 2, Pooling::Mean), [3.0, 5.0]);
        let mut v = vec![3.0f32, 4.0];
        l2_normalize(&mut v);
        assert_eq!(v, [0.6, 0.8]);
        let mut zero = vec![0.0f32; 3];
        l2_normalize(&mut zero);
        assert_eq!(zero, [0.0; 3]);
    }
}
