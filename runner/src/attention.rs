//! Causal grouped-query attention of a batch of queries over the KV cache, a block of keys at
//! a time (flash attention on the CPU).
//!
//! Mirrors transformers' `eager_attention_forward`: `softmax(q·kᵀ·scale + mask)·v` (`scale`
//! is `1/√head_dim` except where a family sets its own), with query head `h` reading
//! key/value head `h / (heads / kv_heads)` (`repeat_kv`), the causal mask letting position `p`
//! see keys `0..=p`, and, with a sliding window `w`, only keys `j` with `p - j < w` (Mistral).
//! An encoder's queries see every key of their text, or, windowed, those with `|p - j| < w`
//! (EmbeddingGemma's sliding layers). Scores are f32, as in the reference.
//!
//! No `(queries × keys)` score matrix is ever formed. The work is cut into items of one
//! key/value head, a tile of query tokens ([`AttnShape::query_tile`]; with all the query heads that share
//! the key/value head: their rows read the same keys) and a span of keys; an item walks its
//! span [`KEY_BLOCK`] keys at a time, keeping per query row a running maximum `m`, a running
//! sum `l` of `e^(s - m)` and an unnormalized output `o`, rescaled by `e^(m_old - m_new)`
//! whenever the maximum grows (the online softmax). Blocks a whole tile cannot see (above the
//! causal diagonal, or before a sliding window) are never computed. Keys are multiplied in the
//! cache's own encoding (f16 or Q8_0 keys are never widened to memory); values are widened a
//! block at a time into a buffer that stays in L1.
//!
//! A sliding layer's keys may live in a ring ([`crate::kv_cache`]): position `p` is row
//! `p mod capacity`, and a block of keys is cut where the ring wraps, so that each block is
//! still one contiguous matrix.
//!
//! Items are independent and spread over the pool. A call with few of them (decoding one
//! token, or a short batch, over a deep cache) splits each tile's keys into spans of
//! [`KEY_SPAN`], whose partial results are merged afterwards in a fixed order: many threads
//! then share one token's attention, and since the cut depends only on the shapes, never on
//! the thread count, the result is the same bits on any number of threads.

use std::cell::RefCell;
use std::sync::OnceLock;

use kiln_kernels::{axpy, exp_sum, scores, weighted_sum, weighted_sum_f16, Pool};

use crate::kv_cache::{KvCache, KvRows};

/// Keys per block: a block of f16 keys (or values) of a 128-wide head is 32 KiB, its widened
/// values and the tile's scores stay within L1/L2.
const KEY_BLOCK: usize = 128;

/// Query tokens per tile. With four query heads per key/value head this is 64 rows: enough
/// to run the score and value products as matrix–matrix products.
const QUERY_TILE: usize = 16;

/// Keys per span when a call's (head, tile) items are fewer than [`SPLIT_BELOW`].
const KEY_SPAN: usize = 1024;

/// Items below which keys are split into spans (one token over 8 key/value heads is 8 items).
const SPLIT_BELOW: usize = 64;

/// Multiply–adds (query rows × visible keys × head width, over the call) below which the
/// items run on the calling thread: handing them to the pool costs more.
const PARALLEL_MIN_WORK: usize = 256 * 1024;

/// The head layout.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Sliding-window span, if any.
    pub window: Option<usize>,
    /// Factor on the scores (`1/√head_dim`, or the family's own).
    pub scale: f32,
    /// Whether a query sees only its own and earlier positions; an encoder's queries see
    /// every key of the call's tokens.
    pub causal: bool,
}

impl AttnShape {
    /// The first key position query position `p` may attend to.
    fn first_key(&self, p: usize) -> usize {
        match self.window {
            Some(w) => (p + 1).saturating_sub(w),
            None => 0,
        }
    }

