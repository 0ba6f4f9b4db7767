//! Python's text forms of template values: `str()`, `repr()` and `json.dumps`.
//!
//! Hugging Face renders chat templates with Jinja2, so whatever a template prints goes through Python:
//! `{{ none }}` is `None`, a list prints as `['a', 1]`, and `tojson` is Hugging Face's own filter over
//! `json.dumps` (no HTML escaping, `ensure_ascii=False`, `", "` and `": "` separators). minijinja's own forms
//! differ (`["a", 1]`, HTML-safe JSON), so the environment prints through these functions instead.
//!
//! Printing is bounded by the render's budget (budget.rs): a lazily repeated list (`[text] * 100000`)
//! holds little but prints a lot, so the text stops growing where the budget ends and the render fails.

use std::fmt::Write;

use minijinja::value::{from_args, Kwargs, Rest, ValueKind, ValueOrKwargs};
use minijinja::{Error, ErrorKind, State, Value};

use crate::budget::{self, BoundedText};

/// Python's `str(value)`: what `{{ value }}` and `value | string` print.
pub(crate) fn py_str(state: &State, value: &Value) -> Result<String, Error> {
    py_str_within(value, usize::try_from(budget::bytes_left(state)).unwrap_or(usize::MAX))
}

/// [`py_str`] of at most `limit` bytes; longer is the budget error.
fn py_str_within(value: &Value, limit: usize) -> Result<String, Error> {
    let mut out = BoundedText::with_limit(limit);
    match value.as_str() {
        Some(text) if value.kind() == ValueKind::String => out.push_str(text),
        _ => write_repr(&mut out, value),
    }
    out.finish("printing a value")
}

/// Python's `repr(value)`, as containers print their items. Undefined prints as nothing, as Jinja2's
/// `Undefined` does when it is printed.
fn write_repr(out: &mut BoundedText, value: &Value) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => write_number(out, value, FloatStyle::Repr),
        ValueKind::String => write_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            let (open, close) = if value.is_tuple() { ('(', ')') } else { ('[', ']') };
            out.push(open);
            let mut count = 0usize;
            if let Ok(items) = value.try_iter() {
                for item in items {
                    if count > 0 {
                        out.push_str(", ");
                    }
                    write_repr(out, &item);
                    count += 1;
                    if out.is_over() {
                        return;
                    }
                }
            }
            if value.is_tuple() && count == 1 {
                out.push(',');
            }
            out.push(close);
        }
        ValueKind::Map => {
            out.push('{');
            if let Some(pairs) = value.as_object().and_then(|object| object.try_iter_pairs()) {
                for (index, (key, item)) in pairs.enumerate() {
                    if index > 0 {
                        out.push_str(", ");
                    }
                    write_repr(out, &key);
                    out.push_str(": ");
                    write_repr(out, &item);
                    if out.is_over() {
                        return;
                    }
                }
            }
            out.push('}');
        }
        // Namespaces, loops, functions and bytes have no Python form a template could rely on.
        _ => {
            let _ = write!(out, "{value}");
        }
    }
}

/// Python's `repr(str)`: single quotes unless the text has a single quote and no double quote, with the
/// escapes Python uses for characters it does not consider printable.
fn write_str_repr(out: &mut BoundedText, text: &str) {
    let quote = if text.contains('\'') && !text.contains('"') { '"' } else { '\'' };
    out.push(quote);
    // Runs of characters printed as they are go out as one slice: a long string is one write.
    let mut run_start = 0;
    for (index, c) in text.char_indices() {
        let plain = c != '\\' && c != quote && c != '\n' && c != '\r' && c != '\t' && is_printable(c);
        if plain {
            continue;
        }
        out.push_str(&text[run_start..index]);
        run_start = index + c.len_utf8();
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x100 => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if (c as u32) < 0x10000 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => {
                let _ = write!(out, "\\U{:08x}", c as u32);
            }
        }
        if out.is_over() {
            return;
        }
    }
    out.push_str(&text[run_start..]);
    out.push(quote);
}

