//! The builtins that can create far more data than they are given, rewritten to pay for it first
//! (budget.rs says why). Each behaves as the minijinja or minijinja-contrib builtin it replaces; only
//! the budget checks are new.

use minijinja::value::{from_args, ValueKind};
use minijinja::{Error, ErrorKind, State, Value};

use crate::budget::{self, BoundedText};

/// Python's methods on values (minijinja-contrib's pycompat), with the ones that allocate more than
/// their receiver checked against the render's budget first.
pub(crate) fn method_callback(state: &mut State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    if let Some(text) = value.as_str().filter(|_| value.kind() == ValueKind::String) {
        match method {
            "split" => {
                let (separator, max_splits): (Option<&str>, Option<i64>) = from_args(args)?;
                return split(state, value, text, separator, max_splits, "str.split");
            }
            "splitlines" => {
                let (keep_ends,): (Option<bool>,) = from_args(args)?;
                return split_lines(state, value, text, keep_ends.unwrap_or(false), "str.splitlines");
            }
            "join" => {
                let (items,): (&Value,) = from_args(args)?;
                return join(state, text, items);
            }
            "format" => return format(state, text, args),
            // Case changes and `replace` may grow the text (a character's upper case can be three);
            // `replace` pays for its growth itself.
            "upper" | "lower" | "title" | "capitalize" => {
                budget::ensure_bytes(state, (text.len() as u64).saturating_mul(3), &format!("str.{method}"))?;
            }
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// The `split` filter: `text|split`, `text|split(",")`, `text|split(",", 1)`.
pub(crate) fn split_filter(
    state: &State,
    value: &Value,
    separator: Option<&str>,
    max_splits: Option<i64>,
) -> Result<Value, Error> {
    let text = string_of(value, "split")?;
    split(state, value, text, separator, max_splits, "split")
}

/// The `lines` filter.
pub(crate) fn lines_filter(state: &State, value: &Value) -> Result<Value, Error> {
    let text = string_of(value, "lines")?;
    split_lines(state, value, text, false, "lines")
}

fn string_of<'a>(value: &'a Value, filter: &str) -> Result<&'a str, Error> {
    value.as_str().ok_or_else(|| {
        Error::new(ErrorKind::InvalidOperation, format!("the {filter} filter needs a string, not {}", value.kind()))
    })
}

/// `str.split(sep=None, maxsplit=-1)` as minijinja splits: on runs of whitespace without a separator,
/// at most `maxsplit` times when it is not negative. The pieces are counted before the list is made.
fn split(
    state: &State,
    value: &Value,
    text: &str,
    separator: Option<&str>,
    max_splits: Option<i64>,
    what: &str,
) -> Result<Value, Error> {
    let max_pieces = max_splits.and_then(|n| usize::try_from(n).ok()).map(|n| n.saturating_add(1));
    let pieces = || -> Box<dyn Iterator<Item = &str> + '_> {
        match (separator, max_pieces) {
            (None, None) => Box::new(text.split_whitespace()),
            (Some(separator), None) => Box::new(text.split(separator)),
            (None, Some(n)) => Box::new(splitn_whitespace(text, n)),
            (Some(separator), Some(n)) => Box::new(text.splitn(n, separator)),
        }
    };
    list_of_pieces(state, value, text, pieces, what)
}

/// Python's `str.splitlines(keepends)` as minijinja-contrib does it: lines end at `\n` (and a `\r`
/// before it, unless the ends are kept).
fn split_lines(state: &State, value: &Value, text: &str, keep_ends: bool, what: &str) -> Result<Value, Error> {
    if keep_ends {
        list_of_pieces(state, value, text, || Box::new(text.split_inclusive('\n')), what)
    } else {
        list_of_pieces(state, value, text, || Box::new(text.lines()), what)
    }
}

/// A list of the pieces `pieces()` yields, paid for before it is made: the pieces are counted first
/// (a pass over the text that allocates nothing; minijinja charged the call for the text), and the
/// list is made at its final size. Pieces of a safe string stay safe, as in minijinja.
fn list_of_pieces<'a>(
    state: &State,
    value: &Value,
    text: &'a str,
    pieces: impl Fn() -> Box<dyn Iterator<Item = &'a str> + 'a>,
    what: &str,
) -> Result<Value, Error> {
    let count = pieces().count();
    budget::ensure_list(state, count, text.len(), what)?;
    let safe = value.is_safe();
    let mut items = Vec::with_capacity(count);
    items.extend(
        pieces().map(|piece| if safe { Value::from_safe_string(piece.to_owned()) } else { Value::from(piece) }),
    );
    Ok(Value::from(items))
}

/// minijinja's `split` without a separator and with a limit: Python's `str.split(None, n)`, which
/// skips leading whitespace and keeps the rest after the last split as it is.
fn splitn_whitespace(text: &str, max_pieces: usize) -> impl Iterator<Item = &str> + '_ {
    let mut pieces = 1;
    let mut skipping_whitespace = true;
    let mut piece_start = None;
    let mut chars = text.char_indices();
    std::iter::from_fn(move || {
        for (index, c) in chars.by_ref() {
            if pieces >= max_pieces && !skipping_whitespace {
                continue;
            } else if c.is_whitespace() {
                if let Some(start) = piece_start.take() {
                    pieces += 1;
                    skipping_whitespace = true;
                    return Some(&text[start..index]);
                }
            } else {
                skipping_whitespace = false;
                piece_start.get_or_insert(index);
            }
        }
        piece_start.take().map(|start| &text[start..])
    })
}

/// `separator.join(items)`: each item printed as `{item}`, the text never past the budget (a lazily
/// repeated list of long strings would otherwise print gigabytes).
fn join(state: &State, separator: &str, items: &Value) -> Result<Value, Error> {
    let mut out = BoundedText::for_state(state);
    for (index, item) in items.try_iter()?.checked().enumerate() {
        let item = item?;
        budget::charge_item(state)?;
        if index > 0 {
            out.push_str(separator);
        }
        match item.as_str() {
            Some(text) => out.push_str(text),
            None => {
                let _ = std::fmt::Write::write_fmt(&mut out, format_args!("{item}"));
            }
        }
        if out.is_over() {
            break;
        }
    }
    out.finish("str.join").map(Value::from)
}

/// `str.format(*args)`: the arguments are printed within the budget first, and the widths and
/// precisions the format asks for are paid for before formatting (`'{:>100000000}'.format(1)`).
fn format(state: &State, text: &str, args: &[Value]) -> Result<Value, Error> {
    let mut printed: u64 = text.len() as u64;
    for arg in args {
        printed = printed.saturating_add(budget::display(state, arg, "str.format")?.len() as u64);
    }
    budget::ensure_bytes(state, printed.saturating_add(requested_widths(text)), "str.format")?;
    minijinja::formatting::format(minijinja::formatting::FormatStyle::StrFormat, text, args).map(Value::from)
}

/// The sum of the numbers in the format specs of `text` (`{:>20.5}` asks for 25 bytes): more than
/// the widths and precisions the format can pad to.
fn requested_widths(text: &str) -> u64 {
    let mut total: u64 = 0;
    for field in text.split('{').skip(1) {
        let Some((_, spec)) = field.split_once('}').map(|(inside, _)| inside).and_then(|inside| inside.split_once(':'))
        else {
            continue;
        };
        for number in spec.split(|c: char| !c.is_ascii_digit()).filter(|run| !run.is_empty()) {
            total = total.saturating_add(number.parse::<u64>().unwrap_or(u64::MAX));
        }
    }
    total
}