    /// One past the last key position query position `p` may attend to: `p + 1` when causal;
    /// otherwise every key of the call, or, windowed, those with `|p - j| < w` (EmbeddingGemma).
    fn key_end(&self, p: usize) -> usize {
        match (self.causal, self.window) {
            (true, _) => p + 1,
            (false, Some(w)) => p.saturating_add(w),
            (false, None) => usize::MAX,
        }
    }

    /// Query heads per key/value head.
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Query tokens per tile: [`QUERY_TILE`], or for bidirectional attention with fewer than
    /// four query heads per key/value head, as many tokens as make 64 rows. There every query
    /// of a tile reads the same keys, so a larger tile computes nothing more, and the score
    /// kernel lays each block of keys out in its lanes once per tile: with one head per
    /// key/value head (BERT), sixteen-token tiles spent about 4% of an embedding's time
    /// re-laying the same keys.
    fn query_tile(&self) -> usize {
        if self.causal {
            QUERY_TILE
        } else {
            QUERY_TILE * (4 / self.group().clamp(1, 4))
        }
    }
}

/// One unit of work: a key/value head, query tokens `t0..t1` of the batch, keys `k0..k1`.
/// Holds its partial result: per row (`(t - t0)·group + i` for query head `g·group + i` of
/// token `t`), the running maximum, the running sum and the unnormalized output.
#[derive(Debug, Default)]
struct Item {
    g: usize,
    t0: usize,
    t1: usize,
    k0: usize,
    k1: usize,
    /// `(rows,)`
    m: Vec<f32>,
    /// `(rows,)`
    l: Vec<f32>,
    /// `(rows, head_dim)`
    o: Vec<f32>,
}

/// Buffers reused across calls: the items (their partial results are the only per-call
/// memory that grows with the batch, `spans × (n, heads·head_dim)`).
#[derive(Debug, Default)]
pub struct AttnScratch {
    items: Vec<Item>,
}

/// Per-thread buffers of an item's walk over its keys.
#[derive(Debug, Default)]
struct Block {
    /// The tile's queries, `(rows, head_dim)`.
    q: Vec<f32>,
    /// Scores, then unnormalized probabilities, `(rows, keys in the block)`.
    s: Vec<f32>,
    /// The block's values widened to f32, `(keys, head_dim)` (a Q8_0 cache).
    v: Vec<f32>,
    /// `P·V` of the block, `(rows, head_dim)`.
    pv: Vec<f32>,
}

thread_local! {
    static BLOCK: RefCell<Block> = RefCell::new(Block::default());
}

/// The pool an item's products run on: none but the calling thread (an item is already one
/// thread's share of the work). Made once: starting a pool asks the OS for the CPU count.
fn one_thread() -> &'static Pool {
    static ONE: OnceLock<Pool> = OnceLock::new();
    ONE.get_or_init(|| Pool::new(1).expect("a one-thread pool starts no threads"))
}

