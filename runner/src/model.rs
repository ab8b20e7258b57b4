//! The transformer (decoders, and encoders for embeddings), written once over a handful of
//! operations.
//!
//! Every family (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3, GLM-4, GLM, and BERT encoders)
//! differs only by [`Config`] (the norms' kind and place, the MLP's gate, learned or rotary
//! positions, causal or bidirectional attention, biases, q/k norms, post-attention and post-MLP
//! norms, per-layer sliding windows and RoPE bases, partial rotary and its pairing, LongRoPE, the MLP's activation, embedding and
//! score scales, tied embeddings; Phi-3's and GLM's fused projections are stored split), and
//! every weight encoding goes through the same [`matmul`]: there is one forward pass. A
//! feature a family lacks costs a branch per layer. A [`Model`] borrows its weights from the file; a [`Session`] owns what one
//! conversation needs (KV cache, rope tables, scratch buffers, thread pool), all allocated when
//! it is created. [`Session::forward`] runs a batch of tokens (the whole prompt as a
//! matrix–matrix product, or one token when decoding) and reports activations to an optional
//! [`Observer`].

use std::sync::Arc;

use kiln_format::KilnFile;
use kiln_format::{MlpActivation, NormPlace};
use kiln_kernels::{
    axpy, gelu, gelu_tanh_mul, matmul_many_for, rmsnorm, silu_mul, Batching, Matrix, Pool,
};

use crate::attention::{attention, AttnScratch, AttnShape};
use crate::config::Config;
use crate::error::{Result, RunnerError};
use crate::kv_cache::{CacheType, KvCache, SlidingCache};
use crate::memory;
use crate::observer::{emit, emit_edit, wants, Activation, Observer};
use crate::rope::{FactorSet, Rope};
use crate::weights::{dequantize_row, Norm, Weights};

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

    /// Refuse a context of `ctx` positions (`flag` names where it came from: `--ctx`,
    /// `--depth`) that the model cannot hold (none, or past its trained context) or that this
    /// process cannot afford: its RoPE tables and one sequence's KV cache, every position
    /// written, against [`memory::available`]. [`Compute::new`] calls it before building
    /// anything per position (2^24 positions once took 25 s and 4.1 GB of tables before the
    /// KV cache's mapping was refused); a command whose context comes from another flag calls
    /// it first, so the message names that flag.
    pub fn check_context(
        &self,
        ctx: usize,
        cache: CacheType,
        sliding: SlidingCache,
        flag: &'static str,
    ) -> Result<()> {
        let bad = |reason: String| RunnerError::InvalidArgument { arg: flag, reason };
        let trained = self.config.max_position_embeddings;
        if ctx == 0 {
            return Err(bad("the context must hold at least one token".into()));
        }
        if ctx > trained {
            return Err(bad(format!(
                "{ctx} exceeds the model's trained context of {trained} tokens"
            )));
        }
        let Some((kv, rope)) = self.context_bytes(ctx, cache, sliding) else {
            return Err(bad(format!(
                "a context of {ctx} positions does not fit in memory"
            )));
        };
        let need = kv.saturating_add(rope) as u64;
        match memory::available() {
            Some(a) if need > a.bytes => Err(bad(format!(
                "a context of {ctx} tokens needs {need} bytes ({kv} of {cache} KV cache, \
                 {rope} of RoPE tables), but {} bytes are available ({}): lower {flag} or \
                 use a smaller --cache-type",
                a.bytes, a.bound
            ))),
            _ => Ok(()),
        }
    }

    /// Bytes a context of `ctx` positions takes before its first token: one sequence's KV
    /// cache with every position written, and the RoPE tables ([`Compute::new`] builds one
    /// set, a second for LongRoPE's long factors past the original context, a third for
    /// sliding layers' own base). `None` past memory's address range.
    pub fn context_bytes(
        &self,
        ctx: usize,
        cache: CacheType,
        sliding: SlidingCache,
    ) -> Option<(usize, usize)> {
        let c = &self.config;
        let windows: Vec<Option<usize>> = (0..c.layers).map(|l| c.window(l)).collect();
        // As [`Compute::sequence_of`]: a bidirectional layer keeps every key.
        let sliding = if c.bidirectional() {
            SlidingCache::Full
        } else {
            sliding
        };
        let kv = KvCache::bytes_needed(&windows, sliding, ctx, c.kv_heads, c.head_dim, cache)?;
        let tables = 1
            + usize::from(c.long_rope_from().is_some_and(|from| from < ctx))
            + usize::from(c.rope_local_theta.is_some());
        let rope = Rope::table_bytes(c.rope_geometry(), ctx)?.checked_mul(tables)?;
        Some((kv, rope))
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
    /// Every token's final hidden state, `(T, hidden)`, in place of logits (an embedding
    /// model's output, which pooling reduces to one vector).
    States,
}