/// Python's `str.isprintable` for one character, without Unicode's tables: control characters, the
/// separators other than the ASCII space, the common format characters and private use are not printable.
/// Unassigned code points (which Python also escapes) are taken as printable.
fn is_printable(c: char) -> bool {
    let code = c as u32;
    let not_printable = c.is_control()
        || matches!(code,
            0x00A0 | 0x00AD | 0x061C | 0x06DD | 0x070F | 0x1680 | 0x180E | 0x2000..=0x200F | 0x2028..=0x202F
            | 0x205F..=0x2064 | 0x2066..=0x206F | 0x3000 | 0xFEFF | 0xFFF9..=0xFFFB | 0x0600..=0x0605
            | 0xE000..=0xF8FF | 0xE0001 | 0xE0020..=0xE007F | 0xF0000..=0x10FFFF);
    !not_printable
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum FloatStyle {
    /// `repr(float)`: `nan`, `inf`.
    Repr,
    /// `json.dumps(float)`: `NaN`, `Infinity`.
    Json,
}

fn write_number(out: &mut impl Write, value: &Value, style: FloatStyle) {
    if value.is_integer() {
        // Integers print the same in Python and Rust, whatever their width.
        let _ = write!(out, "{value}");
        return;
    }
    match f64::try_from(value.clone()) {
        Ok(number) => write_float(out, number, style),
        Err(_) => {
            let _ = write!(out, "{value}");
        }
    }
}

/// Python's `repr(float)`: the shortest text that reads back as the same number, positional for decimal
/// exponents from -4 to 15 (with a `.0` when integral) and scientific outside (`1e-05`, `1.5e+16`).
fn write_float(out: &mut impl Write, number: f64, style: FloatStyle) {
    if number.is_nan() {
        let _ = out.write_str(if style == FloatStyle::Json { "NaN" } else { "nan" });
        return;
    }
    if number.is_infinite() {
        let sign = if number < 0.0 { "-" } else { "" };
        let word = if style == FloatStyle::Json { "Infinity" } else { "inf" };
        let _ = write!(out, "{sign}{word}");
        return;
    }
    // Rust's `{:e}` gives the shortest round-trip digits with the exponent, e.g. "1.5e16", "-1e-7".
    let scientific = format!("{number:e}");
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    if (-4..16).contains(&exponent) {
        let positional = format!("{number}");
        let fraction = if positional.contains('.') { "" } else { ".0" };
        let _ = write!(out, "{positional}{fraction}");
    } else {
        let sign = if exponent < 0 { '-' } else { '+' };
        let _ = write!(out, "{mantissa}e{sign}{:02}", exponent.unsigned_abs());
    }
}

/// The options of Hugging Face's `tojson` filter, which are those of `json.dumps`.
struct JsonOptions {
    ensure_ascii: bool,
    /// `None`: everything on one line. `Some(unit)`: one item a line, indented by `unit` per level.
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
}

/// Hugging Face's `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`: the
/// arguments may be given by name, and all but `sort_keys` by position too. The JSON text is bounded by
/// the render's budget.
pub(crate) fn tojson_filter(state: &State, value: &Value, args: Rest<ValueOrKwargs>) -> Result<Value, Error> {
    let args = args.into_values();
    // Filters take five arguments at most, one too few for the state, the value, three positional
    // arguments and the keyword ones: they come as one list, the keyword ones last.
    let (positional, kwargs) = match args.split_last() {
        Some((last, positional)) if last.is_kwargs() => (positional, std::slice::from_ref(last)),
        _ => (&args[..], &[][..]),
    };
    let (ensure_ascii, indent, separators): (Option<Value>, Option<Value>, Option<Value>) = from_args(positional)?;
    let (kwargs,): (Kwargs,) = from_args(kwargs)?;
    let ensure_ascii = named_or_positional(&kwargs, "ensure_ascii", ensure_ascii)?;
    let indent = named_or_positional(&kwargs, "indent", indent)?;
    let separators = named_or_positional(&kwargs, "separators", separators)?;
    let sort_keys = named_or_positional(&kwargs, "sort_keys", None)?;
    kwargs.assert_all_used()?;

    let indent = match indent {
        None => None,
        Some(unit) if unit.is_none() => None,
        Some(unit) if unit.kind() == ValueKind::String => Some(unit.as_str().unwrap_or_default().to_owned()),
        Some(unit) if unit.kind() == ValueKind::Bool => Some(if unit.is_true() { " " } else { "" }.to_owned()),
        Some(unit) => {
            // Python repeats a space `indent` times; a negative count is an empty indent.
            let spaces = i64::try_from(unit.clone())
                .map_err(|_| invalid(format!("tojson: indent must be an integer or a string, not {unit}")))?;
            let spaces = usize::try_from(spaces.max(0)).unwrap_or(0);
            budget::ensure_bytes(state, spaces as u64, "tojson's indent")?;
            Some(" ".repeat(spaces))
        }
    };
    let (item_separator, key_separator) = match separators {
        Some(pair) if !pair.is_none() => {
            let parts: Vec<Value> = pair.try_iter()?.take(3).collect();
            match parts.as_slice() {
                [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                    (item.as_str().unwrap_or_default().to_owned(), key.as_str().unwrap_or_default().to_owned())
                }
                _ => return Err(invalid("tojson: separators must be a pair of strings")),
            }
        }
        // json.dumps drops the space after commas when it indents, since lines end there.
        _ => (if indent.is_some() { "," } else { ", " }.to_owned(), ": ".to_owned()),
    };
    let options = JsonOptions {
        ensure_ascii: ensure_ascii.is_some_and(|flag| flag.is_true()),
        indent,
        item_separator,
        key_separator,
        sort_keys: sort_keys.is_some_and(|flag| flag.is_true()),
    };
    let mut out = BoundedText::for_state(state);
    write_json(&mut out, value, &options, 0)?;
    out.finish("tojson").map(Value::from_safe_string)
}

fn named_or_positional(kwargs: &Kwargs, name: &str, positional: Option<Value>) -> Result<Option<Value>, Error> {
    let named: Option<Value> = kwargs.get(name)?;
    Ok(named.or(positional))
}

fn invalid(message: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, message.into())
}

