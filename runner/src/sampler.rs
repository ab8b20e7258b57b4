//! Choosing the next token from logits: greedy, or sampling with temperature, top-k, top-p and
//! min-p, after a repetition penalty over the last N tokens.
//!
//! The order follows transformers' logits processors: repetition penalty, temperature, top-k,
//! top-p, min-p, then a draw from the renormalized distribution. The random numbers come from
//! [`Rng`] (xoshiro256**, seeded through SplitMix64), so a seed reproduces a run exactly on every
//! machine.

use crate::error::{Result, RunnerError};

/// Sampling settings. `temperature == 0` means greedy.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerConfig {
    /// Softmax temperature; 0 picks the most likely token.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p` (1: all).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` × the most likely one (0: none).
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of recent tokens by this (1: off).
    pub repetition_penalty: f32,
    /// How many of the most recent tokens the penalties look at.
    pub repeat_last_n: usize,
    /// Subtracted from the logit of every token among the recent ones (OpenAI's
    /// `presence_penalty`, over the same window as llama.cpp; 0: off).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it occurs among the recent ones
    /// (OpenAI's `frequency_penalty`; 0: off).
    pub frequency_penalty: f32,
    /// RNG seed.
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    /// The defaults a model's `generation_config.json` (`gen`) sets, as transformers reads
    /// them: greedy unless `do_sample`, then its temperature, top-k, top-p and min-p (with
    /// transformers' defaults 1, 50, 1 and 0 for those it leaves out); its repetition penalty
    /// either way. Every front end starts from these, then applies its own settings.
    pub fn from_generation_config(gen: &serde_json::Value) -> SamplerConfig {
        let num = |k: &str| gen.get(k).and_then(serde_json::Value::as_f64);
        let do_sample = gen.get("do_sample").and_then(serde_json::Value::as_bool) == Some(true);
        let mut c = SamplerConfig {
            repetition_penalty: num("repetition_penalty").unwrap_or(1.0) as f32,
            ..SamplerConfig::default()
        };
        if do_sample {
            c.temperature = num("temperature").unwrap_or(1.0) as f32;
            c.top_k = num("top_k").unwrap_or(50.0) as usize;
            c.top_p = num("top_p").unwrap_or(1.0) as f32;
            c.min_p = num("min_p").unwrap_or(0.0) as f32;
        }
        c
    }

    /// Check every value's range.
    pub fn validate(&self) -> Result<()> {
        let bad = |arg, reason: String| Err(RunnerError::InvalidArgument { arg, reason });
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad(
                "--temp",
                format!("{} must be 0 (greedy) or positive", self.temperature),
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("--top-p", format!("{} must be in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("--min-p", format!("{} must be in [0, 1]", self.min_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad(
                "--repeat-penalty",
                format!("{} must be positive (1 is off)", self.repetition_penalty),
            );
        }
        for (arg, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(arg, format!("{v} must be in [-2, 2]"));
            }
        }
        Ok(())
    }

    /// Whether this is plain argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// xoshiro256** (Blackman & Vigna), seeded with SplitMix64.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// A generator whose whole sequence is fixed by `seed`.
    pub fn new(seed: u64) -> Rng {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            x ^ (x >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// A sampler: settings, RNG state and a reusable candidate buffer.
#[derive(Debug, Clone)]
pub struct Sampler {
    config: SamplerConfig,
    rng: Rng,
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    /// A sampler (call [`SamplerConfig::validate`] first for user input).
    pub fn new(config: SamplerConfig) -> Sampler {
        Sampler {
            rng: Rng::new(config.seed),
            config,
            candidates: Vec::new(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &SamplerConfig {
        &self.config
    }

    /// Pick the next token from `logits` given the tokens so far (`history`, for the penalty).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        if let Some(id) = self.distribution(logits, history) {
            return id;
        }
        let total: f64 = self.candidates.iter().map(|x| f64::from(x.1)).sum();
        self.draw(total, None)
    }

    /// Pick the next token where a guess (`draft`, from a draft model or a lookup) is to be
    /// checked: the result is `draft` exactly when it is accepted. Greedy: the most likely
    /// token, as [`Sampler::sample`]. Sampling: the speculative sampling rule for a guess made
    /// with certainty: accept it with its probability `p(draft)`, else draw from the other
    /// tokens renormalized, so each token comes out with its probability `p`, as from
    /// [`Sampler::sample`] (one more random number is used).
    pub fn sample_draft(&mut self, logits: &[f32], history: &[u32], draft: u32) -> u32 {
        if let Some(id) = self.distribution(logits, history) {
            return id;
        }
        let total: f64 = self.candidates.iter().map(|x| f64::from(x.1)).sum();
        let p = self
            .candidates
            .iter()
            .find(|x| x.0 == draft)
            .map_or(0.0, |x| f64::from(x.1));
        if p > 0.0 && self.rng.next_f64() * total < p {
            return draft;
        }
        if p >= total {
            // The guess was the only candidate: accepted with certainty above.
            return draft;
        }
        self.draw(total - p, Some(draft))
    }

    /// Draw from the candidates (their weights summing to `total`), leaving out `skip`.
    fn draw(&mut self, total: f64, skip: Option<u32>) -> u32 {
        let mut r = self.rng.next_f64() * total;
        let mut last = self.candidates[0].0;
        for &(id, p) in self.candidates.iter().filter(|x| Some(x.0) != skip) {
            r -= f64::from(p);
            last = id;
            if r < 0.0 {
                return id;
            }
        }
        last
    }

    /// The sampling distribution for `logits`: the chosen token when greedy, else `None`
    /// with the surviving candidates and their probabilities in `self.candidates`, most
    /// likely first.
    fn distribution(&mut self, logits: &[f32], history: &[u32]) -> Option<u32> {
        let c = &self.config;
        let penalized = c.repetition_penalty != 1.0 && c.repeat_last_n > 0;
        let recent = &history[history.len().saturating_sub(c.repeat_last_n)..];
        // Each recent token and how often it occurs, sorted by id.
        let mut counts: Vec<(u32, u32)> = Vec::new();
        let additive = c.presence_penalty != 0.0 || c.frequency_penalty != 0.0;
        if penalized || additive {
            let mut ids = recent.to_vec();
            ids.sort_unstable();
            for id in ids {
                match counts.last_mut() {
                    Some((last, n)) if *last == id => *n += 1,
                    _ => counts.push((id, 1)),
                }
            }
        }
        // RepetitionPenaltyLogitsProcessor: each distinct recent token once; then OpenAI's
        // presence and frequency penalties.
        let penalty = |id: u32, l: f32| {
            let Ok(i) = counts.binary_search_by_key(&id, |&(id, _)| id) else {
                return l;
            };
            let mut l = l;
            if penalized {
                l = if l > 0.0 {
                    l / c.repetition_penalty
                } else {
                    l * c.repetition_penalty
                };
            }
            if additive {
                l -= c.presence_penalty + c.frequency_penalty * counts[i].1 as f32;
            }
            l
        };
        if c.is_greedy() {
            return Some(argmax(
                logits
                    .iter()
                    .enumerate()
                    .map(|(i, &l)| penalty(i as u32, l)),
            ));
        }
        let cand = &mut self.candidates;
        cand.clear();
        cand.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| (i as u32, penalty(i as u32, l) / c.temperature)),
        );
        // Sort descending by logit; ties by id so the order is total and reproducible.
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if c.top_k > 0 && c.top_k < cand.len() {
            cand.select_nth_unstable_by(c.top_k - 1, by_logit);
            cand.truncate(c.top_k);
        }
        cand.sort_unstable_by(by_logit);
        // Softmax over the survivors.
        let max = cand[0].1;
        let mut sum = 0.0f64;
        for x in cand.iter_mut() {
            x.1 = (x.1 - max).exp();
            sum += f64::from(x.1);
        }
        for x in cand.iter_mut() {
            x.1 = (f64::from(x.1) / sum) as f32;
        }
        // TopPLogitsWarper: keep the most likely tokens until their mass reaches top_p
        // (always at least one).
        if c.top_p < 1.0 {
            let mut acc = 0.0f32;
            let keep = cand
                .iter()
                .position(|x| {
                    acc += x.1;
                    acc >= c.top_p
                })
                .map_or(cand.len(), |i| i + 1);
            cand.truncate(keep);
        }
        // MinPLogitsWarper: drop tokens below min_p × the top probability.
        if c.min_p > 0.0 {
            let floor = c.min_p * cand[0].1;
            let keep = cand.iter().take_while(|x| x.1 >= floor).count().max(1);
            cand.truncate(keep);
        }
        None
    }
}

/// Index of the largest value (the first one on ties, as `torch.argmax`).
pub fn argmax(values: impl IntoIterator<Item = f32>) -> u32 {
    let mut best = (0u32, f32::NEG_INFINITY);
    for (i, v) in values.into_iter().enumerate() {
        if v > best.1 {
            best = (i as u32, v);
        }
    }
    best.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(f: impl FnOnce(&mut SamplerConfig)) -> Sampler {
        let mut c = SamplerConfig {
            temperature: 1.0,
            seed: 42,
            ..Default::default()
        };
        f(&mut c);
        c.validate().unwrap();
        Sampler::new(c)
    }

    #[test]
    fn rng_is_reproducible_and_uniform_enough() {
        let mut a = Rng::new(7);
        let mut b = Rng::new(7);
        let xs: Vec<f64> = (0..10_000).map(|_| a.next_f64()).collect();
        let ys: Vec<f64> = (0..10_000).map(|_| b.next_f64()).collect();
        assert_eq!(xs, ys);
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        assert!((mean - 0.5).abs() < 0.01, "{mean}");
        assert!(xs.iter().all(|x| (0.0..1.0).contains(x)));
        assert_ne!(Rng::new(8).next_u64(), Rng::new(7).next_u64());
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplerConfig::default());
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0], &[]), 1);
    }

    #[test]
    fn repetition_penalty_can_change_the_greedy_choice() {
        let mut s = Sampler::new(SamplerConfig {
            repetition_penalty: 2.0,
            ..Default::default()
        });
        assert_eq!(s.sample(&[1.0, 3.0, 2.0], &[1]), 2);
        // Negative logits are pushed further down.
        assert_eq!(s.sample(&[-1.0, -0.6, -3.0], &[1]), 0);
    }

    #[test]
    fn presence_and_frequency_penalties_subtract_per_occurrence() {
        let mut s = Sampler::new(SamplerConfig {
            presence_penalty: 0.5,
            ..Default::default()
        });
        // 3.0 - 0.5 < 2.9: the recent token loses once, however often it occurred.
        assert_eq!(s.sample(&[0.0, 3.0, 2.9], &[1, 1, 1]), 2);
        assert_eq!(s.sample(&[0.0, 3.0, 2.4], &[1, 1, 1]), 1);
        let mut s = Sampler::new(SamplerConfig {
            frequency_penalty: 0.25,
            ..Default::default()
        });
        // Twice: 3.0 - 0.5 = 2.5 > 2.4; three times: 2.25 < 2.4.
        assert_eq!(s.sample(&[0.0, 3.0, 2.4], &[1, 1]), 1);
        assert_eq!(s.sample(&[0.0, 3.0, 2.4], &[1, 1, 1]), 2);
        // Negative penalties favour repetition.
        let mut s = Sampler::new(SamplerConfig {
            presence_penalty: -1.0,
            ..Default::default()
        });
        assert_eq!(s.sample(&[0.0, 2.0, 2.9], &[1]), 1);
    }

    #[test]
    fn top_k_1_and_tiny_top_p_are_greedy() {
        let logits = [0.5, 2.0, 1.9, -1.0];
        let mut k = sampler(|c| c.top_k = 1);
        let mut p = sampler(|c| c.top_p = 0.01);
        let mut m = sampler(|c| c.min_p = 0.99);
        for _ in 0..50 {
            assert_eq!(k.sample(&logits, &[]), 1);
            assert_eq!(p.sample(&logits, &[]), 1);
            assert_eq!(m.sample(&logits, &[]), 1);
        }
    }

    #[test]
    fn sampling_follows_the_distribution_and_the_seed() {
        let logits = [0f32, (3.0f32).ln()]; // p = 0.25, 0.75
        let mut s = sampler(|_| {});
        let n = 20_000;
        let ones = (0..n).filter(|_| s.sample(&logits, &[]) == 1).count();
        let frac = ones as f64 / n as f64;
        assert!((frac - 0.75).abs() < 0.02, "{frac}");
        let run = |seed| {
            let mut s = sampler(|c| c.seed = seed);
            (0..64)
                .map(|_| s.sample(&[0.0, 0.1, 0.2, 0.3], &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(2));
    }

    #[test]
    fn invalid_settings_are_rejected() {
        for f in [
            (|c: &mut SamplerConfig| c.temperature = -1.0) as fn(&mut SamplerConfig),
            |c| c.top_p = 0.0,
            |c| c.top_p = 1.5,
            |c| c.min_p = 2.0,
            |c| c.repetition_penalty = 0.0,
            |c| c.presence_penalty = 2.5,
            |c| c.frequency_penalty = f32::NAN,
        ] {
            let mut c = SamplerConfig::default();
            f(&mut c);
            assert!(matches!(
                c.validate(),
                Err(RunnerError::InvalidArgument { .. })
            ));
        }
    }

    /// Checking a guess does not change what comes out: with the speculative rule, each
    /// token's frequency over many draws matches its probability, whether the guess is the
    /// likeliest token, an unlikely one, or one top-p has cut (never returned); greedy returns
    /// the argmax whatever the guess. Each frequency must be within five standard deviations.
    #[test]
    fn a_checked_guess_leaves_the_distribution_unchanged() {
        let logits = [1.0f32, 2.5, 0.3, 2.0, -1.0];
        let softmax = |l: &[f32]| {
            let m = l.iter().fold(f32::MIN, |a, &b| a.max(b));
            let e: Vec<f64> = l.iter().map(|&x| f64::from(x - m).exp()).collect();
            let s: f64 = e.iter().sum();
            e.into_iter().map(|x| x / s).collect::<Vec<f64>>()
        };
        let n = 200_000;
        let check = |mut s: Sampler, draft: u32, want: &[f64]| {
            let mut counts = [0usize; 5];
            for _ in 0..n {
                counts[s.sample_draft(&logits, &[], draft) as usize] += 1;
            }
            for (t, (&c, &p)) in counts.iter().zip(want).enumerate() {
                let sd = (n as f64 * p * (1.0 - p)).sqrt().max(1.0);
                let dev = (c as f64 - n as f64 * p).abs() / sd;
                assert!(
                    dev < 5.0,
                    "guess {draft}, token {t}: {c} of {n} against p = {p}"
                );
            }
        };
        let p = softmax(&logits);
        for draft in [1, 2, 4] {
            check(sampler(|_| {}), draft, &p);
        }
        // top_p = 0.75 keeps tokens 1 and 3 (0.51, then 0.31 reaches it).
        let kept = [1usize, 3];
        let q = softmax(&kept.map(|i| logits[i]));
        let mut want = [0.0f64; 5];
        for (&i, &qi) in kept.iter().zip(&q) {
            want[i] = qi;
        }
        for draft in [0, 2, 3] {
            check(sampler(|c| c.top_p = 0.75), draft, &want);
        }
        let mut g = Sampler::new(SamplerConfig::default());
        for draft in 0..5 {
            assert_eq!(g.sample_draft(&logits, &[], draft), 1);
        }
    }
}
