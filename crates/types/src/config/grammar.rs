//! The configuration string's grammar, as PyTorch's `ConfigTokenizer`
//! (c10/core/AllocatorConfig.h) reads it: tokens, `key:value` pairs separated by `,`, list
//! values in brackets, and the typed values (booleans, integers, fractions, MiB, reserve
//! sizes, the `roundup_power2_divisions` table), each error naming its token and position.
use super::{ConfigError, MIB, ROUNDUP_INTERVALS, ReserveSize};
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Token {
    pub(super) text: String,
    pub(super) position: usize,
}

pub(super) fn tokenize(s: &str) -> Vec<Token> {
    let mut out: Vec<Token> = Vec::new();
    let mut word: Option<Token> = None;
    for (i, c) in s.chars().enumerate() {
        if c.is_whitespace() {
            continue;
        }
        if matches!(c, ',' | ':' | '[' | ']') {
            out.extend(word.take());
            out.push(Token {
                text: c.to_string(),
                position: i,
            });
        } else {
            word.get_or_insert(Token {
                text: String::new(),
                position: i,
            })
            .text
            .push(c);
        }
    }
    out.extend(word);
    out
}

pub(super) struct Parser {
    tokens: Vec<Token>,
    at: usize,
    end: usize,
}

impl Parser {
    /// A parser at the start of `s`.
    pub(super) fn new(s: &str) -> Parser {
        Parser {
            tokens: tokenize(s),
            at: 0,
            end: s.chars().count(),
        }
    }

    pub(super) fn err(&self, tok: Option<&Token>, message: impl Into<String>) -> ConfigError {
        ConfigError {
            position: tok.map_or(self.end, |t| t.position),
            token: tok.map_or(String::new(), |t| t.text.clone()),
            message: message.into(),
        }
    }

    pub(super) fn next(&mut self, what: &str) -> Result<Token, ConfigError> {
        let t = self.tokens.get(self.at).cloned();
        self.at += 1;
        t.ok_or_else(|| {
            self.err(
                None,
                format!("expected {what} but reached the end of the config"),
            )
        })
    }

    pub(super) fn expect(&mut self, symbol: &str) -> Result<(), ConfigError> {
        let t = self.next(&format!("'{symbol}'"))?;
        if t.text == symbol {
            Ok(())
        } else {
            Err(self.err(Some(&t), format!("expected '{symbol}'")))
        }
    }

    pub(super) fn value(&mut self) -> Result<Token, ConfigError> {
        let t = self.next("a value")?;
        if matches!(t.text.as_str(), "," | ":" | "[" | "]") {
            return Err(self.err(Some(&t), "expected a value"));
        }
        Ok(t)
    }

    pub(super) fn peek_is(&self, symbol: &str) -> bool {
        self.tokens.get(self.at).is_some_and(|t| t.text == symbol)
    }

    /// `[ key : value (, key : value)* ]`, the opening bracket already consumed.
    pub(super) fn list(&mut self) -> Result<Vec<(Token, Token)>, ConfigError> {
        let mut items = Vec::new();
        loop {
            let key = self.value()?;
            self.expect(":")?;
            items.push((key, self.value()?));
            let sep = self.next("',' or ']'")?;
            match sep.text.as_str() {
                "," => continue,
                "]" => return Ok(items),
                _ => return Err(self.err(Some(&sep), "expected ',' or closing bracket ']'")),
            }
        }
    }
}

pub(super) fn bool_value(t: &Token) -> Result<bool, ConfigError> {
    match t.text.as_str() {
        "True" => Ok(true),
        "False" => Ok(false),
        _ => Err(ConfigError {
            position: t.position,
            token: t.text.clone(),
            message: format!("Expected 'True' or 'False' but got '{}'", t.text),
        }),
    }
}

pub(super) fn uint_value(t: &Token) -> Result<u64, ConfigError> {
    let bad = |m: &str| ConfigError {
        position: t.position,
        token: t.text.clone(),
        message: m.into(),
    };
    if t.text.is_empty() || !t.text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad("expected a whole number"));
    }
    t.text.parse::<u64>().map_err(|_| bad("number too large"))
}

pub(super) fn float_value(t: &Token) -> Result<f64, ConfigError> {
    let v: f64 = t.text.parse().map_err(|_| ConfigError {
        position: t.position,
        token: t.text.clone(),
        message: "expected a number".into(),
    })?;
    if v.is_finite() {
        Ok(v)
    } else {
        Err(ConfigError {
            position: t.position,
            token: t.text.clone(),
            message: "expected a finite number".into(),
        })
    }
}