/// Attention of `n` queries at positions `pos0..pos0+n` over `layer` of `cache` (which already
/// holds this batch's keys and values).
///
/// `q`: `(n, heads*head_dim)`, already rotated; `out`: `(n, heads*head_dim)`.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    shape: AttnShape,
    q: &[f32],
    cache: &KvCache,
    layer: usize,
    pos0: usize,
    out: &mut [f32],
    scratch: &mut AttnScratch,
    pool: &Pool,
) {
    let hd = shape.head_dim;
    let q_dim = shape.heads * hd;
    let n = q.len() / q_dim;
    let group = shape.group();
    assert_eq!(out.len(), q.len(), "attention: output length");
    assert!(
        n <= cache.batch_limit(layer),
        "attention: {n} queries overrun layer {layer}'s ring"
    );

    // Cut the work: (head, tile) in order, each tile's keys in spans when items are few.
    let tile = shape.query_tile();
    let tiles = n.div_ceil(tile);
    let split = shape.kv_heads * tiles < SPLIT_BELOW;
    let items = &mut scratch.items;
    let mut count = 0;
    let mut work = 0usize;
    for g in 0..shape.kv_heads {
        for t0 in (0..n).step_by(tile) {
            let t1 = (t0 + tile).min(n);
            let hi = shape.key_end(pos0 + t1 - 1).min(pos0 + n);
            let lo = shape.first_key(pos0 + t0);
            let span = if split { KEY_SPAN } else { hi - lo };
            for k0 in (lo..hi).step_by(span.max(1)) {
                if count == items.len() {
                    items.push(Item::default());
                }
                let it = &mut items[count];
                (it.g, it.t0, it.t1, it.k0, it.k1) = (g, t0, t1, k0, (k0 + span).min(hi));
                work += (t1 - t0) * group * (it.k1 - k0) * hd;
                count += 1;
            }
        }
    }
    let items = &mut items[..count];
    let run = |_: usize, its: &mut [Item]| {
        let one = one_thread();
        BLOCK.with_borrow_mut(|b| {
            for it in its {
                run_item(shape, q, cache, layer, pos0, it, b, one);
            }
        })
    };
    if work >= PARALLEL_MIN_WORK && pool.threads() > 1 {
        pool.for_each_chunk(items, 1, run);
    } else {
        run(0, items);
    }

    // Merge each (head, tile)'s spans in order and normalize: o = Σ o_s·e^(m_s - M) over
    // Σ l_s·e^(m_s - M), M the largest m_s. One span: o / l.
    let mut i = 0;
    while i < items.len() {
        let first = &items[i];
        let spans = items[i..]
            .iter()
            .take_while(|it| (it.g, it.t0) == (first.g, first.t0))
            .count();
        let part = &items[i..i + spans];
        let (g, t0, t1) = (first.g, first.t0, first.t1);
        for r in 0..(t1 - t0) * group {
            let (t, h) = (t0 + r / group, g * group + r % group);
            let dst = &mut out[t * q_dim + h * hd..t * q_dim + (h + 1) * hd];
            if spans == 1 {
                let inv = 1.0 / first.l[r];
                for (d, &o) in dst.iter_mut().zip(&first.o[r * hd..(r + 1) * hd]) {
                    *d = o * inv;
                }
                continue;
            }
            let big = part.iter().fold(f32::NEG_INFINITY, |a, it| a.max(it.m[r]));
            dst.fill(0.0);
            let mut l = 0.0f32;
            for it in part.iter().filter(|it| it.m[r] > f32::NEG_INFINITY) {
                let w = (it.m[r] - big).exp();
                l += it.l[r] * w;
                axpy(w, &it.o[r * hd..(r + 1) * hd], dst);
            }
            let inv = 1.0 / l;
            dst.iter_mut().for_each(|d| *d *= inv);
        }
        i += spans;
    }
}

