//! The key/value cache: every layer's rotated keys and values for the positions attention can
//! still read.
//!
//! Allocated once for the whole context window; generation never reallocates. Rewinding (to
//! reuse a shared prefix between chat turns) only moves the length: positions past it are
//! overwritten by the next forward pass.
//!
//! A sliding-window layer (Mistral, Gemma 3's local layers) never reads a key more than
//! `window - 1` positions behind its query, so its keys and values live in a ring of
//! `window - 1 + batch` positions instead of the whole context: position `p` is stored in slot
//! `p mod capacity`, and a forward pass hands such a layer at most `batch` new tokens at a time
//! ([`KvCache::batch_limit`]), so that writing them never overwrites a key one of them still
//! reads. Gemma 3 270M at a 32k context keeps 15 of its 18 layers in rings of 1,023 positions
//! instead of 32,768 (this is what llama.cpp's SWA cache does too). The price is in rewinding:
//! a ring has forgotten old positions, so [`KvCache::truncate`] keeps only what is still whole
//! and says how much that is. [`SlidingCache::Full`] keeps every position of every layer.
//!
//! The cache is stored in one of three [`CacheType`]s. At long contexts it is the largest thing
//! a decode step reads besides the weights (a Llama-3.2-1B-shaped model at 4096 tokens holds
//! 128 MiB of f16 keys and values, which every token's attention reads once), so its encoding
//! sets the cost of depth: f16 (the default in `kiln-run`, as in llama.cpp) halves what f32
//! reads, Q8_0 (GGML's blocks, 34 bytes per 32 values) nearly halves it again. f32 keeps the
//! projections' values exactly, which is what verification against a reference compares.

use std::fmt;
use std::str::FromStr;

use half::f16;
use kiln_kernels::{quantize_row_q8_0_act, BlockQ8_0, Matrix, WeightData, QK};

use crate::error::{Result, RunnerError};

/// How the cache stores keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CacheType {
    /// f32: the values the projections produced, exactly.
    F32,
    /// f16 (round to nearest even): half the bytes of f32, about 3 significant digits.
    #[default]
    F16,
    /// Q8_0: blocks of 32 values along a head with one f16 scale (GGML's rule, as llama.cpp's
    /// `--cache-type-k q8_0`); the head width must be a multiple of 32.
    Q8_0,
}

impl CacheType {
    /// Every type, in the order the help text lists them.
    pub const ALL: [CacheType; 3] = [CacheType::F32, CacheType::F16, CacheType::Q8_0];

    /// The name `--cache-type` takes.
    pub fn name(self) -> &'static str {
        match self {
            CacheType::F32 => "f32",
            CacheType::F16 => "f16",
            CacheType::Q8_0 => "q8_0",
        }
    }

    /// Bytes for `values` values (a whole number of blocks for Q8_0).
    pub fn bytes(self, values: usize) -> usize {
        match self {
            CacheType::F32 => values * 4,
            CacheType::F16 => values * 2,
            CacheType::Q8_0 => values / QK * std::mem::size_of::<BlockQ8_0>(),
        }
    }
}

impl fmt::Display for CacheType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CacheType {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        CacheType::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| format!("unknown cache type {s:?}: expected one of f32, f16, q8_0"))
    }
}

/// `len` zeroed values in pages mapped from the kernel rather than taken from the allocator.
///
/// A fresh anonymous mapping is zero pages that cost nothing until written, and unmapping
/// returns them at once. The allocator gives neither guarantee once a cache-sized block has
/// been freed (glibc then serves the next one from its heap and zeroes all of it, and keeps
/// freed blocks): a server that creates and drops sequences would hold every cache whole.
/// With pages of its own, a sequence costs what its positions have written, as long as it
/// lives, which is what the prompt cache charges for it.
#[derive(Debug)]
struct Pages<T> {
    map: memmap2::MmapMut,
    len: usize,
    _values: std::marker::PhantomData<T>,
}