/// Writes `value` as JSON; stops early (leaving `out` over its limit) where the budget ends, so a
/// lazily repeated list is never walked past it.
fn write_json(out: &mut BoundedText, value: &Value, options: &JsonOptions, depth: usize) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, value, FloatStyle::Json),
        ValueKind::String => write_json_str(out, value.as_str().unwrap_or_default(), options.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            write_container(out, options, depth, ('[', ']'), value.try_iter()?, |out, item| {
                write_json(out, &item, options, depth + 1)
            })?;
        }
        ValueKind::Map => {
            // A map holds what the input or the template's own dict literals put there, both paid for.
            let mut pairs: Vec<(String, Value)> = Vec::new();
            if let Some(iter) = value.as_object().and_then(|object| object.try_iter_pairs()) {
                for (key, item) in iter {
                    pairs.push((json_key(&key)?, item));
                }
            }
            if options.sort_keys {
                // A stable sort keeps the first of two keys that print the same, as Python compares them.
                pairs.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(out, options, depth, ('{', '}'), pairs.into_iter(), |out, (key, item)| {
                write_json_str(out, &key, options.ensure_ascii);
                out.push_str(&options.key_separator);
                write_json(out, &item, options, depth + 1)
            })?;
        }
        ValueKind::Undefined => return Err(invalid("tojson: an undefined value is not JSON serializable")),
        kind => return Err(invalid(format!("tojson: a value of type {kind} is not JSON serializable"))),
    }
    Ok(())
}

