//! JSON written the way Python's `json.dumps` writes it: the `tojson` of Hugging Face chat
//! templates (`json.dumps(x, ensure_ascii=False, indent=.., separators=.., sort_keys=..)`),
//! so that a tool schema in a rendered prompt has the bytes the model was trained on.
//!
//! Differences from `serde_json`'s compact form: `", "` and `": "` separators by default
//! (`","` and `": "` with an indent), non-ASCII escaped only with `ensure_ascii`, and floats in
//! Python's `repr` (`1e+16`, `1e-05`, `1.0`).

use serde_json::Value;

/// How to write JSON (`json.dumps`' keyword arguments).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dumps {
    /// Escape every non-ASCII character as `\uXXXX`.
    pub ensure_ascii: bool,
    /// Pretty-print with this many spaces per level.
    pub indent: Option<usize>,
    /// Item and key separators; `None`: Python's default for the indent.
    pub separators: Option<(String, String)>,
    /// Sort object keys.
    pub sort_keys: bool,
}

impl Default for Dumps {
    /// `json.dumps(x)` as Hugging Face's `tojson` calls it: `ensure_ascii=False`.
    fn default() -> Self {
        Self {
            ensure_ascii: false,
            indent: None,
            separators: None,
            sort_keys: false,
        }
    }
}

impl Dumps {
    /// `v` as Python writes it.
    pub fn dumps(&self, v: &Value) -> String {
        let (item, key) = match &self.separators {
            Some((i, k)) => (i.as_str(), k.as_str()),
            None if self.indent.is_some() => (",", ": "),
            None => (", ", ": "),
        };
        let mut out = String::new();
        self.write(v, 0, item, key, &mut out);
        out
    }

    fn newline(&self, level: usize, out: &mut String) {
        if let Some(n) = self.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * level));
        }
    }

    fn write(&self, v: &Value, level: usize, item: &str, key: &str, out: &mut String) {
        match v {
            Value::Null => out.push_str("null"),
            Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Value::Number(n) => out.push_str(&number(n)),
            Value::String(s) => string(s, self.ensure_ascii, out),
            Value::Array(a) if a.is_empty() => out.push_str("[]"),
            Value::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push_str(item);
                    }
                    self.newline(level + 1, out);
                    self.write(x, level + 1, item, key, out);
                }
                self.newline(level, out);
                out.push(']');
            }
            Value::Object(o) if o.is_empty() => out.push_str("{}"),
            Value::Object(o) => {
                let mut entries: Vec<(&String, &Value)> = o.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, x)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(item);
                    }
                    self.newline(level + 1, out);
                    string(k, self.ensure_ascii, out);
                    out.push_str(key);
                    self.write(x, level + 1, item, key, out);
                }
                self.newline(level, out);
                out.push('}');
            }
        }
    }
}

/// `json.dumps(v)` with Hugging Face's defaults.
pub fn dumps(v: &Value) -> String {
    Dumps::default().dumps(v)
}

fn string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn number(n: &serde_json::Number) -> String {
    if let Some(i) = n.as_i64() {
        return i.to_string();
    }
    if let Some(u) = n.as_u64() {
        return u.to_string();
    }
    py_float(n.as_f64().unwrap_or(f64::NAN))
}

/// Python's `repr(float)`: the shortest digits that round-trip, in exponent form below 1e-4
/// and from 1e16 on, otherwise positional with at least one decimal.
pub fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // Rust's `{:e}` gives the shortest round-trip digits: `d.ddde±x`.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("exponent is an integer");
    let neg = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if neg { "-" } else { "" };
    if !(-4..16).contains(&exp) {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{first}{frac}e{esign}{:02}", exp.abs());
    }
    let point = exp + 1; // digits before the decimal point
    if point <= 0 {
        let zeros = "0".repeat((-point) as usize);
        format!("{sign}0.{zeros}{digits}")
    } else if point as usize >= digits.len() {
        let zeros = "0".repeat(point as usize - digits.len());
        format!("{sign}{digits}{zeros}.0")
    } else {
        let (a, b) = digits.split_at(point as usize);
        format!("{sign}{a}.{b}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn default_separators_and_raw_unicode() {
        assert_eq!(
            dumps(&json!({"a": [1, "Zürich"], "b": null})),
            r#"{"a": [1, "Zürich"], "b": null}"#
        );
    }

    #[test]
    fn ensure_ascii_escapes_as_utf16() {
        let d = Dumps {
            ensure_ascii: true,
            ..Dumps::default()
        };
        assert_eq!(d.dumps(&json!("é😀")), r#""\u00e9\ud83d\ude00""#);
    }

    #[test]
    fn indent_uses_comma_without_space_and_newlines() {
        let d = Dumps {
            indent: Some(4),
            ..Dumps::default()
        };
        assert_eq!(
            d.dumps(&json!({"a": {"b": [1, 2]}, "c": {}})),
            "{\n    \"a\": {\n        \"b\": [\n            1,\n            2\n        ]\n    },\n    \"c\": {}\n}"
        );
    }

    #[test]
    fn keys_keep_their_order_unless_sorted() {
        let v = json!({"z": 1, "a": 2});
        assert_eq!(dumps(&v), r#"{"z": 1, "a": 2}"#);
        let d = Dumps {
            sort_keys: true,
            ..Dumps::default()
        };
        assert_eq!(d.dumps(&v), r#"{"a": 2, "z": 1}"#);
    }

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(dumps(&json!("a\"b\\c\n\u{1}")), r#""a\"b\\c\n\u0001""#);
    }

    #[test]
    fn floats_follow_python_repr() {
        for (f, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1.5e-5, "1.5e-05"),
            (0.0001, "0.0001"),
            (123456789.0, "123456789.0"),
            (1e22, "1e+22"),
        ] {
            assert_eq!(py_float(f), want, "{f}");
        }
    }
}