impl<T: bytemuck::Pod> Pages<T> {
    /// `None` when the system refuses the mapping.
    fn zeroed(len: usize) -> Option<Pages<T>> {
        let bytes = len.checked_mul(std::mem::size_of::<T>())?;
        // A mapping cannot be empty; a page-aligned start suits every value type here.
        let map = memmap2::MmapMut::map_anon(bytes.max(1)).ok()?;
        // Where transparent huge pages are always on, one written position would fault in a
        // 2 MiB page; with base pages the memory held is what [`KvCache::resident_bytes`]
        // counts. A refusal (a kernel without THP) changes nothing.
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::NoHugePage);
        Some(Pages {
            map,
            len,
            _values: std::marker::PhantomData,
        })
    }

    fn get(&self) -> &[T] {
        bytemuck::cast_slice(&self.map[..self.len * std::mem::size_of::<T>()])
    }

    fn get_mut(&mut self) -> &mut [T] {
        bytemuck::cast_slice_mut(&mut self.map[..self.len * std::mem::size_of::<T>()])
    }
}

/// The size of the pages the system maps memory in: what a written value costs at least.
/// Linux says in the auxiliary vector (`AT_PAGESZ`); where it cannot be read, 64 KiB, the
/// largest base page in use, so that memory is never undercounted.
fn page_size() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| read_page_size().unwrap_or(64 << 10))
}

#[cfg(target_os = "linux")]
fn read_page_size() -> Option<usize> {
    /// `AT_PAGESZ`, the auxiliary vector's key for the page size.
    const AT_PAGESZ: usize = 6;
    const WORD: usize = std::mem::size_of::<usize>();
    let auxv = std::fs::read("/proc/self/auxv").ok()?;
    auxv.chunks_exact(2 * WORD).find_map(|entry| {
        let word = |b: &[u8]| b.try_into().ok().map(usize::from_ne_bytes);
        let (key, value) = (word(&entry[..WORD])?, word(&entry[WORD..])?);
        (key == AT_PAGESZ && value.is_power_of_two()).then_some(value)
    })
}

/// Apple silicon's 16 KiB pages, the largest of the other systems Kiln runs on.
#[cfg(not(target_os = "linux"))]
fn read_page_size() -> Option<usize> {
    Some(16 << 10)
}

/// One stored tensor (all keys, or all values), `(layers, kv_heads, ctx, head_dim)`.
#[derive(Debug)]
enum Store {
    F32(Pages<f32>),
    F16(Pages<f16>),
    /// `head_dim / 32` blocks per position.
    Q8_0(Pages<BlockQ8_0>),
}

impl Store {
    /// Zeroed pages that are touched only as positions are written: a 4096-token cache costs
    /// memory as it fills, not up front, and gives it back when dropped. `None` when the
    /// system refuses.
    fn new(ty: CacheType, values: usize) -> Option<Store> {
        Some(match ty {
            CacheType::F32 => Store::F32(Pages::zeroed(values)?),
            CacheType::F16 => Store::F16(Pages::zeroed(values)?),
            CacheType::Q8_0 => Store::Q8_0(Pages::zeroed(values / QK)?),
        })
    }

    /// Store `src` at value offset `at` (a whole number of blocks for Q8_0).
    fn put(&mut self, at: usize, src: &[f32]) {
        match self {
            Store::F32(d) => d.get_mut()[at..at + src.len()].copy_from_slice(src),
            Store::F16(d) => {
                for (o, &x) in d.get_mut()[at..at + src.len()].iter_mut().zip(src) {
                    *o = f16::from_f32(x);
                }
            }
            Store::Q8_0(d) => {
                quantize_row_q8_0_act(src, &mut d.get_mut()[at / QK..(at + src.len()) / QK])
            }
        }
    }

    /// The values `range` (whole blocks for Q8_0).
    fn rows(&self, range: std::ops::Range<usize>) -> KvRows<'_> {
        match self {
            Store::F32(d) => KvRows::F32(&d.get()[range]),
            Store::F16(d) => KvRows::F16(&d.get()[range]),
            Store::Q8_0(d) => KvRows::Q8_0(&d.get()[range.start / QK..range.end / QK]),
        }
    }
}

