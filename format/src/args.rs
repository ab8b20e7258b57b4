//! Numeric command-line values, read and range-checked the same way by every Kiln program.
//!
//! Each numeric flag gets its range here, and a program's argument parser takes the value as
//! a number whatever its sign (clap: `allow_negative_numbers`), so `--bpw -1` is refused by
//! its range, naming the flag and the range, instead of being taken for an unknown option
//! `-1` that names no flag. The parsers are plain functions of a string (clap's
//! `value_parser` takes them as they are), so this crate needs no argument parser; the
//! parser prefixes the flag and the value, the message here says what was expected.

use std::ops::Bound;

use crate::num::Num;

/// An unsigned integer type a flag's value is stored in.
pub trait Whole: Copy + Send + Sync + 'static {
    /// The type's largest value.
    const MAX: u64;
    /// `v`, known to be at most [`Whole::MAX`].
    fn from_u64(v: u64) -> Self;
}

macro_rules! whole {
    ($($t:ty),*) => {$(
        impl Whole for $t {
            const MAX: u64 = <$t>::MAX as u64;
            fn from_u64(v: u64) -> Self {
                v as $t
            }
        }
    )*};
}
whole!(u8, u16, u32, u64, usize);

/// A float type a flag's value is stored in.
pub trait Real: Copy + Send + Sync + 'static {
    /// The type's name in messages (`f32`).
    const NAME: &'static str;
    /// The type's largest finite value.
    const LARGEST: f64;
    /// `v` in this type, or `None` where it does not fit (beyond an `f32`'s range).
    fn from_f64(v: f64) -> Option<Self>;
}

impl Real for f32 {
    const NAME: &'static str = "f32";
    const LARGEST: f64 = f32::MAX as f64;
    fn from_f64(v: f64) -> Option<f32> {
        Some(v as f32).filter(|n| n.is_finite())
    }
}

impl Real for f64 {
    const NAME: &'static str = "f64";
    const LARGEST: f64 = f64::MAX;
    fn from_f64(v: f64) -> Option<f64> {
        Some(v)
    }
}

/// No upper bound for [`whole`]: the type's own largest value applies.
pub const UNBOUNDED: u64 = u64::MAX;

/// A parser of whole numbers from `min` to `max` inclusive ([`UNBOUNDED`]: up to the type's
/// largest value). A negative number, a fraction or a value out of range is refused with
/// "must be a whole number from 1 to 64" (or "…, at least 1").
pub fn whole<T: Whole>(
    min: u64,
    max: u64,
) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static {
    move |s: &str| {
        let hi = max.min(T::MAX);
        let expected = if max == UNBOUNDED {
            format!("must be a whole number, at least {min}")
        } else {
            format!("must be a whole number from {min} to {hi}")
        };
        match parse_whole(s.trim()) {
            Some(v) if v >= i128::from(min) && v <= i128::from(hi) => Ok(T::from_u64(v as u64)),
            Some(v) if v > i128::from(hi) && max == UNBOUNDED => {
                Err(format!("{expected} and at most {hi}"))
            }
            _ => Err(expected),
        }
    }
}

/// [`whole`] with no upper bound: "must be a whole number, at least 1".
pub fn at_least<T: Whole>(
    min: u64,
) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static {
    whole(min, UNBOUNDED)
}

/// `s` as a signed integer; past `i128`'s range it saturates (still out of any flag's range).
fn parse_whole(s: &str) -> Option<i128> {
    let (negative, digits) = match s.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let magnitude = digits.parse::<i128>().unwrap_or(i128::MAX);
    Some(if negative { -magnitude } else { magnitude })
}

