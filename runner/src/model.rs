//! The decoder, written once over a handful of operations.
//!
//! Every family (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3, GLM-4, GLM) differs only by
//! [`Config`] (biases, q/k norms, post-attention and post-MLP norms, per-layer sliding windows
//! and RoPE bases, partial rotary and its pairing, LongRoPE, the MLP's activation, embedding and
//! score scales, tied embeddings; Phi-3's and GLM's fused projections are stored split), and
//! every weight encoding goes through the same [`matmul`]: there is one forward pass. A
//! feature a family lacks costs a branch per layer. A [`Model`] borrows its weights from the file; a [`Session`] owns what one
//! conversation needs (KV cache, rope tables, scratch buffers, thread pool), all allocated when
//! it is created. [`Session::forward`] runs a batch of tokens (the whole prompt as a
//! matrix–matrix product, or one token when decoding) and reports activations to an optional
//! [`Observer`].

use std::sync::Arc;

use kiln_format::KilnFile;
use kiln_format::MlpActivation;
use kiln_kernels::{axpy, gelu_tanh_mul, matmul, matmul_many, rmsnorm, silu_mul, Matrix, Pool};

use crate::attention::{attention, AttnScratch, AttnShape};
use crate::config::Config;
use crate::error::{Result, RunnerError};
use crate::kv_cache::{CacheType, KvCache, SlidingCache};
use crate::observer::{emit, wants, Activation, Observer};
use crate::rope::{FactorSet, Rope};
use crate::weights::{dequantize_row, Weights};

/// The context used when none is asked for, at most: the model's trained context can be far
/// larger (128k for Llama 3.1) than a CPU session needs, and the KV cache is allocated up front.
pub const DEFAULT_CTX_CAP: usize = 4096;

/// A loaded model: configuration plus weights borrowed from the file.
#[derive(Debug)]
pub struct Model<'a> {
    /// The resolved configuration.
    pub config: Config,
    /// The weights, in place in the file's map.
    pub weights: Weights<'a>,
}

impl<'a> Model<'a> {
    /// Check the file's configuration and tensors and borrow the weights.
    pub fn load(file: &'a KilnFile) -> Result<Model<'a>> {
        let config = Config::from_file(file)?;
        let weights = Weights::load(file, &config)?;
        Ok(Model { config, weights })
    }

    /// The default context: the trained context, capped at [`DEFAULT_CTX_CAP`].
    pub fn default_ctx(&self) -> usize {
        self.config.max_position_embeddings.min(DEFAULT_CTX_CAP)
    }

    /// Start a session with room for `ctx` positions, computing on `threads` threads, with
    /// an f32 KV cache: the values the projections produced, as a reference comparison or a
    /// calibration needs them.
    pub fn session(&self, ctx: usize, threads: usize) -> Result<Session<'_>> {
        Session::new(self, ctx, threads, CacheType::F32)
    }

    /// [`Model::session`] with the KV cache stored as `cache` (`kiln-run` uses f16 unless
    /// told otherwise).
    pub fn session_with(
        &self,
        ctx: usize,
        threads: usize,
        cache: CacheType,
    ) -> Result<Session<'_>> {
        Session::new(self, ctx, threads, cache)
    }

    /// [`Model::session_with`], with sliding-window layers' keys and values kept as
    /// `sliding` says (a ring by default, every position with [`SlidingCache::Full`]).
    pub fn session_sliding(
        &self,
        ctx: usize,
        threads: usize,
        cache: CacheType,
        sliding: SlidingCache,
    ) -> Result<Session<'_>> {
        Session::with_sliding(self, ctx, threads, cache, sliding)
    }
}

/// Which logits [`Session::forward`] computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last token's (generation).
    Last,
    /// Every token's, `(T, vocab)` (verification).
    All,
    /// None: the output matrix is skipped and `forward` returns an empty slice (calibration,
    /// which needs only activations; an observer that wants `model.norm.output` still gets it).
    None,
}