/// Consecutive positions of one key/value head, `(positions, head_dim)`, in the cache's type.
#[derive(Debug, Clone, Copy)]
pub enum KvRows<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// f16 values.
    F16(&'a [f16]),
    /// Q8_0 blocks, `head_dim / 32` per position.
    Q8_0(&'a [BlockQ8_0]),
}

impl<'a> KvRows<'a> {
    /// Values (not blocks) held.
    fn values(&self) -> usize {
        match self {
            KvRows::F32(d) => d.len(),
            KvRows::F16(d) => d.len(),
            KvRows::Q8_0(d) => d.len() * QK,
        }
    }

    /// Positions `from..to` of rows `width` wide.
    pub fn slice(&self, from: usize, to: usize, width: usize) -> KvRows<'a> {
        let r = from * width..to * width;
        match *self {
            KvRows::F32(d) => KvRows::F32(&d[r]),
            KvRows::F16(d) => KvRows::F16(&d[r]),
            KvRows::Q8_0(d) => KvRows::Q8_0(&d[r.start / QK..r.end / QK]),
        }
    }

    /// The rows as a matrix of `width` columns, for [`kiln_kernels::matmul`] (a Q8_0 matrix
    /// is multiplied by Q8_0-quantized activations, as llama.cpp multiplies a Q8_0 cache).
    pub fn matrix(&self, width: usize) -> Matrix<'a> {
        let rows = self.values() / width;
        let data = match *self {
            KvRows::F32(d) => WeightData::F32(d),
            KvRows::F16(d) => WeightData::F16(d),
            KvRows::Q8_0(d) => WeightData::Q8_0(d),
        };
        Matrix::new(rows, width, data).expect("cache rows are whole rows of the head width")
    }

    /// The values as f32 into `out` (`out.len()` values).
    pub fn to_f32(&self, out: &mut [f32]) {
        assert_eq!(out.len(), self.values(), "kv rows: output length");
        match *self {
            KvRows::F32(d) => out.copy_from_slice(d),
            KvRows::F16(d) => {
                for (o, x) in out.iter_mut().zip(d) {
                    *o = x.to_f32();
                }
            }
            KvRows::Q8_0(d) => {
                for (o, b) in out.chunks_exact_mut(QK).zip(d) {
                    let s = b.d.to_f32();
                    for (o, &q) in o.iter_mut().zip(&b.qs) {
                        *o = s * f32::from(q);
                    }
                }
            }
        }
    }
}

/// How a session keeps the keys and values of sliding-window layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlidingCache {
    /// A ring of `window - 1 + batch` positions per sliding layer (when that is less than the
    /// context): a forward pass feeds such a layer `batch` tokens at a time.
    Ring {
        /// New tokens a sliding layer takes per step.
        batch: usize,
    },
    /// Every position, as full-attention layers keep them: any rewind keeps its whole prefix
    /// (`kiln-run --swa-full`).
    Full,
}

/// Tokens a ring takes per step by default: the prefill batch of `kiln-run`
/// ([`crate::generate::DEFAULT_PREFILL_BATCH`]), so that a prompt's batches are never cut again, and a
/// benchmark's 512-token batch at a depth can always be rewound.
pub const DEFAULT_RING_BATCH: usize = 512;

impl Default for SlidingCache {
    fn default() -> Self {
        SlidingCache::Ring {
            batch: DEFAULT_RING_BATCH,
        }
    }
}

