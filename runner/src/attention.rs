//! Causal grouped-query attention of a batch of queries over the KV cache.
//!
//! Mirrors transformers' `eager_attention_forward`: `softmax(q·kᵀ·scale + mask)·v` (`scale`
//! is `1/√head_dim` except where a family sets its own), with
//! query head `h` reading key/value head `h / (heads / kv_heads)` (`repeat_kv`), the causal mask
//! letting position `p` see keys `0..=p`, and, with a sliding window `w`, only keys `j` with
//! `p - j < w` (Mistral). Scores are f32, as in the reference.

use kiln_kernels::{matmul, softmax_inplace, weighted_sum, Matrix, Pool, WeightData};

use crate::kv_cache::KvCache;

/// Scores (query rows × keys) from which the masking and softmax go over the pool: about
/// 20 µs of work, well above what handing it to the other threads costs.
const PARALLEL_SOFTMAX_MIN: usize = 16 * 1024;

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
}

impl AttnShape {
    /// The first key position query position `p` may attend to.
    fn first_key(&self, p: usize) -> usize {
        match self.window {
            Some(w) => (p + 1).saturating_sub(w),
            None => 0,
        }
    }
}

/// Buffers reused across calls.
#[derive(Debug, Default)]
pub struct AttnScratch {
    /// One key/value head's queries, `(n*group, head_dim)`.
    q: Vec<f32>,
    /// Their scores, then probabilities, `(n*group, keys)`.
    scores: Vec<f32>,
    /// The head's values transposed, `(head_dim, keys)`.
    vt: Vec<f32>,
    /// Their outputs, `(n*group, head_dim)`.
    o: Vec<f32>,
}