/// Walk one item's keys a block at a time, leaving its `m`, `l` and unnormalized `o`.
#[allow(clippy::too_many_arguments)]
fn run_item(
    shape: AttnShape,
    q: &[f32],
    cache: &KvCache,
    layer: usize,
    pos0: usize,
    it: &mut Item,
    b: &mut Block,
    one: &Pool,
) {
    let hd = shape.head_dim;
    let q_dim = shape.heads * hd;
    let group = shape.group();
    let rows = (it.t1 - it.t0) * group;
    // Row r = (t - t0)·group + i holds query head g·group + i of token t.
    b.q.resize(rows * hd, 0.0);
    for (r, row) in b.q.chunks_exact_mut(hd).enumerate() {
        let (t, h) = (it.t0 + r / group, it.g * group + r % group);
        row.copy_from_slice(&q[t * q_dim + h * hd..t * q_dim + (h + 1) * hd]);
    }
    it.m.clear();
    it.m.resize(rows, f32::NEG_INFINITY);
    it.l.clear();
    it.l.resize(rows, 0.0);
    it.o.clear();
    it.o.resize(rows * hd, 0.0);
    let (k, v) = cache.head(layer, it.g);
    // Position p is row p mod cap: a block never crosses the end of a ring (a layer that
    // keeps every position never reaches it, so its blocks are the plain KEY_BLOCK cut).
    let cap = cache.capacity(layer);
    let mut j1 = it.k0;
    while j1 < it.k1 {
        let j0 = j1;
        j1 = (j0 + KEY_BLOCK).min(it.k1).min((j0 / cap + 1) * cap);
        let kb = j1 - j0;
        let (r0, r1) = (j0 % cap, j0 % cap + kb);
        // attn_weights = q·kᵀ · scaling, in the cache's encoding
        b.s.resize(rows * kb, 0.0);
        scores(
            &b.q,
            &k.slice(r0, r1, hd).matrix(hd),
            shape.scale,
            &mut b.s,
            one,
        );
        // causal (and sliding-window) mask, then the online softmax's update
        let mut seen = false;
        for (r, row) in b.s.chunks_exact_mut(kb).enumerate() {
            let p = pos0 + it.t0 + r / group;
            let last = shape.key_end(p).min(j1);
            let (a, z) = (shape.first_key(p).max(j0), last);
            if a >= z {
                row.fill(0.0);
                continue;
            }
            seen = true;
            let visible = &mut row[a - j0..z - j0];
            let block_max = max_of(visible);
            let m_old = it.m[r];
            let m_new = m_old.max(block_max);
            let sum = exp_sum(visible, m_new);
            row[..a - j0].fill(0.0);
            row[z - j0..].fill(0.0);
            if m_new > m_old && m_old > f32::NEG_INFINITY {
                let c = (m_old - m_new).exp();
                it.l[r] *= c;
                it.o[r * hd..(r + 1) * hd].iter_mut().for_each(|o| *o *= c);
            }
            it.l[r] += sum;
            it.m[r] = m_new;
        }
        if !seen {
            continue;
        }
        // o += P·V, the rows sharing every load of a value row (f16 values widened in
        // registers, Q8_0 ones a block at a time into a buffer that stays in L1)
        b.pv.resize(rows * hd, 0.0);
        match v.slice(r0, r1, hd) {
            KvRows::F32(d) => weighted_sum(&b.s, kb, d, hd, &mut b.pv),
            KvRows::F16(d) => weighted_sum_f16(&b.s, kb, d, hd, &mut b.pv),
            vs @ KvRows::Q8_0(_) => {
                b.v.resize(kb * hd, 0.0);
                vs.to_f32(&mut b.v);
                weighted_sum(&b.s, kb, &b.v, hd, &mut b.pv);
            }
        }
        axpy(1.0, &b.pv, &mut it.o);
    }
}