/// Keys and values of `layers` layers for up to `ctx` positions.
///
/// Head-major, so that one key/value head's stored rows are one contiguous `(capacity,
/// head_dim)` matrix that attention can hand to `matmul` a block of positions at a time.
#[derive(Debug)]
pub struct KvCache {
    ctx: usize,
    kv_heads: usize,
    head_dim: usize,
    ty: CacheType,
    /// Per layer: positions held (`ctx`, or a ring's capacity), and the window of a ring.
    layers: Vec<LayerSlots>,
    /// `(kv_heads, capacity, head_dim)` per layer, one after the other: keys after rope.
    k: Store,
    /// The same for values.
    v: Store,
    /// Positions filled.
    len: usize,
    /// One past the highest position written since the cache was last emptied: a ring's
    /// slots hold every position from `written - capacity` on (rewinding does not lower it).
    written: usize,
}

/// Where one layer's rows are.
#[derive(Debug, Clone, Copy)]
struct LayerSlots {
    /// Value offset of the layer's first head.
    base: usize,
    /// Positions stored: `ctx`, or `window - 1 + batch` for a ring.
    capacity: usize,
    /// The window, for a ring.
    ring_window: Option<usize>,
}

/// Where each layer's rows go, and the values every layer holds together: a layer with a
/// window keeps a ring of `window - 1 + batch` positions where [`SlidingCache::Ring`] says so
/// and that is less than `ctx`, every other layer `ctx` positions. `None` when the count, in
/// f32 keys and values, passes memory's address range.
fn layout(
    windows: &[Option<usize>],
    sliding: SlidingCache,
    ctx: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Option<(Vec<LayerSlots>, usize)> {
    let mut layers = Vec::with_capacity(windows.len());
    let mut n = 0usize;
    for &window in windows {
        let ring = match (window, sliding) {
            (Some(w), SlidingCache::Ring { batch }) => (w.max(1) - 1)
                .checked_add(batch.max(1))
                .filter(|&cap| cap < ctx)
                .map(|cap| (cap, w.max(1))),
            _ => None,
        };
        let capacity = ring.map_or(ctx, |(cap, _)| cap);
        layers.push(LayerSlots {
            base: n,
            capacity,
            ring_window: ring.map(|(_, w)| w),
        });
        n = [kv_heads, capacity, head_dim]
            .into_iter()
            .try_fold(1usize, usize::checked_mul)
            .and_then(|layer| n.checked_add(layer))?;
    }
    // Keys and values at f32's 4 bytes, the widest type: so that `bytes` cannot overflow.
    if n.checked_mul(8).is_none_or(|b| b > isize::MAX as usize) {
        return None;
    }
    Some((layers, n))
}

impl KvCache {
    /// Allocate (zeroed) `layers` layers of `ctx` positions each. A Q8_0 cache needs a head
    /// width that is a multiple of 32; the size must fit in memory's address range.
    pub fn new(
        layers: usize,
        ctx: usize,
        kv_heads: usize,
        head_dim: usize,
        ty: CacheType,
    ) -> Result<KvCache> {
        KvCache::with_windows(
            &vec![None; layers],
            SlidingCache::Full,
            ctx,
            kv_heads,
            head_dim,
            ty,
        )
    }

    /// Allocate (zeroed) one layer per entry of `windows` (a layer's sliding window, if its
    /// attention has one), sliding layers kept as `sliding` says.
    pub fn with_windows(
        windows: &[Option<usize>],
        sliding: SlidingCache,
        ctx: usize,
        kv_heads: usize,
        head_dim: usize,
        ty: CacheType,
    ) -> Result<KvCache> {
        if ty == CacheType::Q8_0 && !head_dim.is_multiple_of(QK) {
            return Err(RunnerError::InvalidArgument {
                arg: "--cache-type",
                reason: format!(
                    "a q8_0 cache stores blocks of {QK} values along a head, and this model's \
                     heads are {head_dim} wide: use f16 or f32"
                ),
            });
        }
        let (layers, n) = layout(windows, sliding, ctx, kv_heads, head_dim).ok_or_else(|| {
            RunnerError::InvalidArgument {
                arg: "--ctx",
                reason: format!("a KV cache of {ctx} positions does not fit in memory"),
            }
        })?;
        let refused = || RunnerError::InvalidArgument {
            arg: "--ctx",
            reason: format!(
                "cannot allocate {} MiB for a {ty} KV cache of {ctx} positions: lower --ctx or \
                 use a smaller --cache-type",
                (2 * ty.bytes(n)) >> 20
            ),
        };
        Ok(KvCache {
            ctx,
            kv_heads,
            head_dim,
            ty,
            layers,
            k: Store::new(ty, n).ok_or_else(refused)?,
            v: Store::new(ty, n).ok_or_else(refused)?,
            len: 0,
            written: 0,
        })
    }

    /// Bytes the keys and values of a cache [`KvCache::with_windows`] would make hold once
    /// every position is written, without making it: what a context costs, checked before
    /// anything is built for it. `None` past memory's address range.
    pub fn bytes_needed(
        windows: &[Option<usize>],
        sliding: SlidingCache,
        ctx: usize,
        kv_heads: usize,
        head_dim: usize,
        ty: CacheType,
    ) -> Option<usize> {
        let (_, n) = layout(windows, sliding, ctx, kv_heads, head_dim)?;
        Some(2 * ty.bytes(n))
    }

    /// How keys and values are stored.
    pub fn cache_type(&self) -> CacheType {
        self.ty
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

    /// Positions `layer` stores: the context, or its ring's capacity.
    pub fn capacity(&self, layer: usize) -> usize {
        self.layers[layer].capacity
    }

    /// The most new tokens `layer` may be given in one step: a ring's capacity less the keys
    /// its first query still reads (`window - 1`); unlimited for a layer that keeps every
    /// position.
    pub fn batch_limit(&self, layer: usize) -> usize {
        let s = &self.layers[layer];
        s.ring_window.map_or(usize::MAX, |w| s.capacity + 1 - w)
    }

    /// Forget every position from `len` on, and return how many are kept: `len` (or the
    /// current length, if less), or 0 when a ring no longer holds a key that position `len`
    /// would read (it was overwritten by a later position), and the prefix must be run again.
    pub fn truncate(&mut self, len: usize) -> usize {
        let len = len.min(self.len);
        let whole = self.layers.iter().all(|s| match s.ring_window {
            // The next query, at `len`, reads keys from `len + 1 - w`; slots hold every
            // position from `written - capacity` on.
            Some(w) => (len + 1).saturating_sub(w) + s.capacity >= self.written,
            None => true,
        });
        self.len = if whole { len } else { 0 };
        if self.len == 0 {
            self.written = 0;
        }
        self.len
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
        let values: usize = self
            .layers
            .iter()
            .map(|s| self.kv_heads * s.capacity * self.head_dim)
            .sum();
        2 * self.ty.bytes(values)
    }

    /// Bytes the first `len` positions occupy (a ring holds at most its capacity): what the
    /// cache costs in memory once `len` tokens are in it, since pages are touched only as
    /// positions are written.
    pub fn bytes_for(&self, len: usize) -> usize {
        let values: usize = self
            .layers
            .iter()
            .map(|s| self.kv_heads * s.capacity.min(len) * self.head_dim)
            .sum();
        2 * self.ty.bytes(values)
    }

    /// Bytes of memory the first `len` positions hold once written: the pages their keys and
    /// values touch (each head's rows are contiguous, so a head holding a few positions still
    /// holds whole pages), and the cache's own bookkeeping. At least [`KvCache::bytes_for`];
    /// what a server keeping this cache for reuse really spends on it.
    pub fn resident_bytes(&self, len: usize) -> usize {
        let page = page_size();
        // Rows in address order: layer by layer, head by head. A page two heads share is
        // counted once.
        let (mut pages, mut counted_to) = (0usize, 0usize);
        for s in &self.layers {
            let rows = s.capacity.min(len) * self.head_dim;
            if rows == 0 {
                continue;
            }
            for h in 0..self.kv_heads {
                let start = self.ty.bytes(s.base + h * s.capacity * self.head_dim);
                let end = start + self.ty.bytes(rows);
                let (first, last) = ((start / page).max(counted_to), end.div_ceil(page));
                if last > first {
                    pages += last - first;
                    counted_to = last;
                }
            }
        }
        let books = std::mem::size_of::<KvCache>()
            + self.layers.capacity() * std::mem::size_of::<LayerSlots>();
        2 * pages * page + books
    }

    /// Value range of stored rows (slots) `from..to` of one head of one layer.
    fn range(&self, layer: usize, head: usize, from: usize, to: usize) -> std::ops::Range<usize> {
        let s = &self.layers[layer];
        assert!(head < self.kv_heads && from <= to && to <= s.capacity);
        let base = s.base + head * s.capacity * self.head_dim;
        base + from * self.head_dim..base + to * self.head_dim
    }

    /// Store `n` positions of keys and values (`(n, kv_heads*head_dim)` each, as the
    /// projections produce them) at `pos..pos+n` of `layer`, converted to the cache's type.
    /// A ring layer takes at most [`KvCache::batch_limit`] positions at a time.
    pub fn write(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let (hd, kv_dim) = (self.head_dim, self.kv_heads * self.head_dim);
        debug_assert_eq!(k.len(), v.len());
        let n = k.len() / kv_dim;
        assert!(
            n <= self.batch_limit(layer) && pos + n <= self.ctx,
            "kv cache: {n} positions at {pos} do not fit layer {layer}"
        );
        let cap = self.layers[layer].capacity;
        for (t, (kt, vt)) in k
            .chunks_exact(kv_dim)
            .zip(v.chunks_exact(kv_dim))
            .enumerate()
        {
            let slot = (pos + t) % cap;
            for h in 0..self.kv_heads {
                let at = self.range(layer, h, slot, slot + 1).start;
                self.k.put(at, &kt[h * hd..(h + 1) * hd]);
                self.v.put(at, &vt[h * hd..(h + 1) * hd]);
            }
        }
        self.written = self.written.max(pos + n);
    }

    /// Keys and values of every slot of one head of `layer`, `(capacity, head_dim)` each:
    /// position `p` is row `p mod capacity` ([`KvCache::capacity`]).
    pub fn head(&self, layer: usize, head: usize) -> (KvRows<'_>, KvRows<'_>) {
        let r = self.range(layer, head, 0, self.layers[layer].capacity);
        (self.k.rows(r.clone()), self.v.rows(r))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_type_round_trips_within_its_precision() {
        let (layers, ctx, heads, hd) = (2, 5, 2, 64);
        let k: Vec<f32> = (0..3 * heads * hd)
            .map(|i| (i as f32 * 0.37).sin())
            .collect();
        let v: Vec<f32> = k.iter().map(|x| -2.0 * x).collect();
        for (ty, tol) in [
            (CacheType::F32, 0.0),
            (CacheType::F16, 1e-3),
            (CacheType::Q8_0, 2.0 / 127.0),
        ] {
            let mut c = KvCache::new(layers, ctx, heads, hd, ty).unwrap();
            c.write(1, 2, &k, &v);
            assert_eq!(c.bytes(), 2 * ty.bytes(layers * ctx * heads * hd));
            for h in 0..heads {
                let (kr, vr) = c.head(1, h);
                let (mut kf, mut vf) = (vec![0.0; 5 * hd], vec![0.0; 5 * hd]);
                kr.to_f32(&mut kf);
                vr.to_f32(&mut vf);
                assert!(kf[..2 * hd].iter().all(|&x| x == 0.0));
                for t in 0..3 {
                    for i in 0..hd {
                        let (want_k, want_v) = (
                            k[t * heads * hd + h * hd + i],
                            v[t * heads * hd + h * hd + i],
                        );
                        let (got_k, got_v) = (kf[(2 + t) * hd + i], vf[(2 + t) * hd + i]);
                        assert!((got_k - want_k).abs() <= tol, "{ty} k {got_k} vs {want_k}");
                        assert!(
                            (got_v - want_v).abs() <= 2.0 * tol,
                            "{ty} v {got_v} vs {want_v}"
                        );
                    }
                }
            }
        }
    }

    /// A sliding layer gets a ring only when it is smaller than the context; the ring's
    /// capacity, step and bytes follow; writes land at `position mod capacity`.
    #[test]
    fn rings_only_where_they_save_and_wrap_at_their_capacity() {
        let windows = [Some(4), None, Some(100), Some(1)];
        let ring = SlidingCache::Ring { batch: 8 };
        let c = KvCache::with_windows(&windows, ring, 50, 2, 8, CacheType::F32).unwrap();
        let caps: Vec<_> = (0..4).map(|l| c.capacity(l)).collect();
        assert_eq!(caps, [11, 50, 50, 8]);
        let limits: Vec<_> = (0..4).map(|l| c.batch_limit(l)).collect();
        assert_eq!(limits, [8, usize::MAX, usize::MAX, 8]);
        assert_eq!(c.bytes(), 2 * 4 * 2 * 8 * (11 + 50 + 50 + 8));
        let full =
            KvCache::with_windows(&windows, SlidingCache::Full, 50, 2, 8, CacheType::F32).unwrap();
        assert!((0..4).all(|l| full.capacity(l) == 50));

        let mut c = KvCache::with_windows(&[Some(4)], ring, 50, 1, 8, CacheType::F32).unwrap();
        for p in 0..30 {
            let k = vec![p as f32; 8];
            c.write(0, p, &k, &k);
        }
        c.set_len(30);
        let (k, _) = c.head(0, 0);
        let mut f = vec![0f32; 11 * 8];
        k.to_f32(&mut f);
        // Slot s holds the last position ≡ s (mod 11) below 30.
        for s in 0..11 {
            let want = if s < 8 { 22 + s } else { 11 + s };
            assert_eq!(f[s * 8], want as f32, "slot {s}");
        }
        // Position 29 reads keys 26..=28, all held; position 21 would read 18..=20, gone.
        assert_eq!(c.truncate(29), 29);
        assert_eq!(c.truncate(40), 29, "never grows");
        assert_eq!(c.truncate(21), 0);
        assert!(c.is_empty());
    }

    #[test]
    fn q8_0_needs_heads_of_whole_blocks() {
        let err = KvCache::new(1, 4, 1, 24, CacheType::Q8_0).unwrap_err();
        assert!(err.to_string().contains("24 wide"), "{err}");
        assert!(KvCache::new(1, 4, 1, 24, CacheType::F16).is_ok());
    }

    #[test]
    fn an_absurd_context_is_an_error_not_an_overflow() {
        for ty in CacheType::ALL {
            let err = KvCache::new(32, usize::MAX / 16, 8, 128, ty).unwrap_err();
            assert!(err.to_string().contains("does not fit"), "{err}");
            let windows = [None; 32];
            let need =
                KvCache::bytes_needed(&windows, SlidingCache::Full, usize::MAX / 16, 8, 128, ty);
            assert_eq!(need, None);
        }
    }

    /// What a context is checked for before it is built is what building it allocates.
    #[test]
    fn bytes_needed_are_the_bytes_allocated() {
        let windows = [None, Some(8), None, Some(8)];
        for ty in CacheType::ALL {
            for sliding in [SlidingCache::Full, SlidingCache::default()] {
                let c = KvCache::with_windows(&windows, sliding, 1000, 2, 32, ty).unwrap();
                let need = KvCache::bytes_needed(&windows, sliding, 1000, 2, 32, ty);
                assert_eq!(need, Some(c.bytes()), "{ty} {sliding:?}");
            }
        }
    }

    #[test]
    fn names_parse_back() {
        for t in CacheType::ALL {
            assert_eq!(t.name().parse::<CacheType>(), Ok(t));
        }
        assert_eq!("Q8_0".parse::<CacheType>(), Ok(CacheType::Q8_0));
        assert!("q4_0"
            .parse::<CacheType>()
            .unwrap_err()
            .contains("f32, f16, q8_0"));
    }
}