pub(super) fn mib_value(t: &Token) -> Result<u64, ConfigError> {
    // Values above what fits in bytes are clamped, as PyTorch clamps to SIZE_MAX.
    Ok(uint_value(t)?.saturating_mul(MIB))
}

/// A value of `expandable_segments_reserve` (or of an entry of
/// `expandable_segments_reserve_by_class`, `key` naming which): a fraction of the device's
/// memory, or whole GiB (`40G`), in either case > 0. PyTorch warns and keeps its default
/// for a value that is not positive (`CUDAAllocatorConfig::parseReserveSpec`,
/// c10/cuda/CUDAAllocatorConfig.cpp); here it is an error, `0G` included.
pub(super) fn reserve_value(key: &str, t: &Token) -> Result<ReserveSize, ConfigError> {
    let not_positive = || ConfigError {
        position: t.position,
        token: t.text.clone(),
        message: format!(
            "{key} must be > 0: a positive fraction of the device's memory (0.5) or a \
             positive whole number of GiB (40G)"
        ),
    };
    if let Some(g) = t.text.strip_suffix('G') {
        let n = uint_value(&Token {
            text: g.into(),
            position: t.position,
        })?;
        if n == 0 {
            return Err(not_positive());
        }
        return Ok(ReserveSize::Bytes(n.saturating_mul(1 << 30)));
    }
    let f = float_value(t)?;
    if f > 0.0 {
        Ok(ReserveSize::Fraction(f))
    } else {
        Err(not_positive())
    }
}

pub(super) fn is_pow2(v: u64) -> bool {
    v.is_power_of_two()
}

/// A key under its own name (`release_lock_on_hipmalloc` is `release_lock_on_cudamalloc`).
pub(super) fn canonical_key(key: &str) -> &str {
    match key {
        "release_lock_on_hipmalloc" => "release_lock_on_cudamalloc",
        "pinned_use_hip_host_register" => "pinned_use_cuda_host_register",
        k => k,
    }
}

#[derive(Clone, Debug)]
pub(super) enum Value {
    Single(Token),
    List(Vec<(Token, Token)>),
}

pub(super) fn single<'a>(p: &Parser, key: &Token, v: &'a Value) -> Result<&'a Token, ConfigError> {
    match v {
        Value::Single(t) => Ok(t),
        Value::List(_) => Err(p.err(
            Some(key),
            format!("option {} takes a single value, not a list", key.text),
        )),
    }
}

pub(super) fn parse_pairs(p: &mut Parser) -> Result<Vec<(Token, Value)>, ConfigError> {
    let mut pairs = Vec::new();
    while p.at < p.tokens.len() {
        let key = p.value()?;
        p.expect(":")?;
        let value = if p.peek_is("[") {
            p.at += 1;
            Value::List(p.list()?)
        } else {
            Value::Single(p.value()?)
        };
        pairs.push((key, value));
        if p.at < p.tokens.len() {
            p.expect(",")?;
            if p.at == p.tokens.len() {
                return Err(p.err(None, "expected a key after ','"));
            }
        }
    }
    Ok(pairs)
}

pub(super) fn roundup_table(
    p: &Parser,
    value: &Value,
) -> Result<[u64; ROUNDUP_INTERVALS], ConfigError> {
    let mut table = [0u64; ROUNDUP_INTERVALS];
    match value {
        Value::Single(t) => {
            let d = uint_value(t)?;
            if !is_pow2(d) {
                return Err(p.err(Some(t), "For roundups, the divisions has to be power of 2 "));
            }
            table = [d; ROUNDUP_INTERVALS];
        }
        Value::List(items) => {
            let mut last: Option<usize> = None;
            for (k, v) in items {
                let d = uint_value(v)?;
                if d != 0 && !is_pow2(d) {
                    return Err(p.err(
                        Some(v),
                        "For roundups, the divisions has to be power of 2 or 0 to disable roundup ",
                    ));
                }
                if k.text == ">" {
                    let from = last.map_or(0, |l| l + 1);
                    table[from.min(ROUNDUP_INTERVALS)..].fill(d);
                    continue;
                }
                let mb = uint_value(k)?;
                if !is_pow2(mb) {
                    return Err(p.err(
                        Some(k),
                        "For roundups, the intervals have to be power of 2 ",
                    ));
                }
                let index = (mb.ilog2() as usize).min(ROUNDUP_INTERVALS - 1);
                if last.is_none() {
                    table[..index].fill(d);
                }
                table[index] = d;
                last = Some(index);
            }
        }
    }
    Ok(table)
}
