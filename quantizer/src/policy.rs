//! Which dtype each tensor gets: the quantization policy.
//!
//! The default policy, decided from the tensor's canonical role ([`TensorName::parse`]):
//!
//! 1. **Weight matrices** — the attention and MLP projections, the token embedding
//!    (`embed.weight`) and the output matrix (`lm_head.weight`) — get the `--to` dtype.
//! 2. **Vectors** — norms, biases, every other 1-D tensor — are stored as F32 (a lossless
//!    widening from F16/BF16): they are tiny and the forward pass is sensitive to them.
//! 3. **Rows that do not fit the blocks** (the last dimension is not a multiple of the block:
//!    32, or 256 for the K-quants and IQ4_XS) fall back as llama.cpp's do ([`fallback`]):
//!    Q2_K/Q3_K → Q4_0, Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0, IQ4_XS → IQ4_NL, and a 32-value
//!    type that still does not fit → F16. The report says so.
//! 4. **Names that are not canonical** are copied unchanged, with a note: the quantizer does not
//!    guess what an unknown tensor is.
//!
//! Overrides: `--keep PATTERN=DTYPE` (repeatable) sets the dtype of every tensor whose canonical
//! name matches `PATTERN`, where `*` matches any run of characters (`layers.*.mlp.down.weight`,
//! `*.attn.v.weight`). `DTYPE` is one of `f32`, `f16`, `bf16`, `q8_0`, `q4_0`, `q5_0`, `q5_1`,
//! `q4_k`, `q5_k`, `q6_k`, or `copy` (keep the stored bytes unchanged). When several patterns match, the **last** flag wins; a pattern
//! that matches nothing is an error (it is almost always a typo). Rule 3 still applies to an
//! override to a block type.
//!
//! Mixes: `--to q4_k_m` (or any of [`Mix::ALL`]) replaces rule 1 with llama.cpp's tensor rules
//! for that mix ([`Mix`]): Q6_K for the output matrix, more bits for some `attn.v`, `mlp.down`
//! and `attn.o` matrices, the base type elsewhere; rule 3 then applies as in llama.cpp.
//!
//! Tied embeddings: when the file has no `lm_head.weight`, `embed.weight` doubles as the output
//! matrix, so it also answers to the name `lm_head.weight` in patterns
//! (`--keep lm_head.weight=q8_0` keeps the output side of a tied model in Q8_0).
//!
//! Input that is already block-quantized is refused unless its decision is to stay in that dtype
//! (unchanged bytes): re-quantizing a quantized tensor compounds the error. A `q4_0x16` input
//! counts as Q4_0 here ([`DType::logical`]): it holds the same blocks in another order.
//!
//! Storage: a decision names the dtype of the values ([`Decision::dtype`], what reports and
//! provenance speak of) and, apart, how the output stores them ([`Decision::storage`]): a
//! converted Q4_0 matrix of whole sixteen-row groups is written as `q4_0x16`
//! ([`DType::storage_for`]), because that is the layout the runner's one-token product reads;
//! a copied tensor keeps the input's own dtype, since its bytes are written unchanged.

use std::collections::BTreeMap;