/// Activation buffers for a batch of `n` tokens, grown on demand and then reused.
#[derive(Debug, Default)]
struct Scratch {
    /// Residual stream, `(n, hidden)`.
    x: Vec<f32>,
    /// Normed residual, `(n, hidden)`.
    xn: Vec<f32>,
    /// Queries, `(n, heads*head_dim)`.
    q: Vec<f32>,
    /// Keys of this batch, `(n, kv_heads*head_dim)`.
    k: Vec<f32>,
    /// Values of this batch, `(n, kv_heads*head_dim)`.
    v: Vec<f32>,
    /// Attention output before o_proj, `(n, heads*head_dim)`.
    att: Vec<f32>,
    /// Output of o_proj / down_proj, `(n, hidden)`.
    proj: Vec<f32>,
    /// Gate projection, `(n, intermediate)`.
    gate: Vec<f32>,
    /// Up projection, `(n, intermediate)`.
    up: Vec<f32>,
    /// silu(gate)·up, `(n, intermediate)`.
    act: Vec<f32>,
    /// Logits, `(n or 1, vocab)`.
    logits: Vec<f32>,
    /// Attention's own buffers.
    attn: AttnScratch,
}

impl Scratch {
    fn fit(&mut self, c: &Config, n: usize) {
        let fit = |v: &mut Vec<f32>, len: usize| v.resize(len, 0.0);
        fit(&mut self.x, n * c.hidden);
        fit(&mut self.xn, n * c.hidden);
        fit(&mut self.q, n * c.q_dim());
        fit(&mut self.k, n * c.kv_dim());
        fit(&mut self.v, n * c.kv_dim());
        fit(&mut self.att, n * c.q_dim());
        fit(&mut self.proj, n * c.hidden);
        fit(&mut self.gate, n * c.intermediate);
        fit(&mut self.up, n * c.intermediate);
        fit(&mut self.act, n * c.intermediate);
    }
}

/// One sequence's state: KV cache, rope tables, scratch and the thread pool.
#[derive(Debug)]
pub struct Session<'m> {
    model: &'m Model<'m>,
    /// Shared so that [`Session::forward`] can run the pass inside it while borrowing `self`.
    pool: Arc<Pool>,
    cache: KvCache,
    rope: Rope,
    /// LongRoPE's long-factor tables, used by a forward call that reaches past the original
    /// context (`rope` then holds the short-factor ones).
    rope_long: Option<Rope>,
    /// The sliding-window layers' tables, where their RoPE base differs (Gemma 3).
    rope_local: Option<Rope>,
    /// The tokens whose keys and values are in the cache, in order.
    tokens: Vec<u32>,
    scratch: Scratch,
}

