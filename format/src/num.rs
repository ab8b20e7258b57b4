//! Numbers as messages print them.
//!
//! `{}` of an `f64` writes every digit of its integer part, so a hostile `1e308` in a
//! configuration would come back as a 309-digit number; [`Num`] keeps ordinary values as
//! `{}` writes them (`0.5`, `10000`) and switches to `{:e}` (`1e308`, `1e-9`) outside
//! 1e-4..1e16.

use std::fmt;

/// An `f64` for a message: plain within 1e-4..1e16 (and 0), else in exponent form.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Num(pub f64);

impl fmt::Display for Num {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let a = self.0.abs();
        if a == 0.0 || !a.is_finite() || (1e-4..1e16).contains(&a) {
            write!(f, "{}", self.0)
        } else {
            write!(f, "{:e}", self.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Num;

    #[test]
    fn large_and_tiny_numbers_are_short() {
        for (v, text) in [
            (1e308, "1e308"),
            (-1e308, "-1e308"),
            (1e-300, "1e-300"),
            (0.5, "0.5"),
            (10000.0, "10000"),
            (0.0, "0"),
            (f64::INFINITY, "inf"),
            (f64::NAN, "NaN"),
            (3.4028234663852886e38, "3.4028234663852886e38"),
        ] {
            assert_eq!(Num(v).to_string(), text);
        }
    }
}