use kiln_format::{DType, Role, TensorInfo, TensorName, QK_K};

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
                    .ok_or_else(|| {
                        bad(format!(
                            "unknown dtype `{dtype}`; use f32, f16, bf16, q8_0, q4_0, q5_0, \
                             q5_1, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl, iq4_xs or copy"
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

/// llama.cpp's mixes (`llama-quantize … Q4_K_M`, `Q3_K_S`, `IQ4_XS`, …): a base type for most
/// matrices and more bits where llama.cpp's `llama_tensor_get_type` spends them. One row per
/// mix: its name, base type, and the types it gives `attn.v`, `mlp.down` and `attn.o`
/// ([`Mix::attn_v`], [`Mix::mlp_down`], [`Mix::attn_o`]).
///
/// The rules common to every mix, for a model without experts (what Kiln runs):
///
/// - the output matrix (`lm_head.weight`, or a tied `embed.weight`): Q6_K, or Q8_0 when its
///   rows are not a multiple of 256;
/// - every other matrix (an untied `embed.weight` included) without a rule of its mix: the base
///   type;
/// - then the fallbacks of [`fallback`] for rows that do not fit the blocks.
///
/// The per-mix rules depend on a layer's rank among the file's `attn.v` (or `mlp.down`)
/// matrices, on the grouped-query factor (query heads per key/value head, from the `attn.q`
/// and `attn.k` shapes) and, for IQ4_NL/IQ4_XS, on whether the quantization has importance
/// (`--calibrate`, llama.cpp's `--imatrix`). llama.cpp's rules for fused `attn_qkv` matrices,
/// Falcon, 70B-type models and experts do not apply: Kiln stores q, k and v apart and runs none
/// of those.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mix {
    /// `Q2_K`: base Q2_K; `attn.v` Q3_K (Q4_K from a grouped-query factor of 4), `mlp.down` and
    /// `attn.o` Q3_K.
    Q2K,
    /// `Q3_K_S`: Q3_K throughout.
    Q3KS,
    /// `Q3_K_M`: base Q3_K; `attn.v` Q5_K in the first two layers, else Q4_K; `mlp.down` Q5_K
    /// in the first sixteenth, else Q4_K; `attn.o` Q4_K.
    Q3KM,
    /// `Q3_K_L`: base Q3_K; `attn.v`, `mlp.down` and `attn.o` Q5_K.
    Q3KL,
    /// `Q4_K_S`: base Q4_K; `attn.v` Q5_K in the first four layers, `mlp.down` in the first
    /// eighth.
    Q4KS,
    /// `Q4_K_M`: base Q4_K; `attn.v` and `mlp.down` Q6_K where [`use_more_bits`] holds.
    Q4KM,
    /// `Q5_K_S`: Q5_K throughout.
    Q5KS,
    /// `Q5_K_M`: base Q5_K; `attn.v` and `mlp.down` Q6_K where [`use_more_bits`] holds.
    Q5KM,
    /// `IQ4_NL`: base IQ4_NL; `attn.v` Q5_K from a grouped-query factor of 4; without
    /// importance, `mlp.down` Q5_K in the first eighth.
    IQ4NL,
    /// `IQ4_XS`: as `IQ4_NL` with base IQ4_XS.
    IQ4XS,
}

impl Mix {
    /// Every mix.
    pub const ALL: [Mix; 10] = [
        Mix::Q2K,
        Mix::Q3KS,
        Mix::Q3KM,
        Mix::Q3KL,
        Mix::Q4KS,
        Mix::Q4KM,
        Mix::Q5KS,
        Mix::Q5KM,
        Mix::IQ4NL,
        Mix::IQ4XS,
    ];

    /// The `--to` name (llama-quantize's, lower case).
    pub const fn name(self) -> &'static str {
        match self {
            Mix::Q2K => "q2_k_mix",
            Mix::Q3KS => "q3_k_s",
            Mix::Q3KM => "q3_k_m",
            Mix::Q3KL => "q3_k_l",
            Mix::Q4KS => "q4_k_s",
            Mix::Q4KM => "q4_k_m",
            Mix::Q5KS => "q5_k_s",
            Mix::Q5KM => "q5_k_m",
            Mix::IQ4NL => "iq4_nl_mix",
            Mix::IQ4XS => "iq4_xs_mix",
        }
    }

    /// Parse a `--to` name (case-insensitive).
    pub fn parse(s: &str) -> Option<Mix> {
        Mix::ALL
            .into_iter()
            .find(|m| m.name().eq_ignore_ascii_case(s))
    }

    /// The dtype of the matrices that get no more bits.
    pub const fn base(self) -> DType {
        match self {
            Mix::Q2K => DType::Q2_K,
            Mix::Q3KS | Mix::Q3KM | Mix::Q3KL => DType::Q3_K,
            Mix::Q4KS | Mix::Q4KM => DType::Q4_K,
            Mix::Q5KS | Mix::Q5KM => DType::Q5_K,
            Mix::IQ4NL => DType::IQ4_NL,
            Mix::IQ4XS => DType::IQ4_XS,
        }
    }

    /// llama.cpp's type for the `attn.v` matrix of rank `i` of `n`, with `gqa` query heads
    /// per key/value head; `None` for the base type.
    pub fn attn_v(self, i: u32, n: u32, gqa: u64) -> Option<DType> {
        match self {
            Mix::Q2K if gqa >= 4 => Some(DType::Q4_K),
            Mix::Q2K => Some(DType::Q3_K),
            Mix::Q3KM if i < 2 => Some(DType::Q5_K),
            Mix::Q3KM => Some(DType::Q4_K),
            Mix::Q3KL => Some(DType::Q5_K),
            Mix::IQ4NL | Mix::IQ4XS if gqa >= 4 => Some(DType::Q5_K),
            Mix::Q4KM | Mix::Q5KM if use_more_bits(i, n) => Some(DType::Q6_K),
            Mix::Q4KS if i < 4 => Some(DType::Q5_K),
            _ => None,
        }
    }

    /// llama.cpp's type for the `mlp.down` matrix of layer rank `i` of `n`; `importance`: the
    /// quantization weighs by importance (llama.cpp's `has_imatrix`). `None` for the base.
    pub fn mlp_down(self, i: u32, n: u32, importance: bool) -> Option<DType> {
        match self {
            Mix::Q2K => Some(DType::Q3_K),
            Mix::Q3KM if i < n / 16 => Some(DType::Q5_K),
            Mix::Q3KM => Some(DType::Q4_K),
            Mix::Q3KL => Some(DType::Q5_K),
            Mix::Q4KM | Mix::Q5KM if use_more_bits(i, n) => Some(DType::Q6_K),
            Mix::IQ4NL | Mix::IQ4XS if i < n / 8 && !importance => Some(DType::Q5_K),
            Mix::Q4KS if i < n / 8 => Some(DType::Q5_K),
            _ => None,
        }
    }

    /// llama.cpp's type for every `attn.o` matrix; `None` for the base.
    pub const fn attn_o(self) -> Option<DType> {
        match self {
            Mix::Q2K => Some(DType::Q3_K),
            Mix::Q3KM => Some(DType::Q4_K),
            Mix::Q3KL => Some(DType::Q5_K),
            _ => None,
        }
    }
}

/// llama.cpp's `use_more_bits(i, n)`: the first and last eighth of the layers, and every third
/// layer between them. `i` is the tensor's rank among its kind in layer order, `n` their count.
pub const fn use_more_bits(i: u32, n: u32) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// llama.cpp's `tensor_type_fallback` for rows of `row` values: a 256-value type whose
/// super-blocks do not fit the rows becomes the 32-value type llama.cpp uses instead (Q2_K and
/// Q3_K → Q4_0, Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0, IQ4_XS → IQ4_NL), and a block type that
/// still does not fit becomes F16.
/// `None` when `dtype` fits as it is.
pub fn fallback(dtype: DType, row: u64) -> Option<DType> {
    let fits = |d: DType| row.is_multiple_of(d.block_len() as u64);
    if !dtype.is_quantized() || fits(dtype) {
        return None;
    }
    let next = match dtype {
        DType::Q4_K => DType::Q5_0,
        DType::Q5_K => DType::Q5_1,
        DType::Q6_K => DType::Q8_0,
        DType::Q2_K | DType::Q3_K => DType::Q4_0,
        DType::IQ4_XS => DType::IQ4_NL,
        d => d,
    };
    Some(if fits(next) { next } else { DType::F16 })
}

/// The policy: a default target for matrices (or a [`Mix`]) plus ordered overrides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Dtype of weight matrices (F16, Q8_0, Q4_0, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K); a mix's
    /// base type.
    pub to: DType,
    /// The llama.cpp mix, if `--to` named one.
    pub mix: Option<Mix>,
    /// `--keep` flags in command-line order (the last match wins).
    pub overrides: Vec<Override>,
    /// The quantization weighs by importance (`--calibrate`, `--importance`): llama.cpp's
    /// `has_imatrix`, which some mixes' rules read.
    pub importance: bool,
    /// `--to auto`: the size budget's choices, tensor name → (dtype, why), consulted after the
    /// `--keep` flags and before the default rule (see [`crate::budget`]).
    pub planned: BTreeMap<String, (DType, String)>,
    /// `--to auto` named this policy (its matrices' types come from [`Policy::planned`]).
    pub auto: bool,
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
pub const POLICY_DESCRIPTION: &str = "kiln-quantize policy v3: weight matrices (attention/MLP \
    projections, embed.weight, lm_head.weight) -> --to, or the rules of llama.cpp's mix \
    (Q2_K, Q3_K_S/M/L, Q4_K_S/M, Q5_K_S/M, IQ4_NL, IQ4_XS: output q6_k, or q8_0 for rows not a \
    multiple of 256; attn.v, mlp.down and attn.o per mix); 1-D tensors (norms, biases) -> f32; \
    rows that do not fit the blocks fall back as llama.cpp's do (q2_k, q3_k -> q4_0, q4_k -> \
    q5_0, q5_k -> q5_1, q6_k -> q8_0, iq4_xs -> iq4_nl, then f16); non-canonical names copied; \
    --keep overrides, last match wins; a tied embed.weight also answers to lm_head.weight";

/// The dtypes `--to` and `Policy::new` accept.
pub const TARGETS: [DType; 12] = [
    DType::F16,
    DType::Q8_0,
    DType::Q4_0,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q2_K,
    DType::Q3_K,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
    DType::IQ4_NL,
    DType::IQ4_XS,
];

impl Policy {
    /// A policy; `to` must be one of [`TARGETS`].
    pub fn new(to: DType, overrides: Vec<Override>) -> Result<Policy> {
        if !TARGETS.contains(&to) {
            return Err(QuantizeError::BadTarget {
                dtype: to.name().into(),
            });
        }
        Ok(Policy {
            to,
            mix: None,
            overrides,
            importance: false,
            planned: BTreeMap::new(),
            auto: false,
        })
    }

    /// `--to auto`: the matrices' types come from a size budget's plan
    /// ([`crate::budget::Plan::apply`]); until then (and for a matrix the plan leaves out) they
    /// get Q8_0.
    pub fn auto(overrides: Vec<Override>) -> Policy {
        Policy {
            auto: true,
            ..Policy::new(DType::Q8_0, overrides).expect("q8_0 is a target")
        }
    }

    /// A policy following llama.cpp's `mix`.
    pub fn mix(mix: Mix, overrides: Vec<Override>) -> Policy {
        Policy {
            to: mix.base(),
            mix: Some(mix),
            overrides,
            importance: false,
            planned: BTreeMap::new(),
            auto: false,
        }
    }

    /// The same policy for a quantization that weighs by importance or not.
    pub fn with_importance(self, importance: bool) -> Policy {
        Policy { importance, ..self }
    }

    /// What `--to` named: the mix (`q4_k_m`) or the dtype.
    pub fn target_name(&self) -> &'static str {
        if self.auto {
            return "auto";
        }
        self.mix.map_or(self.to.name(), Mix::name)
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
        let ctx = FileContext::new(tensors);
        tensors
            .iter()
            .map(|t| self.decide_in(file, t, &ctx))
            .collect()
    }

    /// Decide one tensor. `tied`: the file has `embed.weight` but no `lm_head.weight`.
    ///
    /// Under a [`Mix`], a matrix's dtype also depends on its layer's rank among the file's
    /// layers ([`use_more_bits`]): this decides it as if it were the only tensor of its kind;
    /// [`Policy::decide_all`] sees the whole file.
    pub fn decide(&self, file: &str, info: &TensorInfo, tied: bool) -> Result<Decision> {
        let ctx = FileContext {
            tied,
            ..FileContext::new(std::slice::from_ref(info))
        };
        self.decide_in(file, info, &ctx)
    }

    /// A mix's dtype for matrix `name` with rows of `row` values, and the rule's name.
    fn mix_dtype(
        &self,
        mix: Mix,
        name: TensorName,
        row: u64,
        ctx: &FileContext,
    ) -> (DType, String) {
        let rank = |layers: &[u32]| {
            let layer = name.layer.unwrap_or(0);
            layers.iter().position(|&l| l == layer).unwrap_or(0) as u32
        };
        let m = mix.name();
        let base = (mix.base(), format!("{m}: matrix"));
        match name.role {
            Role::LmHead | Role::Embed if name.role == Role::LmHead || ctx.tied => {
                if !row.is_multiple_of(QK_K as u64) {
                    (
                        DType::Q8_0,
                        format!("{m}: output, rows not a multiple of {QK_K}"),
                    )
                } else {
                    (DType::Q6_K, format!("{m}: output"))
                }
            }
            Role::AttnV => {
                let (i, n) = (rank(&ctx.v_layers), ctx.v_layers.len() as u32);
                match mix.attn_v(i, n, ctx.gqa) {
                    Some(d) => (
                        d,
                        format!("{m}: attn.v ({i} of {n}, {} q per kv head)", ctx.gqa),
                    ),
                    None => base,
                }
            }
            Role::MlpDown => {
                let (i, n) = (rank(&ctx.down_layers), ctx.n_layers);
                match mix.mlp_down(i, n, self.importance) {
                    Some(d) => (d, format!("{m}: mlp.down ({i} of {n})")),
                    None => base,
                }
            }
            Role::AttnO => match mix.attn_o() {
                Some(d) => (d, format!("{m}: attn.o")),
                None => base,
            },
            _ => base,
        }
    }

    fn decide_in(&self, file: &str, info: &TensorInfo, ctx: &FileContext) -> Result<Decision> {
        let tied = ctx.tied;
        let row = info.shape.last().copied().unwrap_or(1);
        let matched = self
            .overrides
            .iter()
            .rev()
            .find(|o| aliases(&info.name, tied).any(|n| glob_match(&o.pattern, n)));
        let planned = self.planned.get(&info.name);
        let (target, rule, mut note) = match (matched, planned) {
            (Some(o), _) => (o.target, format!("override {o}"), None),
            (None, Some((d, why))) => (Target::DType(*d), why.clone(), None),
            (None, None) => match TensorName::parse(&info.name) {
                Some(n) if n.role.is_matrix() && info.shape.len() >= 2 => match self.mix {
                    Some(mix) => {
                        let (d, rule) = self.mix_dtype(mix, n, row, ctx);
                        (Target::DType(d), rule, None)
                    }
                    None => {
                        let rule = if tied && n.role == Role::Embed {
                            "matrix (tied embedding/output)"
                        } else {
                            "matrix"
                        };
                        (Target::DType(self.to), rule.to_string(), None)
                    }
                },
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
        if dtype != from {
            if let Some(next) = fallback(dtype, row) {
                note = Some(format!(
                    "row length {row} is not a multiple of {}: {} falls back to {}",
                    dtype.block_len(),
                    dtype.name(),
                    next.name()
                ));
                dtype = next;
            }
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

/// What a decision needs to know about the whole file.
#[derive(Debug, Clone)]
struct FileContext {
    /// `embed.weight` doubles as the output matrix.
    tied: bool,
    /// Layers holding an `attn.v` matrix, ascending (llama.cpp counts them in layer order).
    v_layers: Vec<u32>,
    /// Layers holding an `mlp.down` matrix, ascending.
    down_layers: Vec<u32>,
    /// Layers in the model (one more than the largest layer index): llama.cpp's `n_layer`.
    n_layers: u32,
    /// Query heads per key/value head (`attn.q` rows over `attn.k` rows; 1 without them):
    /// llama.cpp's `n_gqa`.
    gqa: u64,
}

impl FileContext {
    fn new(tensors: &[TensorInfo]) -> FileContext {
        let mut v_layers = Vec::new();
        let mut down_layers = Vec::new();
        let mut n_layers = 0;
        let (mut q_rows, mut k_rows) = (0, 0);
        for t in tensors {
            if let Some(TensorName {
                layer: Some(l),
                role,
            }) = TensorName::parse(&t.name)
            {
                n_layers = n_layers.max(l + 1);
                match role {
                    Role::AttnV => v_layers.push(l),
                    Role::MlpDown => down_layers.push(l),
                    Role::AttnQ if q_rows == 0 => q_rows = t.shape.first().copied().unwrap_or(0),
                    Role::AttnK if k_rows == 0 => k_rows = t.shape.first().copied().unwrap_or(0),
                    _ => {}
                }
            }
        }
        v_layers.sort_unstable();
        down_layers.sort_unstable();
        FileContext {
            tied: is_tied(tensors),
            v_layers,
            down_layers,
            n_layers,
            gqa: q_rows.checked_div(k_rows).unwrap_or(1).max(1),
        }
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
        for want in ["q5_0", "q5_1", "q4_k", "q5_k", "q6_k"] {
            let o = Override::parse(&format!("x={want}")).unwrap();
            assert_eq!(o.target, Target::DType(DType::parse(want).unwrap()));
        }
        for bad in [
            "noequals",
            "=q8_0",
            "x=q4_k_m",
            "x=",
            "x=q4_0x16",
            "x=iq3_s",
        ] {
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
    fn use_more_bits_is_llama_cpp_s() {
        // SmolLM2's 30 layers: the first and last eighth (n/8 = 3, 7n/8 = 26) and every third
        // layer from 5.
        let more: Vec<u32> = (0..30).filter(|&i| use_more_bits(i, 30)).collect();
        assert_eq!(more, [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]);
        let more: Vec<u32> = (0..16).filter(|&i| use_more_bits(i, 16)).collect();
        assert_eq!(more, [0, 1, 4, 7, 10, 13, 14, 15]);
    }

    #[test]
    fn fallbacks_are_llama_cpp_s() {
        for (d, row, want) in [
            (DType::Q4_K, 576, Some(DType::Q5_0)),
            (DType::Q5_K, 576, Some(DType::Q5_1)),
            (DType::Q6_K, 576, Some(DType::Q8_0)),
            (DType::Q2_K, 576, Some(DType::Q4_0)),
            (DType::Q3_K, 576, Some(DType::Q4_0)),
            (DType::IQ4_XS, 576, Some(DType::IQ4_NL)),
            (DType::IQ4_XS, 48, Some(DType::F16)),
            (DType::IQ4_NL, 576, None),
            (DType::Q4_K, 1536, None),
            (DType::Q4_K, 48, Some(DType::F16)),
            (DType::Q5_0, 48, Some(DType::F16)),
            (DType::Q4_0, 49, Some(DType::F16)),
            (DType::Q8_0, 64, None),
            (DType::F16, 49, None),
        ] {
            assert_eq!(fallback(d, row), want, "{d} {row}");
        }
    }

    /// SmolLM2-135M's shapes: 30 layers, hidden 576 (not a multiple of 256), MLP 1536, tied.
    fn smollm2_like() -> Vec<TensorInfo> {
        let mut t = vec![info("embed.weight", DType::BF16, &[49152, 576])];
        for l in 0..30 {
            t.push(info(
                &format!("layers.{l}.attn_norm.weight"),
                DType::BF16,
                &[576],
            ));
            t.push(info(
                &format!("layers.{l}.attn.q.weight"),
                DType::BF16,
                &[576, 576],
            ));
            t.push(info(
                &format!("layers.{l}.attn.v.weight"),
                DType::BF16,
                &[192, 576],
            ));
            t.push(info(
                &format!("layers.{l}.mlp.down.weight"),
                DType::BF16,
                &[576, 1536],
            ));
            t.push(info(
                &format!("layers.{l}.mlp.up.weight"),
                DType::BF16,
                &[1536, 576],
            ));
        }
        t
    }

    #[test]
    fn q4_k_m_follows_llama_cpp_on_smollm2_shapes() {
        let tensors = smollm2_like();
        let d = Policy::mix(Mix::Q4KM, vec![])
            .decide_all("f", &tensors)
            .unwrap();
        let get = |name: &str| {
            let i = tensors.iter().position(|t| t.name == name).unwrap();
            d[i].dtype
        };
        // Tied output with rows of 576: Q8_0.
        assert_eq!(get("embed.weight"), DType::Q8_0);
        for l in 0..30 {
            let more = use_more_bits(l, 30);
            // Rows of 576: Q6_K falls back to Q8_0, Q4_K to Q5_0.
            let v = if more { DType::Q8_0 } else { DType::Q5_0 };
            assert_eq!(get(&format!("layers.{l}.attn.v.weight")), v, "v {l}");
            let down = if more { DType::Q6_K } else { DType::Q4_K };
            assert_eq!(
                get(&format!("layers.{l}.mlp.down.weight")),
                down,
                "down {l}"
            );
            assert_eq!(get(&format!("layers.{l}.attn.q.weight")), DType::Q5_0);
            assert_eq!(get(&format!("layers.{l}.mlp.up.weight")), DType::Q5_0);
            assert_eq!(get(&format!("layers.{l}.attn_norm.weight")), DType::F32);
        }
        let i = tensors
            .iter()
            .position(|t| t.name == "layers.0.attn.q.weight")
            .unwrap();
        assert!(d[i]
            .note
            .as_deref()
            .unwrap()
            .contains("q4_k falls back to q5_0"));
        // Q5_K_M: the same tensors get more bits; the base falls back to Q5_1.
        let d = Policy::mix(Mix::Q5KM, vec![])
            .decide_all("f", &tensors)
            .unwrap();
        let i = tensors
            .iter()
            .position(|t| t.name == "layers.3.mlp.down.weight")
            .unwrap();
        assert_eq!(d[i].dtype, DType::Q5_K);
        assert_eq!(d[i + 1].dtype, DType::Q5_1);
        // An override still wins, and falls back like llama.cpp's --tensor-type.
        let o = Override::parse("layers.*.mlp.down.weight=q5_k").unwrap();
        let d = Policy::mix(Mix::Q4KM, vec![o])
            .decide_all("f", &tensors)
            .unwrap();
        assert_eq!(d[i].dtype, DType::Q5_K);
    }

    /// A Llama-3.2-1B-shaped file (16 layers, 32 query heads over 8 key/value heads, every row
    /// a multiple of 256, tied embedding): no fallbacks, so each mix's own rules show.
    fn llama_1b_like() -> Vec<TensorInfo> {
        let mut t = vec![info("embed.weight", DType::BF16, &[128_256, 2048])];
        for l in 0..16 {
            for (m, shape) in [
                ("attn.q", [2048, 2048]),
                ("attn.k", [512, 2048]),
                ("attn.v", [512, 2048]),
                ("attn.o", [2048, 2048]),
                ("mlp.gate", [8192, 2048]),
                ("mlp.up", [8192, 2048]),
                ("mlp.down", [2048, 8192]),
            ] {
                t.push(info(&format!("layers.{l}.{m}.weight"), DType::BF16, &shape));
            }
        }
        t
    }

    #[test]
    fn every_mix_follows_llama_cpp_on_a_1b_shape() {
        use DType::*;
        let tensors = llama_1b_like();
        // Per mix, with and without importance: (attn.v of layer l, mlp.down of layer l,
        // attn.o, every other matrix).
        type Rule = fn(u32) -> DType;
        let cases: [(Mix, bool, Rule, Rule, DType, DType); 12] = [
            (Mix::Q2K, false, |_| Q4_K, |_| Q3_K, Q3_K, Q2_K),
            (Mix::Q3KS, false, |_| Q3_K, |_| Q3_K, Q3_K, Q3_K),
            (
                Mix::Q3KM,
                false,
                |l| if l < 2 { Q5_K } else { Q4_K },
                |l| if l < 1 { Q5_K } else { Q4_K },
                Q4_K,
                Q3_K,
            ),
            (Mix::Q3KL, false, |_| Q5_K, |_| Q5_K, Q5_K, Q3_K),
            (
                Mix::Q4KS,
                false,
                |l| if l < 4 { Q5_K } else { Q4_K },
                |l| if l < 2 { Q5_K } else { Q4_K },
                Q4_K,
                Q4_K,
            ),
            (
                Mix::Q4KM,
                false,
                |l| if use_more_bits(l, 16) { Q6_K } else { Q4_K },
                |l| if use_more_bits(l, 16) { Q6_K } else { Q4_K },
                Q4_K,
                Q4_K,
            ),
            (Mix::Q5KS, false, |_| Q5_K, |_| Q5_K, Q5_K, Q5_K),
            (
                Mix::Q5KM,
                false,
                |l| if use_more_bits(l, 16) { Q6_K } else { Q5_K },
                |l| if use_more_bits(l, 16) { Q6_K } else { Q5_K },
                Q5_K,
                Q5_K,
            ),
            (
                Mix::IQ4NL,
                false,
                |_| Q5_K,
                |l| if l < 2 { Q5_K } else { IQ4_NL },
                IQ4_NL,
                IQ4_NL,
            ),
            (
                Mix::IQ4XS,
                false,
                |_| Q5_K,
                |l| if l < 2 { Q5_K } else { IQ4_XS },
                IQ4_XS,
                IQ4_XS,
            ),
            // With importance (llama.cpp's imatrix), IQ4's first mlp.down layers stay IQ4.
            (Mix::IQ4NL, true, |_| Q5_K, |_| IQ4_NL, IQ4_NL, IQ4_NL),
            (Mix::IQ4XS, true, |_| Q5_K, |_| IQ4_XS, IQ4_XS, IQ4_XS),
        ];
        for (mix, importance, v, down, o, other) in cases {
            let d = Policy::mix(mix, vec![])
                .with_importance(importance)
                .decide_all("f", &tensors)
                .unwrap();
            let get = |name: &str| d[tensors.iter().position(|t| t.name == name).unwrap()].dtype;
            let m = mix.name();
            assert_eq!(get("embed.weight"), Q6_K, "{m}: tied output");
            for l in 0..16 {
                assert_eq!(get(&format!("layers.{l}.attn.v.weight")), v(l), "{m} v {l}");
                assert_eq!(
                    get(&format!("layers.{l}.mlp.down.weight")),
                    down(l),
                    "{m} down {l}"
                );
                assert_eq!(get(&format!("layers.{l}.attn.o.weight")), o, "{m} o {l}");
                for other_name in ["attn.q", "attn.k", "mlp.gate", "mlp.up"] {
                    assert_eq!(
                        get(&format!("layers.{l}.{other_name}.weight")),
                        other,
                        "{m}"
                    );
                }
            }
        }
        // Below a grouped-query factor of 4 (SmolLM2's 3), Q2_K's attn.v is Q3_K and IQ4's
        // is the base type.
        let d = Policy::mix(Mix::Q2K, vec![])
            .decide_all("f", &smollm2_like())
            .unwrap();
        let v = smollm2_like()
            .iter()
            .position(|t| t.name == "layers.5.attn.v.weight")
            .unwrap();
        // Rows of 576: Q3_K falls back to Q4_0.
        assert_eq!(d[v].dtype, Q4_0);
        assert!(d[v].rule.contains("attn.v"), "{}", d[v].rule);
    }

    #[test]
    fn mix_output_and_untied_embedding() {
        let tensors = [
            info("embed.weight", DType::F32, &[1000, 512]),
            info("lm_head.weight", DType::F32, &[1000, 512]),
            info("layers.0.attn.v.weight", DType::F32, &[128, 512]),
        ];
        let d = Policy::mix(Mix::Q4KM, vec![])
            .decide_all("f", &tensors)
            .unwrap();
        // Untied: the embedding is an ordinary matrix, the output gets Q6_K.
        assert_eq!(d[0].dtype, DType::Q4_K);
        assert_eq!(d[1].dtype, DType::Q6_K);
        // A single layer is both the first and the last eighth.
        assert_eq!(d[2].dtype, DType::Q6_K);
        // Tied: the embedding is the output.
        let d = Policy::mix(Mix::Q5KM, vec![])
            .decide_all("f", &tensors[..1])
            .unwrap();
        assert_eq!(d[0].dtype, DType::Q6_K);
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