impl<'m> Session<'m> {
    /// Allocate a session for `ctx` positions on `threads` threads, its KV cache stored as
    /// `cache` (sliding-window layers in rings).
    pub fn new(
        model: &'m Model<'m>,
        ctx: usize,
        threads: usize,
        cache: CacheType,
    ) -> Result<Session<'m>> {
        Session::with_sliding(model, ctx, threads, cache, SlidingCache::default())
    }

    /// [`Session::new`], sliding-window layers' keys and values kept as `sliding` says.
    pub fn with_sliding(
        model: &'m Model<'m>,
        ctx: usize,
        threads: usize,
        cache: CacheType,
        sliding: SlidingCache,
    ) -> Result<Session<'m>> {
        let c = &model.config;
        if ctx == 0 {
            return Err(RunnerError::InvalidArgument {
                arg: "--ctx",
                reason: "the context must hold at least one token".into(),
            });
        }
        if ctx > c.max_position_embeddings {
            return Err(RunnerError::InvalidArgument {
                arg: "--ctx",
                reason: format!(
                    "{ctx} exceeds the model's trained context of {} tokens",
                    c.max_position_embeddings
                ),
            });
        }
        if threads == 0 {
            return Err(RunnerError::InvalidArgument {
                arg: "--threads",
                reason: "at least one thread is needed".into(),
            });
        }
        let pool = Arc::new(Pool::new(threads).map_err(RunnerError::Pool)?);
        Ok(Session {
            model,
            pool,
            cache: KvCache::with_windows(
                &(0..c.layers).map(|l| c.window(l)).collect::<Vec<_>>(),
                sliding,
                ctx,
                c.kv_heads,
                c.head_dim,
                cache,
            )?,
            rope: Rope::new(
                c.rope_geometry(),
                c.rope_theta,
                c.rope_scaling.as_ref(),
                FactorSet::Short,
                ctx,
            ),
            rope_long: c.long_rope_from().filter(|&from| from < ctx).map(|_| {
                Rope::new(
                    c.rope_geometry(),
                    c.rope_theta,
                    c.rope_scaling.as_ref(),
                    FactorSet::Long,
                    ctx,
                )
            }),
            rope_local: c
                .rope_local_theta
                .map(|theta| Rope::new(c.rope_geometry(), theta, None, FactorSet::Short, ctx)),
            tokens: Vec::with_capacity(ctx),
            scratch: Scratch::default(),
        })
    }

    /// The model.
    pub fn model(&self) -> &'m Model<'m> {
        self.model
    }

    /// Capacity in positions.
    pub fn ctx(&self) -> usize {
        self.cache.ctx()
    }

    /// Compute threads.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// How the KV cache stores keys and values.
    pub fn cache_type(&self) -> CacheType {
        self.cache.cache_type()
    }

    /// Bytes held by the KV cache.
    pub fn cache_bytes(&self) -> usize {
        self.cache.bytes()
    }

    /// Tokens in the cache (the position the next token gets).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Forget everything.
    pub fn reset(&mut self) {
        self.rewind(0);
    }

    /// Keep only the first `len` cached tokens, and return how many are kept: `len`, or 0
    /// when a sliding layer's ring has already overwritten keys that position `len` would
    /// read (see [`KvCache::truncate`]); the caller then runs the prefix again.
    pub fn rewind(&mut self, len: usize) -> usize {
        let kept = self.cache.truncate(len);
        self.tokens.truncate(kept);
        kept
    }

    /// Positions the KV cache holds in each layer: the context, or a sliding layer's ring.
    pub fn cache_capacities(&self) -> Vec<usize> {
        (0..self.model.config.layers)
            .map(|l| self.cache.capacity(l))
            .collect()
    }

    /// Keep the longest cached prefix of `ids`, returning its length: the caller then feeds
    /// `ids[len..]`. Used to carry a conversation's cache from turn to turn.
    pub fn reuse_prefix(&mut self, ids: &[u32]) -> usize {
        let mut same = self
            .tokens
            .iter()
            .zip(ids)
            .take_while(|(a, b)| a == b)
            .count();
        // Something must be fed to get logits.
        if same == ids.len() {
            same = same.saturating_sub(1);
        }
        self.rewind(same)
    }

    /// Run `tokens` at positions `len()..len()+n` as one batch and return the requested
    /// logits (`(1, vocab)` for [`Logits::Last`], `(n, vocab)` for [`Logits::All`]).
    ///
    /// The pass runs on one of the pool's threads, so that each product starts on the pool
    /// directly (see [`Pool::install`]).
    pub fn forward(
        &mut self,
        tokens: &[u32],
        which: Logits,
        observer: Option<&mut dyn Observer>,
    ) -> Result<&[f32]> {
        let pool = Arc::clone(&self.pool);
        pool.install(move || self.forward_here(tokens, which, observer))
    }

    /// [`Session::forward`] on the current thread.
    fn forward_here(
        &mut self,
        tokens: &[u32],
        which: Logits,
        mut observer: Option<&mut dyn Observer>,
    ) -> Result<&[f32]> {
        let model = self.model;
        let c = &model.config;
        let w = &model.weights;
        let n = tokens.len();
        let pos0 = self.cache.len();
        if n == 0 {
            return Err(RunnerError::EmptyPrompt);
        }
        if pos0 + n > self.cache.ctx() {
            return Err(RunnerError::ContextOverflow {
                tokens: pos0 + n,
                ctx: self.cache.ctx(),
                max_ctx: c.max_position_embeddings,
            });
        }
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= c.vocab) {
            return Err(RunnerError::TokenOutOfRange { id, vocab: c.vocab });
        }
        let (h, qd, kvd, ff) = (c.hidden, c.q_dim(), c.kv_dim(), c.intermediate);
        let hd = c.head_dim;
        let eps = c.rms_norm_eps;
        let arch = c.architecture;
        let pool = &self.pool;
        let s = &mut self.scratch;
        s.fit(c, n);

        // inputs_embeds = self.embed_tokens(input_ids)
        for (&id, row) in tokens.iter().zip(s.x.chunks_exact_mut(h)) {
            dequantize_row(&w.embed, id as usize, row);
            // Gemma: `embed_tokens(ids) * embed_scale`, in f32.
            if let Some(scale) = c.embed_scale {
                row.iter_mut().for_each(|v| *v *= scale);
            }
        }
        emit(&mut observer, arch, Activation::Embed, &s.x, h);

        // The full-attention layers' RoPE tables for this call: LongRoPE's long factors when
        // its last position + 1 exceeds the original context, as transformers chooses per
        // forward call.
        let rope_global = match &self.rope_long {
            Some(long) if c.long_rope_from().is_some_and(|from| pos0 + n > from) => long,
            _ => &self.rope,
        };
        for (l, lw) in w.layers.iter().enumerate() {
            // hidden_states = self.input_layernorm(hidden_states)
            norm_rows(&s.x, &lw.attn_norm, eps, &mut s.xn, h);
            emit(&mut observer, arch, Activation::AttnNorm(l), &s.xn, h);

            // q/k/v = self.{q,k,v}_proj(hidden_states)  (+ bias for Qwen2)
            matmul_many(
                &[&lw.q, &lw.k, &lw.v],
                &s.xn,
                n,
                &mut [&mut s.q, &mut s.k, &mut s.v],
                pool,
            );
            if let Some([bq, bk, bv]) = &lw.qkv_bias {
                add_rows(&mut s.q, bq);
                add_rows(&mut s.k, bk);
                add_rows(&mut s.v, bv);
            }
            emit(&mut observer, arch, Activation::Q(l), &s.q, qd);
            emit(&mut observer, arch, Activation::K(l), &s.k, kvd);
            emit(&mut observer, arch, Activation::V(l), &s.v, kvd);
            // q = self.q_norm(q.view(hidden_shape)); k = self.k_norm(...)  (per head)
            if let Some([qn, kn]) = &lw.qk_norm {
                norm_rows_inplace(&mut s.q, qn, eps, hd);
                norm_rows_inplace(&mut s.k, kn, eps, hd);
                emit(&mut observer, arch, Activation::QNorm(l), &s.q, qd);
                emit(&mut observer, arch, Activation::KNorm(l), &s.k, kvd);
            }

            // q, k = apply_rotary_pos_emb(q, k, cos, sin)  (the layer type's tables)
            let rope = match &self.rope_local {
                Some(local) if c.local_rope(l) => local,
                _ => rope_global,
            };
            for t in 0..n {
                rope.apply(&mut s.q[t * qd..(t + 1) * qd], pos0 + t);
                rope.apply(&mut s.k[t * kvd..(t + 1) * kvd], pos0 + t);
            }
            let shape = AttnShape {
                heads: c.heads,
                kv_heads: c.kv_heads,
                head_dim: hd,
                window: c.window(l),
                scale: c.attn_scale,
            };
            // key_states, value_states = past_key_values.update(...)
            // attn_output = eager_attention_forward(...)
            // A ring takes its layer's tokens a step at a time: each step's keys are written
            // after the previous step's queries have read the keys they overwrite.
            let step = self.cache.batch_limit(l).min(n);
            for t0 in (0..n).step_by(step) {
                let t1 = (t0 + step).min(n);
                self.cache.write(
                    l,
                    pos0 + t0,
                    &s.k[t0 * kvd..t1 * kvd],
                    &s.v[t0 * kvd..t1 * kvd],
                );
                attention(
                    shape,
                    &s.q[t0 * qd..t1 * qd],
                    &self.cache,
                    l,
                    pos0 + t0,
                    &mut s.att[t0 * qd..t1 * qd],
                    &mut s.attn,
                    pool,
                );
            }
            // attn_output = self.o_proj(attn_output)
            emit(&mut observer, arch, Activation::AttnOut(l), &s.att, qd);
            matmul(&lw.o, &s.att, n, &mut s.proj, pool);
            emit(&mut observer, arch, Activation::O(l), &s.proj, h);
            // Gemma: hidden_states = self.post_attention_layernorm(hidden_states)
            if let Some(post) = &lw.attn_post_norm {
                norm_rows_inplace(&mut s.proj, post, eps, h);
                emit(&mut observer, arch, Activation::AttnPostNorm(l), &s.proj, h);
            }
            // hidden_states = residual + hidden_states
            axpy(1.0, &s.proj, &mut s.x);

            // hidden_states = self.post_attention_layernorm(hidden_states)
            //   (Gemma: self.pre_feedforward_layernorm)
            norm_rows(&s.x, &lw.mlp_norm, eps, &mut s.xn, h);
            let mlp_norm = if c.post_norms {
                Activation::PreFfnNorm(l)
            } else {
                Activation::MlpNorm(l)
            };
            emit(&mut observer, arch, mlp_norm, &s.xn, h);
            // down_proj(act_fn(gate_proj(x)) * up_proj(x))
            matmul_many(
                &[&lw.gate, &lw.up],
                &s.xn,
                n,
                &mut [&mut s.gate, &mut s.up],
                pool,
            );
            emit(&mut observer, arch, Activation::Gate(l), &s.gate, ff);
            emit(&mut observer, arch, Activation::Up(l), &s.up, ff);
            // Element-wise, so over the pool for a prompt (one token: microseconds, kept here).
            let act: fn(&[f32], &[f32], &mut [f32]) = match c.mlp_activation {
                MlpActivation::Silu => silu_mul,
                MlpActivation::GeluTanh => gelu_tanh_mul,
            };
            if n > 1 {
                pool.for_each_chunk(&mut s.act, ff, |t, a| {
                    let r = t * ff..(t + 1) * ff;
                    act(&s.gate[r.clone()], &s.up[r], a)
                });
            } else {
                act(&s.gate, &s.up, &mut s.act);
            }
            emit(&mut observer, arch, Activation::DownIn(l), &s.act, ff);
            matmul(&lw.down, &s.act, n, &mut s.proj, pool);
            emit(&mut observer, arch, Activation::Mlp(l), &s.proj, h);
            // Gemma: hidden_states = self.post_feedforward_layernorm(hidden_states)
            if let Some(post) = &lw.mlp_post_norm {
                norm_rows_inplace(&mut s.proj, post, eps, h);
                emit(&mut observer, arch, Activation::PostFfnNorm(l), &s.proj, h);
            }
            // hidden_states = residual + hidden_states
            axpy(1.0, &s.proj, &mut s.x);
            emit(&mut observer, arch, Activation::Layer(l), &s.x, h);
        }
        self.cache.set_len(pos0 + n);
        self.tokens.extend_from_slice(tokens);

        // hidden_states = self.norm(hidden_states); logits = self.lm_head(hidden_states)
        let all = which == Logits::All || wants(&observer, arch, Activation::FinalNorm);
        let first = if all { 0 } else { n - 1 };
        let rows = n - first;
        norm_rows(
            &s.x[first * h..],
            &w.final_norm,
            eps,
            &mut s.xn[..rows * h],
            h,
        );
        if all {
            emit(&mut observer, arch, Activation::FinalNorm, &s.xn, h);
        }
        if which == Logits::None {
            return Ok(&[]);
        }
        let out: &Matrix = w.output();
        s.logits.resize(rows * c.vocab, 0.0);
        matmul(out, &s.xn[..rows * h], rows, &mut s.logits, pool);
        emit(&mut observer, arch, Activation::Logits, &s.logits, c.vocab);
        Ok(match which {
            Logits::All => &s.logits,
            Logits::Last | Logits::None => &s.logits[(rows - 1) * c.vocab..],
        })
    }
}

/// RMSNorm of each `width`-wide row of `x` into `out`.
fn norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32], width: usize) {
    for (xr, or) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        rmsnorm(xr, weight, eps, or);
    }
}

/// RMSNorm of each `width`-wide row of `x` in place (per head for q/k norms). A row is
/// copied out first, since the kernel reads its input while writing its output.
fn norm_rows_inplace(x: &mut [f32], weight: &[f32], eps: f32, width: usize) {
    let mut row = vec![0.0f32; width];
    for xr in x.chunks_exact_mut(width) {
        row.copy_from_slice(xr);
        rmsnorm(&row, weight, eps, xr);
    }
}

/// Add `bias` to every row of `x`.
fn add_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        axpy(1.0, bias, row);
    }
}