/// A gated MLP's activation: `out = act(gate) · up`, element-wise.
type GatedAct = fn(&[f32], &[f32], &mut [f32]);

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
        // A plain MLP (BERT) has no gate projection to hold.
        let gated = c.mlp_kind == kiln_format::MlpKind::Gated;
        fit(&mut self.gate, if gated { n * c.intermediate } else { 0 });
        fit(&mut self.up, n * c.intermediate);
        fit(&mut self.act, n * c.intermediate);
    }
}

/// One sequence's state: its KV cache and the tokens in it. A [`Compute`] runs it; a server
/// keeps several (and finished conversations' for reuse) beside one [`Compute`].
#[derive(Debug)]
pub struct Sequence {
    cache: KvCache,
    /// The tokens whose keys and values are in the cache, in order.
    tokens: Vec<u32>,
    /// The most tokens it has held (the cache pages written so far).
    peak: usize,
}

impl Sequence {
    /// Capacity in positions.
    pub fn ctx(&self) -> usize {
        self.cache.ctx()
    }

    /// Tokens in the cache (the position the next token gets).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Bytes held by the KV cache.
    pub fn cache_bytes(&self) -> usize {
        self.cache.bytes()
    }

    /// Bytes of keys and values the most tokens this sequence has held occupied: the memory
    /// it keeps (a cache's pages are touched only as positions are written), what a prompt
    /// cache charges for it.
    pub fn peak_bytes(&self) -> usize {
        self.cache.bytes_for(self.peak)
    }

    /// Bytes of memory this sequence holds: the pages of keys and values its longest run
    /// touched (whole pages, however few positions a head holds), its token list's capacity
    /// and its own size. At least [`Sequence::peak_bytes`]; what a prompt cache charges for
    /// keeping it, so that `--cache-mb` bounds memory rather than a count of values.
    pub fn held_bytes(&self) -> usize {
        self.cache.resident_bytes(self.peak)
            + self.tokens.capacity() * std::mem::size_of::<u32>()
            + std::mem::size_of::<Sequence>()
    }

    /// Keep only the first `len` cached tokens, and return how many are kept: `len`, or 0
    /// when a sliding layer's ring has already overwritten keys that position `len` would
    /// read (see [`KvCache::truncate`]); the caller then runs the prefix again.
    pub fn rewind(&mut self, len: usize) -> usize {
        let kept = self.cache.truncate(len);
        self.tokens.truncate(kept);
        kept
    }

    /// Keep the longest cached prefix of `ids`, returning its length: the caller then feeds
    /// `ids[len..]`. Used to carry a conversation's cache from turn to turn.
    pub fn reuse_prefix(&mut self, ids: &[u32]) -> usize {
        let mut same = common_prefix(&self.tokens, ids);
        // Something must be fed to get logits.
        if same == ids.len() {
            same = same.saturating_sub(1);
        }
        self.rewind(same)
    }
}

/// How many leading tokens `a` and `b` share.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Tokens fed to one sequence in a forward pass.
struct Segment<'s> {
    seq: &'s mut Sequence,
    tokens: &'s [u32],
}

/// What running the model needs besides a sequence: the thread pool, the RoPE tables and the
/// activation buffers, allocated once and shared by every sequence it runs.
#[derive(Debug)]
pub struct Compute<'m> {
    model: &'m Model<'m>,
    /// Shared so that a forward pass can run inside it while borrowing `self`.
    pool: Arc<Pool>,
    ctx: usize,
    cache_type: CacheType,
    sliding: SlidingCache,
    rope: Rope,
    /// LongRoPE's long-factor tables, used by a forward call that reaches past the original
    /// context (`rope` then holds the short-factor ones).
    rope_long: Option<Rope>,
    /// The sliding-window layers' tables, where their RoPE base differs (Gemma 3).
    rope_local: Option<Rope>,
    scratch: Scratch,
}

