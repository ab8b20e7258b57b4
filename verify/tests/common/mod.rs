//! Helpers shared by kiln-verify's integration tests.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::SafeTensors;

/// Rewrite the safetensors file `src` as `dst`, with `edit` applied to every tensor's name,
/// shape and bytes (a reference dump with a value poisoned or a batch dimension added).
pub fn rewrite_safetensors(
    src: &Path,
    dst: &Path,
    mut edit: impl FnMut(&str, &mut Vec<usize>, &mut Vec<u8>),
) {
    let bytes = std::fs::read(src).unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let data: HashMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            let (mut shape, mut data) = (v.shape().to_vec(), v.data().to_vec());
            edit(&n, &mut shape, &mut data);
            (n, (v.dtype(), shape, data))
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = data
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let out = safetensors::tensor::serialize(views, header.metadata().clone()).unwrap();
    std::fs::write(dst, out).unwrap();
}