/// The largest of `x` (`-inf` for none), sixteen running maxima at a time so that the compiler
/// vectorizes it (a fold of `f32::max` stays scalar: its NaN rule has no vector instruction).
/// Scores are finite or infinite, never NaN, unless the model's values are; then the sums are
/// NaN whichever maximum is taken.
fn max_of(x: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &v) in m.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    let m = m.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    tail.iter().fold(m, |a, &b| a.max(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::CacheType;

    /// `max_of` is the fold of `f32::max` on every length around its sixteen lanes, with
    /// infinities and all-masked (`-inf`) rows.
    #[test]
    fn max_of_is_the_plain_maximum() {
        for n in [0usize, 1, 5, 15, 16, 17, 33, 128, 130] {
            for seed in 0..4u32 {
                let x: Vec<f32> = (0..n as u32)
                    .map(|i| {
                        let h = (i ^ seed.wrapping_mul(0x9e37)).wrapping_mul(2654435761);
                        match h % 11 {
                            0 => f32::NEG_INFINITY,
                            1 if seed == 3 => f32::INFINITY,
                            _ => (h >> 8) as f32 / (1u32 << 24) as f32 * 40.0 - 20.0,
                        }
                    })
                    .collect();
                let want = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                assert_eq!(max_of(&x).to_bits(), want.to_bits(), "n={n} seed={seed}");
            }
        }
    }

    /// A direct transcription of the reference, in f64.
    fn naive(shape: AttnShape, q: &[f32], k: &[f32], v: &[f32], pos0: usize) -> Vec<f32> {
        let hd = shape.head_dim;
        let kv_dim = shape.kv_heads * hd;
        let q_dim = shape.heads * hd;
        let n = q.len() / q_dim;
        let mut out = vec![0f32; q.len()];
        let keys = if shape.causal { 0 } else { pos0 + n };
        for t in 0..n {
            let p = pos0 + t;
            let end = if shape.causal { p + 1 } else { keys };
            for h in 0..shape.heads {
                let kvh = h / (shape.heads / shape.kv_heads);
                let s: Vec<f64> = (0..end)
                    .map(|j| {
                        if shape.window.is_some_and(|w| p.abs_diff(j) >= w) {
                            return f64::NEG_INFINITY;
                        }
                        (0..hd)
                            .map(|i| {
                                f64::from(q[t * q_dim + h * hd + i])
                                    * f64::from(k[j * kv_dim + kvh * hd + i])
                            })
                            .sum::<f64>()
                            * f64::from(shape.scale)
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for i in 0..hd {
                    out[t * q_dim + h * hd + i] = (0..end)
                        .map(|j| e[j] / z * f64::from(v[j * kv_dim + kvh * hd + i]))
                        .sum::<f64>() as f32;
                }
            }
        }
        out
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 1000) as f32
                    / 500.0
                    - 1.0
            })
            .collect()
    }

    impl AttnShape {
        fn new(heads: usize, kv_heads: usize, head_dim: usize, window: Option<usize>) -> Self {
            AttnShape {
                heads,
                kv_heads,
                head_dim,
                window,
                scale: 1.0 / (head_dim as f32).sqrt(),
                causal: true,
            }
        }
    }

    /// The keys and values as the cache holds them, `(positions, kv_dim)` in f32: what the
    /// naive reference must read for a lossy cache type.
    fn stored(
        cache: &KvCache,
        layer: usize,
        kv_heads: usize,
        hd: usize,
        len: usize,
    ) -> [Vec<f32>; 2] {
        let mut kv = [
            vec![0f32; len * kv_heads * hd],
            vec![0f32; len * kv_heads * hd],
        ];
        let cap = cache.capacity(layer);
        for g in 0..kv_heads {
            let (k, v) = cache.head(layer, g);
            for (rows, dst) in [k, v].into_iter().zip(kv.iter_mut()) {
                let mut f = vec![0f32; cap * hd];
                rows.to_f32(&mut f);
                for t in 0..len {
                    let row = &f[t % cap * hd..][..hd];
                    dst[t * kv_heads * hd + g * hd..][..hd].copy_from_slice(row);
                }
            }
        }
        kv
    }

    fn run(shape: AttnShape, q: &[f32], cache: &KvCache, pos0: usize, threads: usize) -> Vec<f32> {
        let pool = Pool::new(threads).unwrap();
        let mut out = vec![0f32; q.len()];
        let mut scratch = AttnScratch::default();
        attention(shape, q, cache, 1, pos0, &mut out, &mut scratch, &pool);
        out
    }

    /// Shapes that cover: one tile and many, tiles that straddle key blocks and the diagonal,
    /// windows shorter and longer than a block, decode over a deep cache (split into spans),
    /// a short batch over a deep cache (also split), group sizes 1 to 4.
    const CASES: [(usize, usize, usize, Option<usize>, usize, usize); 9] = [
        (4, 2, 16, None, 0, 7),
        (4, 4, 8, None, 5, 1),
        (6, 2, 4, Some(3), 0, 9),
        (2, 1, 16, Some(4), 6, 5),
        (8, 2, 32, None, 30, 80),
        (8, 2, 64, None, 5000, 1),
        (4, 1, 32, Some(200), 300, 40),
        (3, 3, 64, None, 2100, 3),
        (8, 2, 64, None, 0, 300),
    ];

    /// Causal and bidirectional (an encoder's queries, windowed on both sides or not).
    #[test]
    fn matches_naive_attention_across_shapes_windows_and_threads() {
        let masks = CASES
            .into_iter()
            .flat_map(|case| [(case, true), (case, false)]);
        for ((heads, kv_heads, hd, window, pos0, n), causal) in masks {
            let shape = AttnShape {
                causal,
                ..AttnShape::new(heads, kv_heads, hd, window)
            };
            let kv_dim = kv_heads * hd;
            let q = data(n * heads * hd, 1);
            let k = data((pos0 + n) * kv_dim, 2);
            let v = data((pos0 + n) * kv_dim, 3);
            let want = naive(shape, &q, &k, &v, pos0);
            let mut cache = KvCache::new(2, pos0 + n + 3, kv_heads, hd, CacheType::F32).unwrap();
            cache.write(1, 0, &k, &v);
            cache.set_len(pos0 + n);
            let one = run(shape, &q, &cache, pos0, 1);
            let err = one
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(err < 1e-5, "{shape:?} pos0 {pos0} n {n}: {err}");
            // The cut into items does not depend on the threads: the same bits.
            let three = run(shape, &q, &cache, pos0, 3);
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&one), bits(&three), "{shape:?} pos0 {pos0} n {n}");
        }
    }

    /// f16 and Q8_0 caches: attention over what the cache holds equals the reference over the
    /// same (rounded) keys and values, so the cache's only error is its rounding.
    #[test]
    fn lossy_caches_attend_over_exactly_what_they_store() {
        for ty in [CacheType::F16, CacheType::Q8_0] {
            for (heads, kv_heads, hd, window, pos0, n) in CASES {
                if ty == CacheType::Q8_0 && hd % 32 != 0 {
                    continue;
                }
                let shape = AttnShape::new(heads, kv_heads, hd, window);
                let kv_dim = kv_heads * hd;
                let q = data(n * heads * hd, 11);
                let k = data((pos0 + n) * kv_dim, 12);
                let v = data((pos0 + n) * kv_dim, 13);
                let mut cache = KvCache::new(2, pos0 + n, kv_heads, hd, ty).unwrap();
                cache.write(1, 0, &k, &v);
                cache.set_len(pos0 + n);
                let [ks, vs] = stored(&cache, 1, kv_heads, hd, pos0 + n);
                let want = naive(shape, &q, &ks, &vs, pos0);
                let got = run(shape, &q, &cache, pos0, 2);
                // Q8_0 keys meet Q8_0-quantized queries (as llama.cpp's do): that rounding
                // moves the scores by up to ~1% of |q|·|k|.
                let tol = if ty == CacheType::Q8_0 { 2e-2 } else { 1e-5 };
                let err = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(err < tol, "{ty} {shape:?} pos0 {pos0} n {n}: {err}");
                // And the rounding itself is small against the exact values.
                let exact = naive(shape, &q, &k, &v, pos0);
                let err = got
                    .iter()
                    .zip(&exact)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(
                    err < 3e-2,
                    "{ty} vs exact {shape:?} pos0 {pos0} n {n}: {err}"
                );
            }
        }
    }

    /// A batch gives what the same tokens give one at a time (the cut differs, the math not).
    #[test]
    fn a_batch_equals_its_tokens_one_by_one() {
        let shape = AttnShape::new(8, 2, 32, Some(50));
        let (pos0, n, kv_dim) = (100, 40, 64);
        let q = data(n * 8 * 32, 21);
        let k = data((pos0 + n) * kv_dim, 22);
        let v = data((pos0 + n) * kv_dim, 23);
        let mut cache = KvCache::new(2, pos0 + n, 2, 32, CacheType::F16).unwrap();
        cache.write(1, 0, &k, &v);
        cache.set_len(pos0 + n);
        let batch = run(shape, &q, &cache, pos0, 2);
        for t in 0..n {
            let one = run(shape, &q[t * 256..(t + 1) * 256], &cache, pos0 + t, 2);
            for (a, b) in one.iter().zip(&batch[t * 256..(t + 1) * 256]) {
                assert!((a - b).abs() < 1e-5, "token {t}: {a} vs {b}");
            }
        }
    }

    /// Sliding layers kept in rings of `window - 1 + batch` slots, fed `batch` tokens at a
    /// time as a forward pass feeds them: the reference's result, with blocks cut where the
    /// ring wraps, for windows shorter and longer than a key block, rings that wrap many
    /// times, one-token steps and steps that fill the ring, on one thread and three.
    #[test]
    fn ring_caches_attend_as_the_whole_context_does() {
        use crate::kv_cache::SlidingCache;
        let cases = [
            // heads, kv_heads, hd, window, pos0, n, batch
            (2, 1, 16, 4, 6, 5, 1),
            (6, 2, 4, 3, 0, 9, 2),
            (4, 2, 16, 4, 0, 40, 3),
            (4, 1, 32, 200, 300, 40, 16),
            (8, 2, 32, 130, 250, 300, 7),
            (4, 2, 32, 130, 700, 1, 1),
            (4, 2, 32, 300, 0, 700, 64),
        ];
        for (heads, kv_heads, hd, w, pos0, n, batch) in cases {
            let shape = AttnShape::new(heads, kv_heads, hd, Some(w));
            let kv_dim = kv_heads * hd;
            let q = data(n * heads * hd, 31);
            let k = data((pos0 + n) * kv_dim, 32);
            let v = data((pos0 + n) * kv_dim, 33);
            let want = naive(shape, &q, &k, &v, pos0);
            let ctx = pos0 + n + 3;
            let ring = SlidingCache::Ring { batch };
            let mut cache =
                KvCache::with_windows(&[None, Some(w)], ring, ctx, kv_heads, hd, CacheType::F32)
                    .unwrap();
            assert_eq!(cache.capacity(0), ctx);
            assert_eq!(cache.capacity(1), w - 1 + batch, "a ring");
            assert_eq!(cache.batch_limit(1), batch);
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            let (mut one, mut three) = (vec![0f32; q.len()], vec![0f32; q.len()]);
            let q_dim = heads * hd;
            // The context before the queries, then the queries, `batch` positions a step.
            let steps = (0..pos0)
                .step_by(batch)
                .map(|p| (p, (p + batch).min(pos0)))
                .chain(
                    (pos0..pos0 + n)
                        .step_by(batch)
                        .map(|p| (p, (p + batch).min(pos0 + n))),
                );
            for (p0, p1) in steps {
                cache.write(
                    1,
                    p0,
                    &k[p0 * kv_dim..p1 * kv_dim],
                    &v[p0 * kv_dim..p1 * kv_dim],
                );
                cache.set_len(p1);
                if p0 < pos0 {
                    continue;
                }
                let qs = &q[(p0 - pos0) * q_dim..(p1 - pos0) * q_dim];
                let got1 = run(shape, qs, &cache, p0, 1);
                let got3 = run(shape, qs, &cache, p0, 3);
                assert_eq!(bits(&got1), bits(&got3), "w {w} batch {batch} at {p0}");
                one[(p0 - pos0) * q_dim..(p1 - pos0) * q_dim].copy_from_slice(&got1);
                three[(p0 - pos0) * q_dim..(p1 - pos0) * q_dim].copy_from_slice(&got3);
            }
            let err = one
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(err < 1e-5, "w {w} pos0 {pos0} n {n} batch {batch}: {err}");
        }
    }
}