impl<'m> Compute<'m> {
    /// Tables and a pool for sequences of `ctx` positions on `threads` threads, whose KV
    /// caches are stored as `cache` (sliding-window layers kept as `sliding` says).
    pub fn new(
        model: &'m Model<'m>,
        ctx: usize,
        threads: usize,
        cache: CacheType,
        sliding: SlidingCache,
    ) -> Result<Compute<'m>> {
        if threads == 0 {
            return Err(RunnerError::InvalidArgument {
                arg: "--threads",
                reason: "at least one thread is needed".into(),
            });
        }
        let pool = Arc::new(Pool::new(threads).map_err(RunnerError::Pool)?);
        Compute::with_pool(model, ctx, pool, cache, sliding)
    }

    /// [`Compute::new`] on an existing pool: two models run in turn (a draft and its target)
    /// share one set of threads, rather than one pool's threads spinning while the other's
    /// work.
    fn with_pool(
        model: &'m Model<'m>,
        ctx: usize,
        pool: Arc<Pool>,
        cache: CacheType,
        sliding: SlidingCache,
    ) -> Result<Compute<'m>> {
        let c = &model.config;
        // Before any table is built per position: an absurd context is refused in
        // milliseconds, not after its tables.
        model.check_context(ctx, cache, sliding, "--ctx")?;
        Ok(Compute {
            model,
            pool,
            ctx,
            cache_type: cache,
            sliding,
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
            scratch: Scratch::default(),
        })
    }

    /// A compute for another model (a draft) on this one's threads, as
    /// [`Session::alongside`].
    pub fn alongside<'d>(
        &self,
        model: &'d Model<'d>,
        ctx: usize,
        cache: CacheType,
        sliding: SlidingCache,
    ) -> Result<Compute<'d>> {
        Compute::with_pool(model, ctx, Arc::clone(&self.pool), cache, sliding)
    }

    /// An empty sequence: a KV cache for the context (its memory is touched as it fills).
    pub fn sequence(&self) -> Result<Sequence> {
        self.sequence_of(self.ctx)
    }

    /// A sequence holding at most `ctx` positions (at most [`Compute::ctx`]): what one text of
    /// an embedding batch needs, rather than the longest any text may be.
    pub fn sequence_of(&self, ctx: usize) -> Result<Sequence> {
        let ctx = ctx.min(self.ctx);
        let c = &self.model.config;
        // A bidirectional layer's queries read keys after their own: a text's keys are all
        // kept, never a ring.
        let sliding = if c.bidirectional() {
            SlidingCache::Full
        } else {
            self.sliding
        };
        Ok(Sequence {
            cache: KvCache::with_windows(
                &(0..c.layers).map(|l| c.window(l)).collect::<Vec<_>>(),
                sliding,
                ctx,
                c.kv_heads,
                c.head_dim,
                self.cache_type,
            )?,
            tokens: Vec::new(),
            peak: 0,
        })
    }

    /// The model.
    pub fn model(&self) -> &'m Model<'m> {
        self.model
    }

    /// Positions each sequence holds.
    pub fn ctx(&self) -> usize {
        self.ctx
    }

    /// Compute threads.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// How KV caches store keys and values.
    pub fn cache_type(&self) -> CacheType {
        self.cache_type
    }

    /// Run `tokens` at positions `seq.len()..seq.len()+n` as one batch and return the
    /// requested logits (`(1, vocab)` for [`Logits::Last`], `(n, vocab)` for [`Logits::All`]).
    ///
    /// The pass runs on one of the pool's threads, so that each product starts on the pool
    /// directly (see [`Pool::install`]).
    pub fn forward(
        &mut self,
        seq: &mut Sequence,
        tokens: &[u32],
        which: Logits,
        observer: Option<&mut dyn Observer>,
    ) -> Result<&[f32]> {
        let pool = Arc::clone(&self.pool);
        let mut segs = [Segment { seq, tokens }];
        pool.install(move || self.run(&mut segs, which, observer, false))
    }

    /// Run `tokens` at positions `seq.len()..seq.len()+n` in one pass and return all `n`
    /// rows of logits, row `i` bit for bit what [`Compute::forward`] of `tokens[i]` alone
    /// gives after `tokens[..i]` went in one at a time: every matrix reads its weights once
    /// for all the rows ([`Batching::Independent`]), and each row's attention runs as a lone
    /// token's does. Speculative decoding checks its guesses with it, and keeps only the
    /// cache positions it accepts ([`Sequence::rewind`]).
    pub fn verify(&mut self, seq: &mut Sequence, tokens: &[u32]) -> Result<&[f32]> {
        let pool = Arc::clone(&self.pool);
        let mut segs = [Segment { seq, tokens }];
        pool.install(move || self.run(&mut segs, Logits::All, None, true))
    }

    /// Several sequences' tokens in one pass, `inputs[i]` going to `seqs[i]` (a decoding
    /// step where some sequences also check guesses): with [`Logits::All`] every row of
    /// logits, in order, each bit for bit what [`Compute::forward`] of its token alone gives
    /// after the tokens before it went in one at a time ([`Compute::verify`] for several
    /// sequences); with [`Logits::Last`] each sequence's last row.
    pub fn decode_rows(
        &mut self,
        seqs: &mut [&mut Sequence],
        inputs: &[&[u32]],
        which: Logits,
    ) -> Result<&[f32]> {
        self.run_segments("decode", seqs, inputs, which, true)
    }

    /// An encoder's pass: each of `inputs` (whole texts) into its own empty sequence of
    /// `seqs`, returning every token's final state, `(Σ len, hidden)`, in order. Every
    /// product reads its rows independently and each text attends over its own tokens only,
    /// so a text's states are the same bits alone or beside others.
    pub fn encode(&mut self, seqs: &mut [&mut Sequence], inputs: &[&[u32]]) -> Result<&[f32]> {
        self.run_segments("encode", seqs, inputs, Logits::States, false)
    }

    /// An embedding model's dense layers over `n` pooled vectors `x` (`n × in`, row-major):
    /// `act(W·v + b)` for each layer in order (sentence-transformers' `Dense` modules). Every
    /// product runs as [`Batching::Texts`], so a vector's bits do not depend on its batch.
    pub fn project(&self, mut x: Vec<f32>, n: usize) -> Vec<f32> {
        let dense = &self.model.weights.dense;
        let specs = self.model.config.embedding.iter().flat_map(|e| &e.dense);
        for ((w, bias), spec) in dense.iter().zip(specs) {
            let mut y = vec![0.0f32; n * w.rows];
            let pool = &*self.pool;
            pool.install(|| matmul_many_for(&[w], &x, n, &mut [&mut y], pool, Batching::Texts));
            if let Some(b) = bias {
                add_rows(pool, &mut y, b);
            }
            if spec.activation == kiln_format::DenseActivation::Tanh {
                y.iter_mut().for_each(|v| *v = v.tanh());
            }
            x = y;
        }
        x
    }

    /// `inputs[i]` into `seqs[i]`, all in one pass on the pool ([`Compute::run`]).
    fn run_segments(
        &mut self,
        what: &'static str,
        seqs: &mut [&mut Sequence],
        inputs: &[&[u32]],
        which: Logits,
        lone_rows: bool,
    ) -> Result<&[f32]> {
        if seqs.len() != inputs.len() {
            return Err(RunnerError::InvalidArgument {
                arg: what,
                reason: format!("{} sequences but {} inputs", seqs.len(), inputs.len()),
            });
        }
        let pool = Arc::clone(&self.pool);
        let mut segs: Vec<Segment<'_>> = seqs
            .iter_mut()
            .zip(inputs)
            .map(|(seq, tokens)| Segment { seq, tokens })
            .collect();
        pool.install(move || self.run(&mut segs, which, None, lone_rows))
    }

    /// The forward pass over `segs` (one sequence's prompt, or tokens of several sequences),
    /// on the current thread. With several segments, [`Logits::Last`] gives each segment's
    /// last row and [`Logits::All`] every row. `lone_rows`: every row gets the bits it gets as a lone token
    /// (independent rows in every product, attention one query at a time).
    fn run(
        &mut self,
        segs: &mut [Segment<'_>],
        which: Logits,
        mut observer: Option<&mut dyn Observer>,
        lone_rows: bool,
    ) -> Result<&[f32]> {
        let model = self.model;
        let c = &model.config;
        let w = &model.weights;
        if segs.len() > 1 && observer.is_some() {
            return Err(RunnerError::InvalidArgument {
                arg: "forward",
                reason: "observers are for one sequence at a time".into(),
            });
        }
        for seg in segs.iter() {
            let (n, pos0) = (seg.tokens.len(), seg.seq.cache.len());
            if n == 0 {
                return Err(RunnerError::EmptyPrompt);
            }
            if pos0 + n > seg.seq.cache.ctx() {
                return Err(RunnerError::ContextOverflow {
                    tokens: pos0 + n,
                    ctx: seg.seq.cache.ctx(),
                    max_ctx: c.max_position_embeddings,
                });
            }
            if let Some(&id) = seg.tokens.iter().find(|&&id| id as usize >= c.vocab) {
                return Err(RunnerError::TokenOutOfRange { id, vocab: c.vocab });
            }
        }
        // Several sequences' tokens, or a guess being checked: each must get the bits it
        // gets alone. Texts being embedded, read whole and never a token at a time, take one
        // path at every batch size instead, the lanes kernels' where the tier has them: a
        // text's embedding is the same alone or in a batch, at the fast kernels' speed.
        let batching = if c.bidirectional() || which == Logits::States {
            Batching::Texts
        } else if lone_rows || segs.len() > 1 {
            Batching::Independent
        } else {
            Batching::Joint
        };
        if c.bidirectional() && lone_rows {
            return Err(RunnerError::InvalidArgument {
                arg: "forward",
                reason: "a bidirectional model reads each text whole; it has no one-token steps"
                    .into(),
            });
        }
        let n: usize = segs.iter().map(|s| s.tokens.len()).sum();
        let (h, qd, kvd, ff) = (c.hidden, c.q_dim(), c.kv_dim(), c.intermediate);
        let hd = c.head_dim;
        let eps = c.rms_norm_eps;
        let arch = c.architecture;
        let pool = &self.pool;
        let s = &mut self.scratch;
        s.fit(c, n);

        // inputs_embeds = self.embed_tokens(input_ids)
        let ids = segs.iter().flat_map(|seg| {
            let pos0 = seg.seq.cache.len();
            seg.tokens
                .iter()
                .enumerate()
                .map(move |(i, id)| (id, pos0 + i))
        });
        let mut pos_row = vec![0.0f32; if w.pos_embed.is_some() { h } else { 0 }];
        for ((&id, pos), row) in ids.zip(s.x.chunks_exact_mut(h)) {
            dequantize_row(&w.embed, id as usize, row);
            // Gemma: `embed_tokens(ids) * embed_scale`, in f32.
            if let Some(scale) = c.embed_scale {
                row.iter_mut().for_each(|v| *v *= scale);
            }
            // BERT: inputs_embeds + token_type_embeddings + position_embeddings, in that order.
            if let Some(types) = &w.type_embed {
                axpy(1.0, types, row);
            }
            if let Some(table) = &w.pos_embed {
                dequantize_row(table, pos, &mut pos_row);
                axpy(1.0, &pos_row, row);
            }
        }
        // BERT: embeddings = self.LayerNorm(embeddings)
        if let Some(norm) = &w.embed_norm {
            norm_rows_inplace_with(pool, &mut s.x, norm, eps, h);
        }
        emit_edit(&mut observer, arch, Activation::Embed, &mut s.x, h);
        let post_norm = c.norm_place == NormPlace::Post;
        let learned_positions = w.pos_embed.is_some();

        // Each segment's full-attention RoPE tables for this call: LongRoPE's long factors
        // when its last position + 1 exceeds the original context, as transformers chooses
        // per forward call.
        let rope_global: Vec<&Rope> = segs
            .iter()
            .map(|seg| {
                let end = seg.seq.cache.len() + seg.tokens.len();
                match &self.rope_long {
                    Some(long) if c.long_rope_from().is_some_and(|from| end > from) => long,
                    _ => &self.rope,
                }
            })
            .collect();
        for (l, lw) in w.layers.iter().enumerate() {
            // hidden_states = self.input_layernorm(hidden_states)  (BERT: no norm before)
            if post_norm {
                copy_rows(pool, &s.x, &mut s.xn, h);
            } else {
                norm_rows(pool, &s.x, &lw.attn_norm, eps, &mut s.xn, h);
                emit(&mut observer, arch, Activation::AttnNorm(l), &s.xn, h);
            }

            // q/k/v = self.{q,k,v}_proj(hidden_states)  (+ bias for Qwen2)
            matmul_many_for(
                &[&lw.q, &lw.k, &lw.v],
                &s.xn,
                n,
                &mut [&mut s.q, &mut s.k, &mut s.v],
                pool,
                batching,
            );
            if let Some([bq, bk, bv]) = &lw.qkv_bias {
                add_rows(pool, &mut s.q, bq);
                add_rows(pool, &mut s.k, bk);
                add_rows(pool, &mut s.v, bv);
            }
            emit_edit(&mut observer, arch, Activation::Q(l), &mut s.q, qd);
            emit_edit(&mut observer, arch, Activation::K(l), &mut s.k, kvd);
            emit_edit(&mut observer, arch, Activation::V(l), &mut s.v, kvd);
            // q = self.q_norm(q.view(hidden_shape)); k = self.k_norm(...)  (per head)
            if let Some([qn, kn]) = &lw.qk_norm {
                norm_rows_inplace(pool, &mut s.q, qn, eps, hd);
                norm_rows_inplace(pool, &mut s.k, kn, eps, hd);
                emit(&mut observer, arch, Activation::QNorm(l), &s.q, qd);
                emit(&mut observer, arch, Activation::KNorm(l), &s.k, kvd);
            }

            let shape = AttnShape {
                heads: c.heads,
                kv_heads: c.kv_heads,
                head_dim: hd,
                window: c.window(l),
                scale: c.attn_scale,
                causal: !c.bidirectional(),
            };
            let mut first = 0;
            for (seg, global) in segs.iter_mut().zip(&rope_global) {
                let (seg_n, pos0) = (seg.tokens.len(), seg.seq.cache.len());
                let rows = first..first + seg_n;
                first += seg_n;
                // q, k = apply_rotary_pos_emb(q, k, cos, sin)  (the layer type's tables)
                // Lone rows choose LongRoPE's tables as their own forward call would.
                let rope_at = |end: usize| match (&self.rope_local, &self.rope_long) {
                    (Some(local), _) if c.local_rope(l) => local,
                    (_, Some(long)) if lone_rows => match c.long_rope_from() {
                        Some(from) if end > from => long,
                        _ => &self.rope,
                    },
                    _ => *global,
                };
                // (Learned positions went in with the embeddings.)
                let rotated = if learned_positions {
                    0..0
                } else {
                    rows.clone()
                };
                for (i, t) in rotated.enumerate() {
                    let rope = rope_at(pos0 + i + 1);
                    rope.apply(&mut s.q[t * qd..(t + 1) * qd], pos0 + i);
                    rope.apply(&mut s.k[t * kvd..(t + 1) * kvd], pos0 + i);
                }
                // key_states, value_states = past_key_values.update(...)
                // attn_output = eager_attention_forward(...)
                // A ring takes its layer's tokens a step at a time: each step's keys are
                // written after the previous step's queries have read the keys they overwrite.
                // Lone rows go one at a time, as decoding writes and reads them.
                let cache = &mut seg.seq.cache;
                let step = if lone_rows {
                    1
                } else {
                    cache.batch_limit(l).min(seg_n)
                };
                // Every query of a bidirectional layer reads every key: all are written first.
                if !shape.causal && step < seg_n {
                    return Err(RunnerError::InvalidArgument {
                        arg: "forward",
                        reason: format!(
                            "a bidirectional layer needs the text's {seg_n} tokens in one step"
                        ),
                    });
                }
                for t0 in (0..seg_n).step_by(step) {
                    let t1 = (t0 + step).min(seg_n);
                    let (a, b) = (rows.start + t0, rows.start + t1);
                    cache.write(l, pos0 + t0, &s.k[a * kvd..b * kvd], &s.v[a * kvd..b * kvd]);
                    attention(
                        shape,
                        &s.q[a * qd..b * qd],
                        cache,
                        l,
                        pos0 + t0,
                        &mut s.att[a * qd..b * qd],
                        &mut s.attn,
                        pool,
                    );
                }
            }
            // attn_output = self.o_proj(attn_output)
            emit(&mut observer, arch, Activation::AttnOut(l), &s.att, qd);
            matmul_many_for(&[&lw.o], &s.att, n, &mut [&mut s.proj], pool, batching);
            if let Some(b) = &lw.o_bias {
                add_rows(pool, &mut s.proj, b);
            }
            emit_edit(&mut observer, arch, Activation::O(l), &mut s.proj, h);
            // Gemma: hidden_states = self.post_attention_layernorm(hidden_states)
            if let Some(post) = &lw.attn_post_norm {
                norm_rows_inplace(pool, &mut s.proj, post, eps, h);
                emit(&mut observer, arch, Activation::AttnPostNorm(l), &s.proj, h);
            }
            // hidden_states = residual + hidden_states
            add_residual(pool, &s.proj, &mut s.x, h);
            // BERT: hidden_states = self.LayerNorm(hidden_states + input_tensor)
            if post_norm {
                norm_rows_inplace_with(pool, &mut s.x, &lw.attn_norm, eps, h);
                emit(&mut observer, arch, Activation::AttnNorm(l), &s.x, h);
                copy_rows(pool, &s.x, &mut s.xn, h);
            } else {
                // hidden_states = self.post_attention_layernorm(hidden_states)
                //   (Gemma: self.pre_feedforward_layernorm)
                norm_rows(pool, &s.x, &lw.mlp_norm, eps, &mut s.xn, h);
                let mlp_norm = if c.post_norms {
                    Activation::PreFfnNorm(l)
                } else {
                    Activation::MlpNorm(l)
                };
                emit(&mut observer, arch, mlp_norm, &s.xn, h);
            }
            // down_proj(act_fn(gate_proj(x)) * up_proj(x))  (BERT: output(gelu(intermediate(x))))
            match &lw.gate {
                Some(gate) => {
                    matmul_many_for(
                        &[gate, &lw.up],
                        &s.xn,
                        n,
                        &mut [&mut s.gate, &mut s.up],
                        pool,
                        batching,
                    );
                    emit_edit(&mut observer, arch, Activation::Gate(l), &mut s.gate, ff);
                }
                None => matmul_many_for(&[&lw.up], &s.xn, n, &mut [&mut s.up], pool, batching),
            }
            if let Some(b) = &lw.up_bias {
                add_rows(pool, &mut s.up, b);
            }
            emit_edit(&mut observer, arch, Activation::Up(l), &mut s.up, ff);
            // Element-wise, so over the pool for a prompt (one token: microseconds, kept here).
            let gated: Option<GatedAct> = match c.mlp_activation {
                MlpActivation::Silu => Some(silu_mul),
                MlpActivation::GeluTanh => Some(gelu_tanh_mul),
                MlpActivation::Gelu => None,
            };
            let (gate_in, up_in) = (&s.gate, &s.up);
            let act = |t: usize, a: &mut [f32]| {
                let r = t * ff..(t + 1) * ff;
                match (gated, lw.gate.is_some()) {
                    (Some(f), true) => f(&gate_in[r.clone()], &up_in[r], a),
                    _ => gelu(&up_in[r], a),
                }
            };
            if n > 1 {
                pool.for_each_chunk(&mut s.act, ff, act);
            } else {
                act(0, &mut s.act);
            }
            emit(&mut observer, arch, Activation::DownIn(l), &s.act, ff);
            matmul_many_for(&[&lw.down], &s.act, n, &mut [&mut s.proj], pool, batching);
            if let Some(b) = &lw.down_bias {
                add_rows(pool, &mut s.proj, b);
            }
            emit_edit(&mut observer, arch, Activation::Mlp(l), &mut s.proj, h);
            // Gemma: hidden_states = self.post_feedforward_layernorm(hidden_states)
            if let Some(post) = &lw.mlp_post_norm {
                norm_rows_inplace(pool, &mut s.proj, post, eps, h);
                emit(&mut observer, arch, Activation::PostFfnNorm(l), &s.proj, h);
            }
            // hidden_states = residual + hidden_states
            add_residual(pool, &s.proj, &mut s.x, h);
            // BERT: layer_output = self.LayerNorm(hidden_states + attention_output)
            if post_norm {
                norm_rows_inplace_with(pool, &mut s.x, &lw.mlp_norm, eps, h);
            }
            emit(&mut observer, arch, Activation::Layer(l), &s.x, h);
        }
        for seg in segs.iter_mut() {
            let len = seg.seq.cache.len() + seg.tokens.len();
            seg.seq.cache.set_len(len);
            seg.seq.tokens.extend_from_slice(seg.tokens);
            seg.seq.peak = seg.seq.peak.max(len);
        }

        // hidden_states = self.norm(hidden_states); logits = self.lm_head(hidden_states)
        let all = which == Logits::All || wants(&observer, arch, Activation::FinalNorm);
        // The rows that get logits: every row, or each segment's last.
        let mut picked = Vec::with_capacity(segs.len());
        let mut end = 0;
        for seg in segs.iter() {
            let start = end;
            end += seg.tokens.len();
            if all {
                picked.extend(start..end);
            } else {
                picked.push(end - 1);
            }
        }
        let rows = picked.len();
        // An encoder's states are the last layer's output (BERT has no final norm).
        if which == Logits::States {
            return Ok(match &w.final_norm {
                Some(norm) => {
                    norm_rows(pool, &s.x, norm, eps, &mut s.xn, h);
                    emit(&mut observer, arch, Activation::FinalNorm, &s.xn, h);
                    &s.xn
                }
                None => &s.x,
            });
        }
        let Some(final_norm) = &w.final_norm else {
            // A post-norm encoder has no final norm: for calibration, its layers were all.
            if which == Logits::None {
                return Ok(&[]);
            }
            return Err(RunnerError::InvalidArgument {
                arg: "forward",
                reason: "an embedding model has no output head; it gives states, not logits".into(),
            });
        };
        if all {
            norm_rows(pool, &s.x, final_norm, eps, &mut s.xn, h);
            emit(&mut observer, arch, Activation::FinalNorm, &s.xn, h);
        } else {
            for (i, &r) in picked.iter().enumerate() {
                final_norm.apply(&s.x[r * h..(r + 1) * h], eps, &mut s.xn[i * h..(i + 1) * h]);
            }
        }
        if which == Logits::None {
            return Ok(&[]);
        }
        let out: &Matrix = w.output();
        s.logits.resize(rows * c.vocab, 0.0);
        matmul_many_for(
            &[out],
            &s.xn[..rows * h],
            rows,
            &mut [&mut s.logits[..]],
            pool,
            batching,
        );
        emit_edit(
            &mut observer,
            arch,
            Activation::Logits,
            &mut s.logits,
            c.vocab,
        );
        Ok(match (which, segs.len()) {
            (Logits::All, _) => &s.logits,
            (_, 1) => &s.logits[(rows - 1) * c.vocab..],
            _ => &s.logits,
        })
    }
}

