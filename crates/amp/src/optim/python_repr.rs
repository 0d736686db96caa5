//! Floats printed as Python's `repr(float)` prints them, for messages that must read as
//! PyTorch's (`f"Invalid learning rate: {lr}"` shows `-1.0`, `1e-08`, `nan`, `inf`).
//!
//! Python (`Python/pystrtod.c`, `format_float_short` with mode `'r'`): the shortest digits
//! that read back to the same float; exponent form when the decimal exponent is below -4 or
//! at least 16, with a sign and at least two exponent digits (`1e-05`, `1e+16`); otherwise
//! positional, with `.0` added to a whole number (`100.0`); `nan` (never signed), `inf`,
//! `-inf`, `-0.0`. Rust's `{:e}` gives the same shortest digits, so only the layout is
//! Python's here. An `f32` gets the shortest digits that read back to it *as an `f32`* (what
//! its user wrote: `-0.1f32` is `-0.1`, not the double's `-0.10000000149011612`).
use std::fmt::LowerExp;

/// `f32` or `f64`.
pub(crate) trait PyFloat: Copy + LowerExp {
    /// Whether it is NaN.
    fn nan(self) -> bool;
    /// Whether it is ±inf.
    fn infinite(self) -> bool;
    /// Whether its sign bit is set.
    fn negative(self) -> bool;
}

macro_rules! py_float {
    ($($t:ty),*) => {$(
        impl PyFloat for $t {
            fn nan(self) -> bool {
                self.is_nan()
            }
            fn infinite(self) -> bool {
                self.is_infinite()
            }
            fn negative(self) -> bool {
                self.is_sign_negative()
            }
        }
    )*};
}
py_float!(f32, f64);

/// `x` as Python's `repr` prints a float of that value (see the module docs).
pub(crate) fn python_repr<F: PyFloat>(x: F) -> String {
    if x.nan() {
        return "nan".into();
    }
    let sign = if x.negative() { "-" } else { "" };
    if x.infinite() {
        return format!("{sign}inf");
    }
    // `d.ddde±x` with the shortest digits (`0e0` for zero).
    let sci = format!("{x:e}");
    let sci = sci.trim_start_matches('-');
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let body = if !(-4..16).contains(&exp) {
        let (first, rest) = digits.split_at(1);
        let dot = if rest.is_empty() { "" } else { "." };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{first}{dot}{rest}e{exp_sign}{:02}", exp.unsigned_abs())
    } else if exp >= 0 {
        let whole = exp as usize + 1;
        if digits.len() <= whole {
            format!("{digits}{}.0", "0".repeat(whole - digits.len()))
        } else {
            format!("{}.{}", &digits[..whole], &digits[whole..])
        }
    } else {
        format!("0.{}{digits}", "0".repeat(exp.unsigned_abs() as usize - 1))
    };
    format!("{sign}{body}")
}

#[cfg(test)]
mod tests {
    use super::python_repr;
    use proptest::prelude::*;

    /// What CPython 3 prints for `repr(x)`.
    #[test]
    fn known_values() {
        let cases: [(f64, &str); 27] = [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (-1.0, "-1.0"),
            (100.0, "100.0"),
            (0.1, "0.1"),
            (0.001, "0.001"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1e-8, "1e-08"),
            (2.5e-7, "2.5e-07"),
            (1.0 / 3.0, "0.3333333333333333"),
            (12345.678, "12345.678"),
            (123456789.0, "123456789.0"),
            (1e15, "1000000000000000.0"),
            (9999999999999998.0, "9999999999999998.0"),
            (1e16, "1e+16"),
            (12345678901234567.0, "1.2345678901234568e+16"),
            (1e22, "1e+22"),
            (1.5e300, "1.5e+300"),
            (1e100, "1e+100"),
            (f64::MAX, "1.7976931348623157e+308"),
            (5e-324, "5e-324"),
            (f64::MIN_POSITIVE, "2.2250738585072014e-308"),
            (f64::NAN, "nan"),
            (f64::INFINITY, "inf"),
            (f64::NEG_INFINITY, "-inf"),
        ];
        for (x, want) in cases {
            assert_eq!(python_repr(x), want, "{x:e}");
        }
        assert_eq!(python_repr(-f64::NAN), "nan", "Python never signs a NaN");
    }

    /// An `f32` prints its own shortest digits.
    #[test]
    fn f32_values() {
        for (x, want) in [
            (-0.1f32, "-0.1"),
            (1e-8, "1e-08"),
            (0.001, "0.001"),
            (-1e16, "-1e+16"),
            (0.9, "0.9"),
            (0.999, "0.999"),
            (1.0, "1.0"),
            (f32::MAX, "3.4028235e+38"),
            (16777216.0, "16777216.0"),
            (f32::NAN, "nan"),
            (f32::NEG_INFINITY, "-inf"),
        ] {
            assert_eq!(python_repr(x), want, "{x:e}");
        }
    }

    /// Python's layout: an optional sign, then either positional digits with a dot or
    /// `d[.ddd]e±XX`; the exponent form exactly when the decimal exponent is < -4 or >= 16.
    fn layout_ok(s: &str, exp: i32) -> bool {
        let body = s.strip_prefix('-').unwrap_or(s);
        let digit = |c: char| c.is_ascii_digit();
        match body.split_once('e') {
            Some((m, e)) => {
                let (sign, e) = e.split_at(1);
                !(-4..16).contains(&exp)
                    && (sign == "+" || sign == "-")
                    && e.len() >= 2
                    && e.chars().all(digit)
                    && m.chars().next().is_some_and(digit)
                    && m.chars().filter(|c| *c == '.').count() <= 1
            }
            None => {
                (-4..16).contains(&exp)
                    && body.chars().filter(|c| *c == '.').count() == 1
                    && !body.starts_with('.')
                    && !body.ends_with('.')
                    && body.chars().all(|c| digit(c) || c == '.')
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        #[test]
        fn f64_reads_back_and_has_pythons_layout(bits in any::<u64>()) {
            let x = f64::from_bits(bits);
            prop_assume!(x.is_finite());
            let s = python_repr(x);
            let back: f64 = s.parse().map_err(|e| TestCaseError::fail(format!("{s}: {e}")))?;
            prop_assert_eq!(back.to_bits(), x.to_bits(), "{}", s);
            let sci = format!("{x:e}");
            let exp: i32 = sci.split_once('e').map_or(Ok(0), |(_, e)| e.parse())?;
            prop_assert!(layout_ok(&s, exp), "{} ({})", s, sci);
        }

        #[test]
        fn f32_reads_back_as_f32(bits in any::<u32>()) {
            let x = f32::from_bits(bits);
            prop_assume!(x.is_finite());
            let s = python_repr(x);
            let back: f32 = s.parse().map_err(|e| TestCaseError::fail(format!("{s}: {e}")))?;
            prop_assert_eq!(back.to_bits(), x.to_bits(), "{}", s);
        }
    }
}
