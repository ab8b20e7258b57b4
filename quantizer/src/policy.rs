//! Which dtype each tensor gets: the quantization policy.
//!
//! The default policy, decided from the tensor's canonical role ([`TensorName::parse`]):
//!
//! 1. **Weight matrices** — the attention and MLP projections, the token embedding
//!    (`embed.weight`) and the output matrix (`lm_head.weight`) — get the `--to` dtype.
//! 2. **Vectors** — norms, biases, every other 1-D tensor — are stored as F32 (a lossless
//!    widening from F16/BF16): they are tiny and the forward pass is sensitive to them.
//! 3. **Rows that do not fit the blocks**: when the target is Q8_0/Q4_0 and a row's length (the
//!    last dimension) is not a multiple of 32, the tensor falls back to F16 and the report says
//!    so.
//! 4. **Names that are not canonical** are copied unchanged, with a note: the quantizer does not
//!    guess what an unknown tensor is.
//!
//! Overrides: `--keep PATTERN=DTYPE` (repeatable) sets the dtype of every tensor whose canonical
//! name matches `PATTERN`, where `*` matches any run of characters (`layers.*.mlp.down.weight`,
//! `*.attn.v.weight`). `DTYPE` is one of `f32`, `f16`, `bf16`, `q8_0`, `q4_0`, or `copy` (keep
//! the stored bytes unchanged). When several patterns match, the **last** flag wins; a pattern
//! that matches nothing is an error (it is almost always a typo). Rule 3 still applies to an
//! override to a block type.
//!
//! Tied embeddings: when the file has no `lm_head.weight`, `embed.weight` doubles as the output
//! matrix, so it also answers to the name `lm_head.weight` in patterns
//! (`--keep lm_head.weight=q8_0` keeps the output side of a tied model in Q8_0).
//!
//! Input that is already Q8_0/Q4_0 is refused unless its decision is to stay in that dtype
//! (unchanged bytes): re-quantizing a quantized tensor compounds the error. A `q4_0x16` input
//! counts as Q4_0 here ([`DType::logical`]): it holds the same blocks in another order.
//!
//! Storage: a decision names the dtype of the values ([`Decision::dtype`], what reports and
//! provenance speak of) and, apart, how the output stores them ([`Decision::storage`]): a
//! converted Q4_0 matrix of whole sixteen-row groups is written as `q4_0x16`
//! ([`DType::storage_for`]), because that is the layout the runner's one-token product reads;
//! a copied tensor keeps the input's own dtype, since its bytes are written unchanged.

use kiln_format::{DType, Role, TensorInfo, TensorName, QK};

use crate::error::{QuantizeError, Result};

/// The dtype an override asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Convert or quantize to this dtype.
    DType(DType),
    /// Keep the stored bytes unchanged.
    Copy,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::DType(d) => d.name(),
            Target::Copy => "copy",
        }
    }
}

/// One `--keep PATTERN=DTYPE` flag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Override {
    /// Glob over canonical names; `*` matches any run of characters.
    pub pattern: String,
    /// What matching tensors become.
    pub target: Target,
}

impl Override {
    /// Parse `PATTERN=DTYPE`.
    pub fn parse(arg: &str) -> Result<Override> {
        let bad = |reason: String| QuantizeError::BadOverride {
            arg: arg.to_string(),
            reason,
        };
        let (pattern, dtype) = arg
            .rsplit_once('=')
            .ok_or_else(|| bad("expected PATTERN=DTYPE, e.g. lm_head.weight=q8_0".into()))?;
        if pattern.is_empty() {
            return Err(bad("the pattern is empty".into()));
        }
        let target = if dtype.eq_ignore_ascii_case("copy") {
            Target::Copy
        } else {
            // Storage layouts (q4_0x16) are not asked for: the writer picks them from the
            // shape, so only dtypes that are their own logical dtype name a target.
            Target::DType(
                DType::parse(dtype)
                    .filter(|d| d.logical() == *d)
                    .filter(|d| !d.is_quantized() || matches!(d, DType::Q8_0 | DType::Q4_0))
                    .ok_or_else(|| {
                        bad(format!(
                            "unknown dtype `{dtype}`; use f32, f16, bf16, q8_0, q4_0 or copy"
                        ))
                    })?,
            )
        };
        Ok(Override {
            pattern: pattern.to_string(),
            target,
        })
    }
}

impl std::fmt::Display for Override {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}", self.pattern, self.target.name())
    }
}