/// One conversation: a [`Compute`] and its [`Sequence`].
#[derive(Debug)]
pub struct Session<'m> {
    compute: Compute<'m>,
    seq: Sequence,
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
        let compute = Compute::new(model, ctx, threads, cache, sliding)?;
        let seq = compute.sequence()?;
        Ok(Session { compute, seq })
    }

    /// A session for `model` on this session's threads (`ctx` positions, its cache stored as
    /// `cache`, sliding layers as `sliding`): for a draft model, which runs in turn with its
    /// target. Separate pools would each keep their threads spinning while the other works.
    pub fn alongside<'d>(
        &self,
        model: &'d Model<'d>,
        ctx: usize,
        cache: CacheType,
        sliding: SlidingCache,
    ) -> Result<Session<'d>> {
        let compute = self.compute.alongside(model, ctx, cache, sliding)?;
        let seq = compute.sequence()?;
        Ok(Session { compute, seq })
    }

    /// The model.
    pub fn model(&self) -> &'m Model<'m> {
        self.compute.model
    }

    /// Capacity in positions.
    pub fn ctx(&self) -> usize {
        self.seq.ctx()
    }

    /// Compute threads.
    pub fn threads(&self) -> usize {
        self.compute.threads()
    }

    /// How the KV cache stores keys and values.
    pub fn cache_type(&self) -> CacheType {
        self.compute.cache_type
    }

    /// Bytes held by the KV cache.
    pub fn cache_bytes(&self) -> usize {
        self.seq.cache_bytes()
    }

    /// Tokens in the cache (the position the next token gets).
    pub fn tokens(&self) -> &[u32] {
        self.seq.tokens()
    }

    /// Forget everything.
    pub fn reset(&mut self) {
        self.rewind(0);
    }

    /// See [`Sequence::rewind`].
    pub fn rewind(&mut self, len: usize) -> usize {
        self.seq.rewind(len)
    }

    /// Positions the KV cache holds in each layer: the context, or a sliding layer's ring.
    pub fn cache_capacities(&self) -> Vec<usize> {
        (0..self.compute.model.config.layers)
            .map(|l| self.seq.cache.capacity(l))
            .collect()
    }

    /// See [`Sequence::reuse_prefix`].
    pub fn reuse_prefix(&mut self, ids: &[u32]) -> usize {
        self.seq.reuse_prefix(ids)
    }

    /// See [`Compute::forward`].
    pub fn forward(
        &mut self,
        tokens: &[u32],
        which: Logits,
        observer: Option<&mut dyn Observer>,
    ) -> Result<&[f32]> {
        self.compute.forward(&mut self.seq, tokens, which, observer)
    }

    /// See [`Compute::verify`].
    pub fn verify(&mut self, tokens: &[u32]) -> Result<&[f32]> {
        self.compute.verify(&mut self.seq, tokens)
    }

    /// Its compute and its sequence, apart: the engine runs the one over the other.
    pub(crate) fn parts_mut(&mut self) -> (&mut Compute<'m>, &mut Sequence) {
        (&mut self.compute, &mut self.seq)
    }

    /// Its compute and its sequence, taken apart.
    pub(crate) fn into_parts(self) -> (Compute<'m>, Sequence) {
        (self.compute, self.seq)
    }
}

