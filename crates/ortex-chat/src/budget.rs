//! The render budget: how much work and memory one render may use.
//!
//! A chat template is code from the model folder, and it runs at every chat request; a template that
//! loops forever or builds a gigabyte string must fail, not hang or exhaust the process. The budget is
//! minijinja's fuel: one fuel an instruction, and one fuel for every 64 bytes of data the render
//! creates (strings, list slots, the output). Since fuel only goes down, [`RENDER_FUEL`] bounds both
//! the time a render takes and the data it creates ([`RENDER_DATA_BYTES`]).
//!
//! minijinja checks what its operators (`~`, `+`, `*`) and most filters create before allocating it.
//! The builtins that did not, and allocated gigabytes before the fuel ran out (minijinja's `split` and
//! `lines` filters; minijinja-contrib's `str.split`, `str.splitlines`, `str.join` and `str.format`),
//! and this crate's own printing (`{{ value }}`, `string`, `tojson`, `raise_exception`), go through
//! the functions here: each refuses to create what the fuel left cannot pay for before it allocates.

use std::fmt;

use minijinja::{Error, ErrorKind, State, Value};

/// The fuel of one render (1,048,576). The fixtures' templates spend 25-100 fuel a message and 47,000
/// to 78,000 for a megabyte of message text (they copy it a few times), so this renders conversations
/// of 10,000 messages or 13 MB of text (more than any model's context holds), and stops a runaway
/// template after about a twentieth of a second of a release build, having created at most
/// [`RENDER_DATA_BYTES`]. Its allocations peak at about twice that: minijinja copies a string it made
/// into its own storage, and a growing string or list may hold up to twice its length.
pub const RENDER_FUEL: u64 = 1 << 20;

/// minijinja charges one fuel for every this many bytes of data (its `UNITS_PER_FUEL`).
pub(crate) const BYTES_PER_FUEL: u64 = 64;

/// The most data one render may create, in bytes (64 MiB): strings, list slots and the output.
pub const RENDER_DATA_BYTES: u64 = RENDER_FUEL * BYTES_PER_FUEL;

/// What one slot of a list costs, in bytes: a value is 24 bytes, the rest is the list's headroom
/// (minijinja's `SLOT_COST`).
const SLOT_BYTES: u64 = 32;

/// The bytes the rest of this render's fuel can pay for; unbounded when fuel is off.
pub(crate) fn bytes_left(state: &State) -> u64 {
    state.fuel_levels().map_or(u64::MAX, |(_, remaining)| remaining.saturating_mul(BYTES_PER_FUEL))
}

/// Fails unless the fuel left can pay for `bytes` more. minijinja charges a filter's or method's
/// result once it exists; this check comes before the allocation.
pub(crate) fn ensure_bytes(state: &State, bytes: u64, what: &str) -> Result<(), Error> {
    if bytes < bytes_left(state) {
        Ok(())
    } else {
        Err(exceeded(format!("{what} would create {}", describe_bytes(bytes))))
    }
}

/// [`ensure_bytes`] for a list of `items` whose strings hold `text_bytes` in all.
pub(crate) fn ensure_list(state: &State, items: usize, text_bytes: usize, what: &str) -> Result<(), Error> {
    let bytes = (items as u64).saturating_mul(SLOT_BYTES).saturating_add(text_bytes as u64);
    if bytes < bytes_left(state) {
        Ok(())
    } else {
        Err(exceeded(format!("{what} would create a list of {items} items ({})", describe_bytes(bytes))))
    }
}

/// Charges one fuel for visiting an item, as minijinja's own filters do: a loop over a lazily
/// repeated list (`[''] * 100000000`) that creates nothing still ends with the budget.
pub(crate) fn charge_item(state: &State) -> Result<(), Error> {
    state.consume_fuel(1)
}

/// The error of a render over budget. The renderer names the limit (see `template::render_error`).
pub(crate) fn exceeded(detail: String) -> Error {
    Error::new(ErrorKind::OutOfFuel, detail)
}

fn describe_bytes(bytes: u64) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{bytes} bytes")
    }
}

/// Text that may grow only up to a limit: a write past it fails (with `fmt::Error`, so a `Display`
/// of a huge value stops at that point) and marks the text as over.
pub(crate) struct BoundedText {
    text: String,
    limit: usize,
    over: bool,
}

impl BoundedText {
    /// Text limited to what the render's fuel left can pay for.
    pub(crate) fn for_state(state: &State) -> BoundedText {
        BoundedText::with_limit(usize::try_from(bytes_left(state)).unwrap_or(usize::MAX))
    }

    pub(crate) fn with_limit(limit: usize) -> BoundedText {
        BoundedText { text: String::new(), limit, over: false }
    }

    /// Whether a write was refused; the text is then incomplete.
    pub(crate) fn is_over(&self) -> bool {
        self.over
    }

    pub(crate) fn push(&mut self, c: char) {
        let mut buffer = [0u8; 4];
        self.push_str(c.encode_utf8(&mut buffer));
    }

    pub(crate) fn push_str(&mut self, text: &str) {
        let _ = fmt::Write::write_str(self, text);
    }

    /// The text, or the budget error naming `what` if a write was refused.
    pub(crate) fn finish(self, what: &str) -> Result<String, Error> {
        if self.over {
            Err(exceeded(format!(
                "{what} would print more than the {} the render has left",
                describe_bytes(self.limit as u64)
            )))
        } else {
            Ok(self.text)
        }
    }
}

impl fmt::Write for BoundedText {
    fn write_str(&mut self, text: &str) -> fmt::Result {
        let len = self.text.len();
        if self.over || text.len() > self.limit - len {
            self.over = true;
            return Err(fmt::Error);
        }
        if text.len() > self.text.capacity() - len {
            // Doubling, as `String` does, but never past the limit.
            let capacity = (2 * self.text.capacity()).max(len + text.len()).min(self.limit);
            self.text.reserve_exact(capacity - len);
        }
        self.text.push_str(text);
        Ok(())
    }
}

/// `value` as `{value}` (minijinja's form) within the render's budget.
pub(crate) fn display(state: &State, value: &Value, what: &str) -> Result<String, Error> {
    if let Some(text) = value.as_str() {
        ensure_bytes(state, text.len() as u64, what)?;
        return Ok(text.to_owned());
    }
    let mut out = BoundedText::for_state(state);
    let _ = fmt::Write::write_fmt(&mut out, format_args!("{value}"));
    out.finish(what)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_text_refuses_what_would_pass_its_limit() {
        let mut text = BoundedText::with_limit(5);
        text.push_str("abc");
        text.push('d');
        assert!(!text.is_over());
        text.push_str("ef");
        assert!(text.is_over());
        // Nothing is written after the first refusal, even what would fit.
        text.push('g');
        assert!(text.finish("it").is_err());
        let mut text = BoundedText::with_limit(4);
        text.push_str("abcd");
        assert_eq!(text.finish("it").unwrap(), "abcd");
    }
}
