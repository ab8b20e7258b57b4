//! The key/value cache: every layer's rotated keys and values for every position so far.
//!
//! Allocated once for the whole context window; generation never reallocates. Rewinding (to
//! reuse a shared prefix between chat turns) only moves the length: positions past it are
//! overwritten by the next forward pass.

/// Keys and values of `layers` layers for up to `ctx` positions.
///
/// Head-major, so that one key/value head's rows `0..len` are one contiguous `(len, head_dim)`
/// matrix that attention can hand to `matmul`.
#[derive(Debug)]
pub struct KvCache {
    layers: usize,
    ctx: usize,
    kv_heads: usize,
    head_dim: usize,
    /// `(layers, kv_heads, ctx, head_dim)`, keys after rope.
    k: Vec<f32>,
    /// `(layers, kv_heads, ctx, head_dim)`
    v: Vec<f32>,
    /// Positions filled.
    len: usize,
}

impl KvCache {
    /// Allocate (zeroed) for `ctx` positions.
    pub fn new(layers: usize, ctx: usize, kv_heads: usize, head_dim: usize) -> KvCache {
        let n = layers * kv_heads * ctx * head_dim;
        KvCache {
            layers,
            ctx,
            kv_heads,
            head_dim,
            k: vec![0.0; n],
            v: vec![0.0; n],
            len: 0,
        }
    }

    /// Capacity in positions.
    pub fn ctx(&self) -> usize {
        self.ctx
    }

    /// Positions filled.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is filled.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forget every position from `len` on.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Mark positions below `len` as filled (after a forward pass wrote them).
    pub(crate) fn set_len(&mut self, len: usize) {
        assert!(
            len <= self.ctx,
            "kv cache length {len} exceeds its capacity {}",
            self.ctx
        );
        self.len = len;
    }

    /// Bytes allocated.
    pub fn bytes(&self) -> usize {
        (self.k.len() + self.v.len()) * std::mem::size_of::<f32>()
    }

    /// Element range of positions `from..to` of one head of one layer.
    fn range(&self, layer: usize, head: usize, from: usize, to: usize) -> std::ops::Range<usize> {
        assert!(layer < self.layers && head < self.kv_heads && from <= to && to <= self.ctx);
        let base = (layer * self.kv_heads + head) * self.ctx * self.head_dim;
        base + from * self.head_dim..base + to * self.head_dim
    }

    /// Store `n` positions of keys and values (`(n, kv_heads*head_dim)` each, as the
    /// projections produce them) at `pos..pos+n` of `layer`.
    pub fn write(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let (hd, kv_dim) = (self.head_dim, self.kv_heads * self.head_dim);
        debug_assert_eq!(k.len(), v.len());
        for (t, (kt, vt)) in k
            .chunks_exact(kv_dim)
            .zip(v.chunks_exact(kv_dim))
            .enumerate()
        {
            for h in 0..self.kv_heads {
                let r = self.range(layer, h, pos + t, pos + t + 1);
                self.k[r.clone()].copy_from_slice(&kt[h * hd..(h + 1) * hd]);
                self.v[r].copy_from_slice(&vt[h * hd..(h + 1) * hd]);
            }
        }
    }

    /// Keys and values of positions `0..to` of one head of `layer`, `(to, head_dim)` each.
    pub fn head(&self, layer: usize, head: usize, to: usize) -> (&[f32], &[f32]) {
        let r = self.range(layer, head, 0, to);
        (&self.k[r.clone()], &self.v[r])
    }
}