/// Values per piece when a prompt's row-wise steps (norms, bias and residual adds, copies) go
/// over the pool: 32 KiB, whole rows.
///
/// Why over the pool at all: these steps are cheap per row, but a batch of 2048 tokens makes
/// each one megabytes, and run on the calling thread alone they left the other threads
/// spinning, about a tenth of an encoder's time (BERT's post-norm layer has eleven of them).
/// Each row's arithmetic is the same wherever it runs, so the bits do not change.
const PIECE_VALUES: usize = 8192;

/// `f(first_row, rows)` over `x`'s `width`-wide rows, in pieces of whole rows spread over
/// `pool` (one piece, on the caller, for a short batch).
fn each_rows(pool: &Pool, x: &mut [f32], width: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    let rows = (PIECE_VALUES / width).max(1);
    pool.for_each_chunk(x, rows * width, |i, piece| f(i * rows, piece));
}

/// `norm` of each `width`-wide row of `x` into `out`.
fn norm_rows(pool: &Pool, x: &[f32], norm: &Norm<'_>, eps: f32, out: &mut [f32], width: usize) {
    each_rows(pool, out, width, |r0, out| {
        let x = &x[r0 * width..];
        for (xr, or) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
            norm.apply(xr, eps, or);
        }
    });
}

/// `f(row, out)` for each `width`-wide row of `x`, in place: a row is copied out first, since
/// the norm kernels read their input while writing their output.
fn rows_inplace(pool: &Pool, x: &mut [f32], width: usize, f: impl Fn(&[f32], &mut [f32]) + Sync) {
    each_rows(pool, x, width, |_, x| {
        let mut row = vec![0.0f32; width];
        for xr in x.chunks_exact_mut(width) {
            row.copy_from_slice(xr);
            f(&row, xr);
        }
    });
}