/// `*`-glob match over the whole string.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let p = pattern.as_bytes();
    let s = name.as_bytes();
    let (mut pi, mut si) = (0usize, 0usize);
    // Position of the last `*` and the string position it is currently matched up to.
    let mut star: Option<(usize, usize)> = None;
    while si < s.len() {
        if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, si));
            pi += 1;
        } else if pi < p.len() && p[pi] == s[si] {
            pi += 1;
            si += 1;
        } else if let Some((sp, ss)) = star {
            pi = sp + 1;
            si = ss + 1;
            star = Some((sp, ss + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

/// The policy: a default target for matrices plus ordered overrides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Dtype of weight matrices (F16, Q8_0 or Q4_0).
    pub to: DType,
    /// `--keep` flags in command-line order (the last match wins).
    pub overrides: Vec<Override>,
}

/// How a tensor is treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Stored bytes written unchanged.
    Copy,
    /// Decoded to f32 and converted or quantized.
    Convert,
}

/// The policy's decision for one tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// Output dtype of the values (never a storage layout such as `q4_0x16`): what the report
    /// and provenance name, and what blocks are quantized to.
    pub dtype: DType,
    /// The dtype the output file stores the tensor as: `dtype.storage_for(shape)` when
    /// converted (Q4_0 matrices of whole sixteen-row groups become `q4_0x16`), the input's own
    /// dtype when copied (the bytes are unchanged, so is their order).
    pub storage: DType,
    /// Copy or convert.
    pub action: Action,
    /// Which rule decided (`matrix`, `vector`, `override lm_head.weight=q8_0`, …).
    pub rule: String,
    /// A note for the report when the result differs from what was asked (F16 fallback,
    /// unknown name).
    pub note: Option<String>,
}

/// One-line description of the default policy, recorded in provenance.
pub const POLICY_DESCRIPTION: &str = "kiln-quantize policy v1: weight matrices (attention/MLP \
    projections, embed.weight, lm_head.weight) -> --to; 1-D tensors (norms, biases) -> f32; rows \
    not a multiple of 32 -> f16; non-canonical names copied; --keep overrides, last match wins; \
    a tied embed.weight also answers to lm_head.weight";

impl Policy {
    /// A policy; `to` must be F16, Q8_0 or Q4_0.
    pub fn new(to: DType, overrides: Vec<Override>) -> Result<Policy> {
        if !matches!(to, DType::F16 | DType::Q8_0 | DType::Q4_0) {
            return Err(QuantizeError::BadTarget {
                dtype: to.name().into(),
            });
        }
        Ok(Policy { to, overrides })
    }

    /// Check that every override matches at least one of `tensors`.
    pub fn check_overrides(&self, file: &str, tensors: &[TensorInfo]) -> Result<()> {
        let tied = is_tied(tensors);
        for o in &self.overrides {
            let hit = tensors
                .iter()
                .any(|t| aliases(&t.name, tied).any(|n| glob_match(&o.pattern, n)));
            if !hit {
                return Err(QuantizeError::UnmatchedOverride {
                    file: file.to_string(),
                    pattern: o.pattern.clone(),
                });
            }
        }
        Ok(())
    }

    /// Decide every tensor of a file, in file order.
    pub fn decide_all(&self, file: &str, tensors: &[TensorInfo]) -> Result<Vec<Decision>> {
        let tied = is_tied(tensors);
        tensors.iter().map(|t| self.decide(file, t, tied)).collect()
    }

    /// Decide one tensor. `tied`: the file has `embed.weight` but no `lm_head.weight`.
    pub fn decide(&self, file: &str, info: &TensorInfo, tied: bool) -> Result<Decision> {
        let matched = self
            .overrides
            .iter()
            .rev()
            .find(|o| aliases(&info.name, tied).any(|n| glob_match(&o.pattern, n)));
        let (target, rule, mut note) = match matched {
            Some(o) => (o.target, format!("override {o}"), None),
            None => match TensorName::parse(&info.name) {
                Some(n) if n.role.is_matrix() && info.shape.len() >= 2 => {
                    let rule = if tied && n.role == Role::Embed {
                        "matrix (tied embedding/output)"
                    } else {
                        "matrix"
                    };
                    (Target::DType(self.to), rule.to_string(), None)
                }
                Some(_) => (Target::DType(DType::F32), "vector".to_string(), None),
                None => (
                    Target::Copy,
                    "unknown name".to_string(),
                    Some("not a canonical tensor name: copied unchanged".to_string()),
                ),
            },
        };
        // A q4_0x16 input is Q4_0 for every comparison below.
        let from = info.dtype.logical();
        let mut dtype = match target {
            Target::Copy => from,
            Target::DType(d) => d,
        };
        let row = info.shape.last().copied().unwrap_or(1);
        if dtype.is_quantized() && row % QK as u64 != 0 && dtype != from {
            note = Some(format!(
                "row length {row} is not a multiple of {QK}: {} falls back to f16",
                dtype.name()
            ));
            dtype = DType::F16;
        }
        let action = if target == Target::Copy || (from.is_quantized() && dtype == from) {
            Action::Copy
        } else {
            Action::Convert
        };
        // This is also what keeps the pipeline from reading quantized bytes as row ranges
        // (a q4_0x16 tensor has no byte range per row): quantized input is only ever copied.
        if from.is_quantized() && action == Action::Convert {
            return Err(QuantizeError::AlreadyQuantized {
                file: file.to_string(),
                tensor: info.name.clone(),
                from,
                to: dtype,
            });
        }
        let storage = match action {
            Action::Copy => info.dtype,
            Action::Convert => dtype.storage_for(&info.shape),
        };
        Ok(Decision {
            dtype,
            storage,
            action,
            rule,
            note,
        })
    }
}

