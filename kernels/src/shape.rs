//! The argument checks every tier's entry points share, so the kernels behind them may read
//! the ranges they check unchecked.

use kiln_format::DType;

/// Check the lengths of a [`Kernels::weighted_sum`] call: `v` and `out` are whole rows of
/// `width` values, and every row's probabilities
/// (`probs[r·stride..r·stride + keys]`) lie inside `probs`. Every tier's entry point calls
/// this first, so the kernels may read those ranges unchecked.
pub(crate) fn weighted_sum_shape<T>(
    probs: &[f32],
    stride: usize,
    v: &[T],
    width: usize,
    out: &[f32],
) {
    assert!(width > 0, "weighted_sum: zero width");
    assert!(
        v.len().is_multiple_of(width),
        "weighted_sum: v is not a whole number of rows of the width"
    );
    assert!(
        out.len().is_multiple_of(width),
        "weighted_sum: out is not a whole number of rows of the width"
    );
    let (rows, keys) = (out.len() / width, v.len() / width);
    let needed = match rows {
        0 => Some(0),
        _ => (rows - 1)
            .checked_mul(stride)
            .and_then(|n| n.checked_add(keys)),
    };
    assert!(
        needed.is_some_and(|n| n <= probs.len()),
        "weighted_sum: probs too short for {rows} rows of {keys} keys at stride {stride}"
    );
}

/// Check the arguments of a [`Kernels::quantize_blocks`] call: a block type of one row (its
/// row of the block-type table says) and whole blocks. Every tier's entry point calls this
/// first.
pub(crate) fn quantize_blocks_shape(dtype: DType, x: &[f32]) {
    let kind = dtype.block();
    assert!(
        dtype.is_quantized() && kind.rows == 1,
        "quantize_blocks: {dtype} is not a block type of one row"
    );
    assert!(
        x.len().is_multiple_of(kind.weights),
        "quantize_blocks: {} values are not whole blocks of {}",
        x.len(),
        kind.weights
    );
}