/// A block's norm of each `width`-wide row of `x`, in place (a post-norm model's residual).
fn norm_rows_inplace_with(pool: &Pool, x: &mut [f32], norm: &Norm<'_>, eps: f32, width: usize) {
    rows_inplace(pool, x, width, |row, out| norm.apply(row, eps, out));
}

/// RMSNorm of each `width`-wide row of `x` in place (per head for q/k norms).
fn norm_rows_inplace(pool: &Pool, x: &mut [f32], weight: &[f32], eps: f32, width: usize) {
    rows_inplace(pool, x, width, |row, out| rmsnorm(row, weight, eps, out));
}

/// Add `bias` to every row of `x`.
fn add_rows(pool: &Pool, x: &mut [f32], bias: &[f32]) {
    each_rows(pool, x, bias.len(), |_, x| {
        for row in x.chunks_exact_mut(bias.len()) {
            axpy(1.0, bias, row);
        }
    });
}

/// `x += y` (the residual), rows of `width` spread over `pool`.
fn add_residual(pool: &Pool, y: &[f32], x: &mut [f32], width: usize) {
    each_rows(pool, x, width, |r0, x| {
        axpy(1.0, &y[r0 * width..][..x.len()], x)
    });
}

/// `dst = src`, rows of `width` spread over `pool`.
fn copy_rows(pool: &Pool, src: &[f32], dst: &mut [f32], width: usize) {
    each_rows(pool, dst, width, |r0, d| {
        d.copy_from_slice(&src[r0 * width..][..d.len()])
    });
}

/// Models for the crate's unit tests.
#[cfg(test)]
pub(crate) mod tests_support {
    use std::path::{Path, PathBuf};

    /// The tiny tied-embedding Llama fixture converted to f32 in `dir`.
    pub(crate) fn tiny_model(dir: &Path) -> PathBuf {
        let input = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny/llama-tied-f32");
        let output = dir.join("tiny.kiln");
        kiln_convert::convert_hf(
            &kiln_convert::ConvertOptions {
                input,
                output: output.clone(),
                dtype: Some(kiln_format::DType::F32),
                overwrite: true,
                allow_non_finite: false,
            },
            &kiln_convert::NoProgress,
        )
        .expect("the tiny fixture converts");
        output
    }
}