/// Whether `embed.weight` doubles as the output matrix.
pub fn is_tied(tensors: &[TensorInfo]) -> bool {
    let has = |n: &str| tensors.iter().any(|t| t.name == n);
    has(Role::Embed.suffix()) && !has(Role::LmHead.suffix())
}

/// The names a tensor answers to in patterns.
fn aliases(name: &str, tied: bool) -> impl Iterator<Item = &str> {
    let extra = (tied && name == Role::Embed.suffix()).then_some(Role::LmHead.suffix());
    std::iter::once(name).chain(extra)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &str, dtype: DType, shape: &[u64]) -> TensorInfo {
        TensorInfo {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            offset: 0,
            len: 0,
            sha256: [0; 32],
        }
    }

    #[test]
    fn glob_table() {
        for (p, s, want) in [
            ("*", "anything", true),
            ("embed.weight", "embed.weight", true),
            ("embed.weight", "embed.weights", false),
            ("layers.*.attn.q.weight", "layers.12.attn.q.weight", true),
            ("layers.*.attn.q.weight", "layers.12.attn.k.weight", false),
            ("*.weight", "layers.0.attn_norm.weight", true),
            ("*attn*", "layers.0.mlp.up.weight", false),
            ("*attn*", "layers.0.attn.o.weight", true),
            ("layers.1.*", "layers.10.attn.o.weight", false),
            ("layers.1*", "layers.10.attn.o.weight", true),
            ("a*b*c", "aXbYbZc", true),
            ("a*b*c", "aXbYbZ", false),
            ("", "", true),
            ("**", "x", true),
        ] {
            assert_eq!(glob_match(p, s), want, "{p} vs {s}");
        }
    }

    #[test]
    fn override_parsing() {
        let o = Override::parse("lm_head.weight=Q8_0").unwrap();
        assert_eq!(o.target, Target::DType(DType::Q8_0));
        assert_eq!(o.to_string(), "lm_head.weight=q8_0");
        assert_eq!(Override::parse("x=copy").unwrap().target, Target::Copy);
        for bad in ["noequals", "=q8_0", "x=q5_k", "x=", "x=q4_0x16"] {
            assert!(
                matches!(Override::parse(bad), Err(QuantizeError::BadOverride { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn default_policy_by_role() {
        let p = Policy::new(DType::Q4_0, vec![]).unwrap();
        let tensors = [
            info("embed.weight", DType::BF16, &[100, 64]),
            info("layers.0.attn.q.weight", DType::BF16, &[64, 64]),
            info("layers.0.attn_norm.weight", DType::BF16, &[64]),
            info("layers.0.attn.q.bias", DType::F32, &[64]),
            info("layers.0.mlp.down.weight", DType::BF16, &[64, 49]),
            info("rotary.inv_freq", DType::F32, &[32]),
        ];
        let d = p.decide_all("f", &tensors).unwrap();
        assert_eq!(d[0].dtype, DType::Q4_0);
        assert_eq!(d[0].rule, "matrix (tied embedding/output)");
        // 100 rows are not whole sixteen-row groups: stored plainly.
        assert_eq!(d[0].storage, DType::Q4_0);
        assert_eq!(d[1].dtype, DType::Q4_0);
        assert_eq!(d[1].storage, DType::Q4_0x16);
        assert_eq!(d[2].storage, DType::F32);
        assert_eq!(d[2].dtype, DType::F32);
        assert_eq!(d[3].dtype, DType::F32);
        assert_eq!(d[4].dtype, DType::F16);
        assert!(d[4].note.as_deref().unwrap().contains("row length 49"));
        assert_eq!(d[5].action, Action::Copy);
        assert_eq!(d[5].dtype, DType::F32);
    }

    #[test]
    fn last_override_wins_and_tied_embedding_answers_to_lm_head() {
        let overrides = [
            "*=q8_0",
            "lm_head.weight=f16",
            "layers.*.attn.q.weight=bf16",
        ]
        .iter()
        .map(|s| Override::parse(s).unwrap())
        .collect();
        let p = Policy::new(DType::Q4_0, overrides).unwrap();
        let tensors = [
            info("embed.weight", DType::BF16, &[100, 64]),
            info("layers.0.attn.q.weight", DType::BF16, &[64, 64]),
            info("layers.0.attn.k.weight", DType::BF16, &[64, 64]),
        ];
        let d = p.decide_all("f", &tensors).unwrap();
        assert_eq!(d[0].dtype, DType::F16);
        assert_eq!(d[1].dtype, DType::BF16);
        assert_eq!(d[2].dtype, DType::Q8_0);
        // Untied: embed.weight no longer answers to lm_head.weight.
        let mut untied = tensors.to_vec();
        untied.push(info("lm_head.weight", DType::BF16, &[100, 64]));
        let d = p.decide_all("f", &untied).unwrap();
        assert_eq!(d[0].dtype, DType::Q8_0);
        assert_eq!(d[3].dtype, DType::F16);
    }

    #[test]
    fn unmatched_override_is_an_error() {
        let p = Policy::new(DType::Q8_0, vec![Override::parse("lm_haed.*=f16").unwrap()]).unwrap();
        let tensors = [info("embed.weight", DType::BF16, &[100, 64])];
        assert!(matches!(
            p.check_overrides("f", &tensors),
            Err(QuantizeError::UnmatchedOverride { .. })
        ));
    }

    #[test]
    fn quantized_input_is_refused_unless_kept() {
        let t = info("layers.0.attn.q.weight", DType::Q4_0, &[64, 64]);
        let p = Policy::new(DType::Q8_0, vec![]).unwrap();
        assert!(matches!(
            p.decide("f", &t, false),
            Err(QuantizeError::AlreadyQuantized { .. })
        ));
        // Same target: unchanged bytes.
        let p = Policy::new(DType::Q4_0, vec![]).unwrap();
        assert_eq!(p.decide("f", &t, false).unwrap().action, Action::Copy);
        let p = Policy::new(DType::Q8_0, vec![Override::parse("*=copy").unwrap()]).unwrap();
        assert_eq!(p.decide("f", &t, false).unwrap().action, Action::Copy);
    }

    #[test]
    fn q4_0x16_input_counts_as_q4_0_and_keeps_its_storage_when_copied() {
        let t = info("layers.0.attn.q.weight", DType::Q4_0x16, &[64, 64]);
        let p = Policy::new(DType::Q4_0, vec![]).unwrap();
        let d = p.decide("f", &t, false).unwrap();
        assert_eq!(
            (d.dtype, d.storage, d.action),
            (DType::Q4_0, DType::Q4_0x16, Action::Copy)
        );
        let p = Policy::new(DType::Q8_0, vec![Override::parse("*=copy").unwrap()]).unwrap();
        let d = p.decide("f", &t, false).unwrap();
        assert_eq!(
            (d.dtype, d.storage, d.action),
            (DType::Q4_0, DType::Q4_0x16, Action::Copy)
        );
        // Re-quantizing is refused, and the error speaks of q4_0.
        let p = Policy::new(DType::Q8_0, vec![]).unwrap();
        assert!(matches!(
            p.decide("f", &t, false),
            Err(QuantizeError::AlreadyQuantized {
                from: DType::Q4_0,
                to: DType::Q8_0,
                ..
            })
        ));
        // A plain Q4_0 input of whole row groups is copied as it is, not rearranged.
        let t = info("layers.0.attn.q.weight", DType::Q4_0, &[64, 64]);
        let p = Policy::new(DType::Q4_0, vec![]).unwrap();
        let d = p.decide("f", &t, false).unwrap();
        assert_eq!((d.storage, d.action), (DType::Q4_0, Action::Copy));
    }

    #[test]
    fn bad_target() {
        for to in [DType::BF16, DType::Q4_0x16] {
            assert!(matches!(
                Policy::new(to, vec![]),
                Err(QuantizeError::BadTarget { .. })
            ));
        }
    }
}