/// A parser of finite numbers between `low` and `high` (each inclusive, exclusive or
/// unbounded). NaN, infinities and values out of range are refused with "must be a number
/// above 0 and at most 32"; a value the type cannot hold (1e39 for an `f32`) with "does not
/// fit in an f32".
pub fn real<T: Real>(
    low: Bound<f64>,
    high: Bound<f64>,
) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static {
    move |s: &str| {
        let expected = format!("must be {}", describe(low, high));
        let v: f64 = s.trim().parse().map_err(|_| expected.clone())?;
        let above = match low {
            Bound::Included(a) => v >= a,
            Bound::Excluded(a) => v > a,
            Bound::Unbounded => true,
        };
        let below = match high {
            Bound::Included(b) => v <= b,
            Bound::Excluded(b) => v < b,
            Bound::Unbounded => true,
        };
        if !(v.is_finite() && above && below) {
            return Err(expected);
        }
        T::from_f64(v).ok_or_else(|| {
            format!(
                "{} does not fit in an {} (whose largest value is about {:.1e})",
                Num(v),
                T::NAME,
                T::LARGEST
            )
        })
    }
}

/// [`real`] from 0 to 1, both included (`--min-p`, a top-1 agreement).
pub fn fraction<T: Real>() -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static {
    real(Bound::Included(0.0), Bound::Included(1.0))
}

/// [`real`] of 0 or more (a temperature, a tolerance).
pub fn non_negative<T: Real>() -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static
{
    real(Bound::Included(0.0), Bound::Unbounded)
}

/// [`real`] above 0 (a penalty that divides).
pub fn positive<T: Real>() -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static {
    real(Bound::Excluded(0.0), Bound::Unbounded)
}

/// "a number from 0 to 1", "a number above 0 and at most 32", "a finite number, at least 0".
fn describe(low: Bound<f64>, high: Bound<f64>) -> String {
    let low_text = match low {
        Bound::Included(a) => Some(format!("at least {}", Num(a))),
        Bound::Excluded(a) => Some(format!("above {}", Num(a))),
        Bound::Unbounded => None,
    };
    let high_text = match high {
        Bound::Included(b) => Some(format!("at most {}", Num(b))),
        Bound::Excluded(b) => Some(format!("below {}", Num(b))),
        Bound::Unbounded => None,
    };
    match (low, high, low_text, high_text) {
        (Bound::Included(a), Bound::Included(b), _, _) => {
            format!("a number from {} to {}", Num(a), Num(b))
        }
        (_, _, Some(l), Some(h)) => format!("a number {l} and {h}"),
        (_, _, Some(only), None) | (_, _, None, Some(only)) => format!("a finite number, {only}"),
        (_, _, None, None) => "a finite number".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_numbers_in_range_are_read_and_others_refused_with_the_range() {
        let p = whole::<u16>(0, 64);
        assert_eq!(p("0"), Ok(0));
        assert_eq!(p("64"), Ok(64));
        assert_eq!(p(" 7 "), Ok(7));
        for bad in [
            "-1",
            "65",
            "1.5",
            "",
            "x",
            "-",
            "99999999999999999999999999999999999999999",
        ] {
            assert_eq!(
                p(bad),
                Err("must be a whole number from 0 to 64".into()),
                "{bad:?}"
            );
        }
        let p = whole::<usize>(1, UNBOUNDED);
        assert_eq!(p("3"), Ok(3));
        assert_eq!(p("-1"), Err("must be a whole number, at least 1".into()));
        assert_eq!(p("0"), Err("must be a whole number, at least 1".into()));
        let p = whole::<u8>(0, UNBOUNDED);
        assert_eq!(
            p("256"),
            Err("must be a whole number, at least 0 and at most 255".into())
        );
    }

    #[test]
    fn numbers_are_refused_by_their_range_or_their_type() {
        let bpw = real::<f64>(Bound::Excluded(0.0), Bound::Included(32.0));
        assert_eq!(bpw("4.5"), Ok(4.5));
        for bad in ["-1", "0", "32.5", "nan", "inf", "x"] {
            assert_eq!(
                bpw(bad),
                Err("must be a number above 0 and at most 32".into()),
                "{bad}"
            );
        }
        let fraction = real::<f32>(Bound::Included(0.0), Bound::Included(1.0));
        assert_eq!(fraction("-1"), Err("must be a number from 0 to 1".into()));
        let temp = real::<f32>(Bound::Included(0.0), Bound::Unbounded);
        assert_eq!(
            temp("-1"),
            Err("must be a finite number, at least 0".into())
        );
        let e = temp("1e308").unwrap_err();
        assert!(e.contains("1e308 does not fit in an f32"), "{e}");
        assert!(e.len() < 100, "{e}");
    }
}