/// json.dumps turns keys that are not strings into strings: `1` -> "1", `True` -> "true", `None` -> "null".
fn json_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
        ValueKind::None => Ok("null".to_owned()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_owned()),
        ValueKind::Number => {
            let mut text = String::new();
            write_number(&mut text, key, FloatStyle::Json);
            Ok(text)
        }
        kind => Err(invalid(format!("tojson: keys must be str, int, float, bool or None, not {kind}"))),
    }
}

fn write_container<T>(
    out: &mut BoundedText,
    options: &JsonOptions,
    depth: usize,
    (open, close): (char, char),
    items: impl Iterator<Item = T>,
    mut write_item: impl FnMut(&mut BoundedText, T) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    let mut empty = true;
    for item in items {
        if !empty {
            out.push_str(&options.item_separator);
        }
        empty = false;
        write_indent(out, options, depth + 1);
        write_item(out, item)?;
        if out.is_over() {
            return Ok(());
        }
    }
    if !empty {
        write_indent(out, options, depth);
    }
    out.push(close);
    Ok(())
}

/// A new line indented `depth` units, when the options indent.
fn write_indent(out: &mut BoundedText, options: &JsonOptions, depth: usize) {
    let Some(unit) = &options.indent else { return };
    out.push('\n');
    for _ in 0..depth {
        out.push_str(unit);
        if out.is_over() {
            return;
        }
    }
}

/// A JSON string as json.dumps writes it: `"` `\` and control characters escaped (`\n`, `\u001b`), and with
/// `ensure_ascii` everything outside printable ASCII as `\uXXXX` (surrogate pairs above U+FFFF).
fn write_json_str(out: &mut BoundedText, text: &str, ensure_ascii: bool) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn float(number: f64) -> String {
        let mut out = String::new();
        write_float(&mut out, number, FloatStyle::Repr);
        out
    }

    #[test]
    fn floats_print_as_python_repr() {
        assert_eq!(float(1.0), "1.0");
        assert_eq!(float(-0.0), "-0.0");
        assert_eq!(float(0.1), "0.1");
        assert_eq!(float(1.5), "1.5");
        assert_eq!(float(0.0001), "0.0001");
        assert_eq!(float(0.00001), "1e-05");
        assert_eq!(float(1e15), "1000000000000000.0");
        assert_eq!(float(1e16), "1e+16");
        assert_eq!(float(1.5e300), "1.5e+300");
        assert_eq!(float(123456789.125), "123456789.125");
        assert_eq!(float(f64::INFINITY), "inf");
        assert_eq!(float(f64::NAN), "nan");
    }

    #[test]
    fn strings_repr_as_python() {
        let repr = |text: &str| {
            let mut out = BoundedText::with_limit(usize::MAX);
            write_str_repr(&mut out, text);
            out.finish("repr").unwrap()
        };
        assert_eq!(repr("plain"), "'plain'");
        assert_eq!(repr("it's"), "\"it's\"");
        assert_eq!(repr("it's \"x\""), "'it\\'s \"x\"'");
        assert_eq!(repr("a\nb\\c\u{7}\u{a0}é🚀"), "'a\\nb\\\\c\\x07\\xa0é🚀'");
        assert_eq!(repr("\u{200b}\u{feff}"), "'\\u200b\\ufeff'");
    }

    #[test]
    fn containers_print_as_python() {
        let value = Value::from(minijinja::value::Serde(serde_json::json!({"a": [1, 2.5, null, true, "x"], "b": {}})));
        let py_str = |value: &Value| py_str_within(value, usize::MAX).unwrap();
        assert_eq!(py_str(&value), "{'a': [1, 2.5, None, True, 'x'], 'b': {}}");
        assert_eq!(py_str(&Value::from("text")), "text");
        assert_eq!(py_str(&Value::UNDEFINED), "");
    }
}