/// Attention of `n` queries at positions `pos0..pos0+n` over `layer` of `cache` (which already
/// holds this batch's keys and values).
///
/// `q`: `(n, heads*head_dim)`, already rotated; `out`: `(n, heads*head_dim)`. Per key/value
/// head, the queries of its group form one matrix: scores are `K·qᵀ` by [`matmul`] (keys as
/// the weight matrix), masked and softmaxed per row; the output is `P·V`, by [`matmul`] over
/// the transposed values for batches, and for a single token by [`weighted_sum`] over the
/// visible keys, which the group's rows share (the bits of one `axpy` per key, without
/// loading and storing the output rows for every key).
/// Positions a row may not see are computed and then zeroed (at most twice the causal work,
/// in exchange for matrix–matrix products).
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
    let group = shape.heads / shape.kv_heads;
    let keys = pos0 + n;
    let rows = n * group;
    let scale = shape.scale;
    assert_eq!(out.len(), q.len(), "attention: output length");
    let s = scratch;
    s.q.resize(rows * hd, 0.0);
    s.scores.resize(rows * keys, 0.0);
    s.o.resize(rows * hd, 0.0);
    for g in 0..shape.kv_heads {
        let (k, v) = cache.head(layer, g, keys);
        // Row r = t*group + i holds query head g*group + i of token t.
        for (r, row) in s.q.chunks_exact_mut(hd).enumerate() {
            let (t, h) = (r / group, g * group + r % group);
            row.copy_from_slice(&q[t * q_dim + h * hd..t * q_dim + (h + 1) * hd]);
        }
        // attn_weights = q·kᵀ
        let km = Matrix::new(keys, hd, WeightData::F32(k)).expect("cache slice is keys × hd");
        matmul(&km, &s.q, rows, &mut s.scores, pool);
        // · scaling, causal (and sliding-window) mask, softmax
        let mask_softmax = |r: usize, row: &mut [f32]| {
            let p = pos0 + r / group;
            let first = shape.first_key(p);
            let visible = &mut row[first..=p];
            visible.iter_mut().for_each(|x| *x *= scale);
            softmax_inplace(visible);
            row[..first].fill(0.0);
            row[p + 1..].fill(0.0);
        };
        // Row by row: over the pool when there is enough of it (a prompt), else right here.
        if rows * keys >= PARALLEL_SOFTMAX_MIN {
            pool.for_each_chunk(&mut s.scores, keys, mask_softmax);
        } else {
            for (r, row) in s.scores.chunks_exact_mut(keys).enumerate() {
                mask_softmax(r, row);
            }
        }
        // attn_output = attn_weights · v
        if n > 1 {
            s.vt.resize(hd * keys, 0.0);
            for (j, vj) in v.chunks_exact(hd).enumerate() {
                for (c, &x) in vj.iter().enumerate() {
                    s.vt[c * keys + j] = x;
                }
            }
            let vm = Matrix::new(hd, keys, WeightData::F32(&s.vt)).expect("hd × keys");
            matmul(&vm, &s.scores, rows, &mut s.o, pool);
        } else {
            // One token at p = pos0 = keys - 1: row r's probabilities start at r·keys.
            let first = shape.first_key(pos0);
            let visible = &v[first * hd..keys * hd];
            weighted_sum(&s.scores[first..], keys, visible, hd, &mut s.o);
        }
        for (r, row) in s.o.chunks_exact(hd).enumerate() {
            let (t, h) = (r / group, g * group + r % group);
            out[t * q_dim + h * hd..t * q_dim + (h + 1) * hd].copy_from_slice(row);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A direct transcription of the reference for one query head, in f64.
    fn naive(shape: AttnShape, q: &[f32], k: &[f32], v: &[f32], pos0: usize) -> Vec<f32> {
        let hd = shape.head_dim;
        let kv_dim = shape.kv_heads * hd;
        let q_dim = shape.heads * hd;
        let n = q.len() / q_dim;
        let mut out = vec![0f32; q.len()];
        for t in 0..n {
            let p = pos0 + t;
            for h in 0..shape.heads {
                let kvh = h / (shape.heads / shape.kv_heads);
                let s: Vec<f64> = (0..=p)
                    .map(|j| {
                        if shape.window.is_some_and(|w| p - j >= w) {
                            return f64::NEG_INFINITY;
                        }
                        (0..hd)
                            .map(|i| {
                                f64::from(q[t * q_dim + h * hd + i])
                                    * f64::from(k[j * kv_dim + kvh * hd + i])
                            })
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for i in 0..hd {
                    out[t * q_dim + h * hd + i] = (0..=p)
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

    /// The single-token path as it was before [`weighted_sum`]: the group's scores by
    /// [`matmul`], scaled and softmaxed over the visible keys, then one `axpy` per visible
    /// key into a zeroed output row.
    impl AttnShape {
        fn new(heads: usize, kv_heads: usize, head_dim: usize, window: Option<usize>) -> Self {
            AttnShape {
                heads,
                kv_heads,
                head_dim,
                window,
                scale: 1.0 / (head_dim as f32).sqrt(),
            }
        }
    }

    fn decode_by_axpy(shape: AttnShape, q: &[f32], cache: &KvCache, pos: usize) -> Vec<f32> {
        let (hd, keys) = (shape.head_dim, pos + 1);
        let group = shape.heads / shape.kv_heads;
        let first = shape.first_key(pos);
        let scale = shape.scale;
        let pool = Pool::new(1).unwrap();
        let mut out = vec![0f32; q.len()];
        for g in 0..shape.kv_heads {
            let (k, v) = cache.head(1, g, keys);
            let km = Matrix::new(keys, hd, WeightData::F32(k)).unwrap();
            let mut scores = vec![0f32; group * keys];
            matmul(
                &km,
                &q[g * group * hd..(g + 1) * group * hd],
                group,
                &mut scores,
                &pool,
            );
            let rows = out[g * group * hd..(g + 1) * group * hd].chunks_exact_mut(hd);
            for (o, row) in rows.zip(scores.chunks_exact_mut(keys)) {
                let visible = &mut row[first..];
                visible.iter_mut().for_each(|x| *x *= scale);
                softmax_inplace(visible);
                for (j, &p) in (first..keys).zip(visible.iter()) {
                    kiln_kernels::axpy(p, &v[j * hd..(j + 1) * hd], o);
                }
            }
        }
        out
    }

    #[test]
    fn decode_has_the_bits_of_the_axpy_loop() {
        // Groups of 1 to 4 rows, widths with and without vector tails, windows.
        for (heads, kv_heads, hd, window, pos) in [
            (9, 3, 64, None, 0),
            (9, 3, 64, None, 200),
            (8, 2, 64, Some(16), 100),
            (4, 4, 8, None, 37),
            (6, 2, 20, Some(5), 3),
            (5, 1, 36, None, 70),
        ] {
            let shape = AttnShape::new(heads, kv_heads, hd, window);
            let kv_dim = kv_heads * hd;
            let q = data(heads * hd, 4);
            let (k, v) = (data((pos + 1) * kv_dim, 5), data((pos + 1) * kv_dim, 6));
            let mut cache = KvCache::new(2, pos + 1, kv_heads, hd);
            cache.write(1, 0, &k, &v);
            cache.set_len(pos + 1);
            let pool = Pool::new(2).unwrap();
            let mut out = vec![0f32; q.len()];
            attention(
                shape,
                &q,
                &cache,
                1,
                pos,
                &mut out,
                &mut AttnScratch::default(),
                &pool,
            );
            let want = decode_by_axpy(shape, &q, &cache, pos);
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&out), bits(&want), "{shape:?} pos {pos}");
        }
    }

    #[test]
    fn matches_naive_attention_across_shapes_windows_and_threads() {
        for (heads, kv_heads, hd, window, pos0, n) in [
            (4, 2, 16, None, 0, 7),
            (4, 4, 8, None, 5, 1),
            (6, 2, 4, Some(3), 0, 9),
            (2, 1, 16, Some(4), 6, 5),
            (8, 2, 32, None, 30, 80),
            (8, 2, 64, None, 5000, 1),
        ] {
            let shape = AttnShape::new(heads, kv_heads, hd, window);
            let kv_dim = kv_heads * hd;
            let q = data(n * heads * hd, 1);
            let k = data((pos0 + n) * kv_dim, 2);
            let v = data((pos0 + n) * kv_dim, 3);
            let want = naive(shape, &q, &k, &v, pos0);
            let mut cache = KvCache::new(2, pos0 + n + 3, kv_heads, hd);
            cache.write(1, 0, &k, &v);
            cache.set_len(pos0 + n);
            for threads in [1, 3] {
                let pool = Pool::new(threads).unwrap();
                let mut out = vec![0f32; q.len()];
                let mut scratch = AttnScratch::default();
                attention(shape, &q, &cache, 1, pos0, &mut out, &mut scratch, &pool);
                let err = out
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(
                    err < 1e-5,
                    "{shape:?} pos0 {pos0} n {n} threads {threads}: {err}"
                );
            }
        }
    }
}
