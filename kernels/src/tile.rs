//! The tile kernels' types: the shapes every tier's matrix kernels share ([`Tile`]: four rows
//! against one or a few tokens, and a sixteen-row one-token kernel), and the activations
//! prepared for a tier's pair kernel ([`Prepared`]).

use kiln_format::BlockQ8_0;

/// Output rows computed together by one tile kernel call (they share the activation loads).
pub const TILE_ROWS: usize = 4;

/// A tile kernel: `TILE_ROWS` weight rows against `xs.len()` activation rows, writing
/// `out[t][r]`. Checks that the token count is one it was built for and that lengths agree.
pub(crate) type TileFn<W, X> = fn(&[&[W]; TILE_ROWS], &[&[X]], &mut [[f32; TILE_ROWS]]);

/// One activation block pair prepared once per product for a tier's pair kernel (AVX-512:
/// the 64 codes, their offset correction and the two scales, as three 512-bit vectors), so
/// that the tile kernels, which meet every token once per four weight rows, only load it.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct PreparedPair(pub(crate) [u8; 192]);

impl PreparedPair {
    pub(crate) const ZERO: PreparedPair = PreparedPair([0; 192]);
}

/// Prepare one token's Q8_0 row: `out.len() == x.len().div_ceil(2)`.
pub(crate) type PrepareFn = fn(&[BlockQ8_0], &mut [PreparedPair]);

/// A block-weight encoding's kernels over prepared activations: the preparation, and the
/// one-token and multi-token tiles (same token count as the plain ones, same bits).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Prepared<W: 'static> {
    pub(crate) prepare: PrepareFn,
    pub(crate) tile: Tile<W, PreparedPair>,
}

/// Rows a [`RowsFn`] computes per call: a parallel task's rows ([`crate::ROW_CHUNK`]).
pub(crate) const WIDE_ROWS: usize = 4 * TILE_ROWS;

/// A matrix–vector kernel over `WIDE_ROWS` consecutive weight rows (`w`, each
/// `w.len() / WIDE_ROWS` long) and one activation row, writing `out[r]`. It gives the one-token
/// tile's bits; it exists to pay one call, one reduction and one store per sixteen rows
/// instead of per four, which matters on the short rows of small models.
pub(crate) type RowsFn<W, X> = fn(&[W], &[X], &mut [f32; WIDE_ROWS]);

/// The most activation bytes one call of a [`RowsManyFn`] takes: every row reloads every
/// token's activations, so they must stay in L1. Past it the four-row tiles, which load each
/// activation vector once per four rows, are faster (Llama-3.2-1B shape F16, eight tokens of
/// 2048 and 8192 columns: 29 tok/s through this kernel against 44 through the tiles; SmolLM2's
/// 576 columns, eight tokens in 18 KiB: 1.5× the tiles).
pub(crate) const ROWS_MANY_X_BYTES: usize = 24 * 1024;

/// [`RowsFn`] for several tokens at once (`xs.len()` of them, at most the [`Tile`]'s
/// `rows_tokens`), writing `out[t][r]`: each weight vector is loaded and widened once for all
/// of them, and each (row, token) gets the bits [`RowsFn`] gives that token alone. This is
/// what lets a few tokens (a speculative check, a server's batch) cost little more than one.
pub(crate) type RowsManyFn<W, X> = fn(&[W], &[&[X]], &mut [[f32; WIDE_ROWS]]);

/// One weight encoding's tile kernels: one token, and `tokens` tokens at once (the
/// register-blocked kernel for prefill), and where the tier has one, the sixteen-row
/// one-token kernel. All give the same bits for a (row, token) pair.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tile<W: 'static, X: 'static> {
    pub(crate) one: TileFn<W, X>,
    pub(crate) tokens: usize,
    pub(crate) many: TileFn<W, X>,
    pub(crate) rows: Option<RowsFn<W, X>>,
    /// The sixteen-row kernel for several tokens, and the most it takes per call.
    pub(crate) rows_many: Option<RowsManyFn<W, X>>,
    pub(crate) rows_tokens: usize,
}

impl<W, X> Tile<W, X> {
    pub(crate) const fn new(one: TileFn<W, X>, tokens: usize, many: TileFn<W, X>) -> Self {
        Tile {
            one,
            tokens,
            many,
            rows: None,
            rows_many: None,
            rows_tokens: 1,
        }
    }

    /// The same tiles with a sixteen-row one-token kernel (the x86 tiers have them; NEON's
    /// tiles are one dot per row, with no reduction or hand-over to save).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) const fn with_rows(self, rows: RowsFn<W, X>) -> Self {
        Tile {
            rows: Some(rows),
            ..self
        }
    }

    /// Tokens per call of the several-token sixteen-row kernel for activation rows of `xl`
    /// elements: as many as keep the call's activations within [`ROWS_MANY_X_BYTES`], at
    /// most its own count; 0 (use the four-row tiles) where that is fewer than two, or where
    /// the tier has no such kernel.
    pub(crate) fn rows_many_tokens(&self, xl: usize) -> usize {
        if self.rows_many.is_none() {
            return 0;
        }
        let fit = ROWS_MANY_X_BYTES / (xl * std::mem::size_of::<X>()).max(1);
        match fit.min(self.rows_tokens) {
            0 | 1 => 0,
            t => t,
        }
    }

    /// The same tiles with a sixteen-row kernel for up to `tokens` tokens per call.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) const fn with_rows_many(self, many: RowsManyFn<W, X>, tokens: usize) -> Self {
        Tile {
            rows_many: Some(many),
            rows_tokens: tokens,
            ..self
        }
    }
}
