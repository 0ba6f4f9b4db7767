//! A turn's output as text: the core detokenizes each generated token, finds the turn's stop
//! strings in the text and gives log-probabilities their token text, so that an event carries
//! its text delta and the facade computes nothing per token.
//!
//! [`Detokenizer`] decodes incrementally over a small window of the turn's generated tokens, the
//! approach of Hugging Face text-generation-inference and vLLM (`detokenize_incrementally`, with
//! its `prefix_offset` / `read_offset`):
//!
//! ```text
//!   generated: ... | prefix window        | unread tokens        |
//!                  ^prefix_offset          ^read_offset           ^n
//!   delta = decode(tokens[prefix_offset..n]) minus decode(tokens[prefix_offset..read_offset])
//! ```
//!
//! Decoding the prefix along with the new tokens gives a tokenizer the context it needs (a
//! SentencePiece model drops or adds a leading space by context; a byte-level model needs the
//! bytes of a character that spans tokens). The delta is emitted only when the decoded window
//! does not end in U+FFFD (an incomplete UTF-8 sequence that the next token may complete); then
//! the window slides forward. A window of more than [`MAX_PENDING_TOKENS`] unread tokens is
//! emitted anyway: a model may really produce invalid UTF-8, and the window must stay small.
//!
//! [`StopMatcher`] finds the turn's stop strings in that text. Text that could be the beginning
//! of a stop string is held back until the next delta decides, so no event ever carries part of
//! one; the text ends just before the earliest stop string found (of two at one place, the
//! earlier in the list), and the turn finishes in the transaction that produced it.
//!
//! [`TurnText`] is both, per turn. A transaction's draws carry a copy of it (draws.rs): the text
//! is made where the token is sampled (the engine's thread on native), and the copy is handed
//! back at commit, as the generator is.

use std::sync::Arc;

use crate::sampling::TokenLogprobs;
use crate::text::TextCodec;

/// Unread tokens the detokenizer may hold back before it emits their text even though it ends
/// in U+FFFD.
pub const MAX_PENDING_TOKENS: usize = 16;
const REPLACEMENT: char = '\u{FFFD}';

/// Token ids in, text deltas out (the module comment's window).
#[derive(Debug, Default)]
pub struct Detokenizer {
    /// `generated[prefix_offset..n]`: what the next decode reads.
    window: Vec<i32>,
    /// `window[..read]` is the prefix, already emitted; `window[read..]` is unread.
    read: usize,
    /// `decode(window[..read])`.
    prefix_text: String,
    /// `decode(window)`, a buffer reused by every token (not part of the state: not cloned).
    decoded: String,
}

/// A copy reuses the buffers of the one it overwrites (`clone_from`): a transaction's draws copy
/// each row's text state at every step.
impl Clone for Detokenizer {
    fn clone(&self) -> Detokenizer {
        let mut copy = Detokenizer::default();
        copy.clone_from(self);
        copy
    }

    fn clone_from(&mut self, source: &Detokenizer) {
        self.window.clone_from(&source.window);
        self.read = source.read;
        self.prefix_text.clone_from(&source.prefix_text);
    }
}

impl Detokenizer {
    /// Appends to `out` the text that `token` (the turn's newest) completes; nothing while it is
    /// held back.
    pub fn next(&mut self, codec: &dyn TextCodec, token: i32, out: &mut String) {
        self.window.push(token);
        decode_into(codec, &self.window, &mut self.decoded);
        let text = &self.decoded;
        let overdue = self.window.len() - self.read > MAX_PENDING_TOKENS;
        let delta = after_prefix(text, &self.prefix_text);
        if !overdue && (text.ends_with(REPLACEMENT) || delta.is_empty()) {
            return;
        }
        out.push_str(delta);
        self.window.drain(..self.read);
        self.read = self.window.len();
        decode_into(codec, &self.window, &mut self.prefix_text);
    }

    /// At the end of the turn: appends the held-back text, complete or not.
    pub fn flush(&mut self, codec: &dyn TextCodec, out: &mut String) {
        if self.window.len() > self.read {
            decode_into(codec, &self.window, &mut self.decoded);
            out.push_str(after_prefix(&self.decoded, &self.prefix_text));
        }
        self.window.clear();
        self.read = 0;
        self.prefix_text.clear();
    }
}

/// `decode(tokens)` into `out`, replacing what it held. A window the codec cannot decode (an id
/// outside its vocabulary, which the engine never samples) reads as no text rather than failing
/// the turn.
fn decode_into(codec: &dyn TextCodec, tokens: &[i32], out: &mut String) {
    out.clear();
    if codec.detokenize_into(tokens, out).is_err() {
        out.clear();
    }
}

fn decode(codec: &dyn TextCodec, tokens: &[i32]) -> String {
    let mut text = String::new();
    decode_into(codec, tokens, &mut text);
    text
}

/// `text` past `prefix`. A tokenizer may decode a longer window into text that does not begin
/// with the shorter one's; then the prefix's length in UTF-16 units is skipped, as the
/// TypeScript detokenizer this replaces did (`text.slice(prefixText.length)`).
fn after_prefix<'t>(text: &'t str, prefix: &str) -> &'t str {
    if let Some(rest) = text.strip_prefix(prefix) {
        return rest;
    }
    let skip = prefix.encode_utf16().count();
    let mut units = 0;
    for (at, c) in text.char_indices() {
        if units >= skip {
            return &text[at..];
        }
        units += c.len_utf16();
    }
    ""
}

/// A turn's stop strings, matched in its text as it streams.
#[derive(Debug)]
pub struct StopMatcher {
    stops: Arc<[String]>,
    /// The longest stop string's length in bytes.
    longest: usize,
    /// Text not yet emitted: the suffix that could begin a stop string.
    pending: String,
}

impl Clone for StopMatcher {
    fn clone(&self) -> StopMatcher {
        StopMatcher { stops: Arc::clone(&self.stops), longest: self.longest, pending: self.pending.clone() }
    }

    fn clone_from(&mut self, source: &StopMatcher) {
        self.stops = Arc::clone(&source.stops);
        self.longest = source.longest;
        self.pending.clone_from(&source.pending);
    }
}

impl StopMatcher {
    /// None when there are no stop strings. Each one is non-empty (options.rs checks).
    pub fn new(stops: Arc<[String]>) -> Option<StopMatcher> {
        let longest = stops.iter().map(String::len).max()?;
        Some(StopMatcher { stops, longest, pending: String::new() })
    }

    /// Adds `delta`; appends to `out` the text now safe to emit. When a stop string appears,
    /// returns its index: `out` then ends just before it, and nothing more is emitted.
    pub fn push(&mut self, delta: &str, out: &mut String) -> Option<u32> {
        self.pending.push_str(delta);
        if let Some((at, index)) = self.earliest_stop() {
            out.push_str(&self.pending[..at]);
            self.pending.clear();
            return Some(index);
        }
        let safe = self.pending.len() - self.held_back();
        out.push_str(&self.pending[..safe]);
        self.pending.drain(..safe);
        None
    }

    /// At the end of the turn: appends the held-back text.
    pub fn flush(&mut self, out: &mut String) {
        out.push_str(&self.pending);
        self.pending.clear();
    }

    /// Where the earliest stop string begins in the pending text, and its index; of two at one
    /// place, the earlier in the list. Emitted text never holds the start of one (it was held
    /// back while it could), so the pending text is all there is to search.
    fn earliest_stop(&self) -> Option<(usize, u32)> {
        let mut found: Option<(usize, u32)> = None;
        for (index, stop) in self.stops.iter().enumerate() {
            if let Some(at) = self.pending.find(stop.as_str()) {
                if found.is_none_or(|(best, _)| at < best) {
                    found = Some((at, index as u32));
                }
            }
        }
        found
    }

    /// Bytes of the longest suffix of the pending text that begins some stop string.
    fn held_back(&self) -> usize {
        let len = self.pending.len();
        let max = (self.longest - 1).min(len);
        (1..=max)
            .rev()
            .filter(|&k| self.pending.is_char_boundary(len - k))
            .find(|&k| {
                let tail = &self.pending[len - k..];
                self.stops.iter().any(|stop| stop.starts_with(tail))
            })
            .unwrap_or(0)
    }
}

/// What a token (or a turn's end) added to the turn's text.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TextStep {
    pub text: String,
    /// The stop string that ended the text (its index in the turn's `stop`).
    pub stop: Option<u32>,
}

/// One turn's text state: its detokenizer and its stop strings.
#[derive(Debug, Default)]
pub struct TurnText {
    detokenizer: Detokenizer,
    stops: Option<StopMatcher>,
}

impl Clone for TurnText {
    fn clone(&self) -> TurnText {
        TurnText { detokenizer: self.detokenizer.clone(), stops: self.stops.clone() }
    }

    fn clone_from(&mut self, source: &TurnText) {
        self.detokenizer.clone_from(&source.detokenizer);
        self.stops.clone_from(&source.stops);
    }
}

impl TurnText {
    pub fn new(stops: Option<Arc<[String]>>) -> TurnText {
        TurnText { detokenizer: Detokenizer::default(), stops: stops.and_then(StopMatcher::new) }
    }

    /// The text the turn's newest `token` adds, up to a stop string when one appears.
    pub fn push(&mut self, codec: &dyn TextCodec, token: i32) -> TextStep {
        let mut delta = String::new();
        self.detokenizer.next(codec, token, &mut delta);
        self.matched(delta, false)
    }

    /// At the end of the turn: the text held back (an incomplete character, the beginning of a
    /// stop string), up to a stop string if the rest of the text holds one.
    pub fn finish(&mut self, codec: &dyn TextCodec) -> TextStep {
        let mut rest = String::new();
        self.detokenizer.flush(codec, &mut rest);
        self.matched(rest, true)
    }

    fn matched(&mut self, delta: String, last: bool) -> TextStep {
        let Some(stops) = &mut self.stops else { return TextStep { text: delta, stop: None } };
        let mut text = String::with_capacity(delta.len());
        let stop = stops.push(&delta, &mut text);
        if stop.is_none() && last {
            stops.flush(&mut text);
        }
        TextStep { text, stop }
    }
}

/// The whole text a turn's generated `tokens` made, as its events carried it when no stop string
/// cut it: what a conversation compares with its next render (crates/ortex-boundary's
/// conversation.rs), made again from the tokens rather than kept beside every turn.
pub fn turn_text(codec: &dyn TextCodec, tokens: &[i32]) -> String {
    let mut detokenizer = Detokenizer::default();
    let mut text = String::new();
    for &token in tokens {
        detokenizer.next(codec, token, &mut text);
    }
    detokenizer.flush(codec, &mut text);
    text
}

/// A token's log-probabilities with the text of the token and of each alternative (each decoded
/// alone, as OpenAI's `logprobs.content[].token` reports it).
#[derive(Debug, Clone, PartialEq)]
pub struct LogprobsText {
    pub entry: TokenLogprobs,
    pub token_text: String,
    /// `top_texts[i]` is the text of `entry.top[i]`.
    pub top_texts: Vec<String>,
}

impl LogprobsText {
    pub fn new(codec: &dyn TextCodec, entry: TokenLogprobs) -> LogprobsText {
        let text_of = |id: u32| decode(codec, &[id as i32]);
        LogprobsText {
            token_text: text_of(entry.token),
            top_texts: entry.top.iter().map(|&(id, _)| text_of(id)).collect(),
            entry,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::SimText;

    fn codec() -> SimText {
        SimText { vocab_size: 32000 }
    }

    /// Every delta of `tokens` through a TurnText, then its finish.
    fn stream(stops: &[&str], tokens: &[i32]) -> (Vec<String>, Option<u32>) {
        let codec = codec();
        let stops: Option<Arc<[String]>> = (!stops.is_empty()).then(|| stops.iter().map(|s| s.to_string()).collect());
        let mut text = TurnText::new(stops);
        let mut deltas = Vec::new();
        for &token in tokens {
            let step = text.push(&codec, token);
            deltas.push(step.text);
            if step.stop.is_some() {
                return (deltas, step.stop);
            }
        }
        let last = text.finish(&codec);
        deltas.push(last.text);
        (deltas, last.stop)
    }

    #[test]
    fn a_turns_text_made_again_from_its_tokens_is_what_its_events_carried() {
        let codec = codec();
        for text in ["aé✓b", "plain words", "é"] {
            let tokens = codec.tokenize(text).unwrap();
            for end in 0..=tokens.len() {
                // Stop strings that never match hold text back but give it all at the finish.
                for stops in [&[][..], &["zz", "✓bq"][..]] {
                    let (deltas, stop) = stream(stops, &tokens[..end]);
                    assert_eq!(stop, None);
                    assert_eq!(turn_text(&codec, &tokens[..end]), deltas.concat(), "{text} up to {end}, {stops:?}");
                }
            }
        }
    }

    #[test]
    fn a_character_split_across_tokens_is_held_back_until_complete() {
        let tokens = codec().tokenize("aé✓b").unwrap();
        let (deltas, stop) = stream(&[], &tokens);
        // é is two byte tokens, ✓ three: each emits once its last byte arrives.
        assert_eq!(deltas, ["a", "", "é", "", "", "✓", "b", ""]);
        assert_eq!(stop, None);
    }

    #[test]
    fn an_incomplete_character_at_the_end_is_flushed_as_replacement() {
        let tokens = codec().tokenize("é").unwrap();
        let (deltas, _) = stream(&[], &tokens[..1]);
        assert_eq!(deltas, ["", "\u{FFFD}"]);
    }

    #[test]
    fn a_window_of_invalid_utf8_is_emitted_once_overdue() {
        // 0xFF never completes a character: the window is emitted after MAX_PENDING_TOKENS.
        let bad: i32 = 3 + 0xFF;
        let (deltas, _) = stream(&[], &[bad; MAX_PENDING_TOKENS + 2]);
        assert!(deltas[..MAX_PENDING_TOKENS].iter().all(String::is_empty), "{deltas:?}");
        assert_eq!(deltas[MAX_PENDING_TOKENS].chars().count(), MAX_PENDING_TOKENS + 1);
        assert_eq!(deltas.concat().chars().count(), MAX_PENDING_TOKENS + 2);
    }

    #[test]
    fn word_tokens_stream_their_text() {
        let (deltas, _) = stream(&[], &[259, 260, 3 + b'!' as i32]);
        assert_eq!(deltas, [" baba", " daba", "!", ""]);
    }

    #[test]
    fn a_stop_string_spanning_tokens_ends_the_text_before_it() {
        let tokens = codec().tokenize("say STOP now").unwrap();
        let (deltas, stop) = stream(&["xyz", "STOP"], &tokens);
        assert_eq!(stop, Some(1));
        assert_eq!(deltas.concat(), "say ");
        // "S", "T", "O" were held back (they could begin STOP); the P token found it.
        assert_eq!(deltas.len(), "say STOP".len());
    }

    #[test]
    fn the_earliest_stop_wins_and_ties_go_to_the_first_listed() {
        let codec = codec();
        let mut matcher = StopMatcher::new(["cd", "bc", "b"].iter().map(|s| s.to_string()).collect()).unwrap();
        let mut out = String::new();
        assert_eq!(matcher.push("abcd", &mut out), Some(1));
        assert_eq!(out, "a");
        let (deltas, stop) = stream(&["bc", "b"], &codec.tokenize("abc").unwrap());
        assert_eq!((deltas.concat().as_str(), stop), ("a", Some(1)), "b alone is found first");
    }

    #[test]
    fn held_back_text_that_never_becomes_a_stop_is_emitted() {
        let (deltas, stop) = stream(&["STOP"], &codec().tokenize("a STO").unwrap());
        assert_eq!(stop, None);
        assert_eq!(deltas, ["a", " ", "", "", "", "STO"]);
        let (deltas, _) = stream(&["STOP"], &codec().tokenize("STAR").unwrap());
        assert_eq!(deltas, ["", "", "STA", "R", ""]);
    }

    #[test]
    fn a_multibyte_stop_string_is_matched_at_character_boundaries() {
        let (deltas, stop) = stream(&["✓✓"], &codec().tokenize("ok✓!✓✓x").unwrap());
        assert_eq!(stop, Some(0));
        assert_eq!(deltas.concat(), "ok✓!");
    }

    #[test]
    fn text_after_a_prefix_that_changed_skips_its_utf16_length() {
        assert_eq!(after_prefix("abcdef", "abc"), "def");
        assert_eq!(after_prefix("xbcdef", "abc"), "def");
        assert_eq!(after_prefix("😀def", "ab"), "def", "one astral character is two units");
        assert_eq!(after_prefix("ab", "abc"), "");
    }

    #[test]
    fn logprobs_carry_each_tokens_text() {
        let entry = TokenLogprobs { token: 259, logprob: -0.5, top: vec![(3 + b'a' as u32, -1.0), (260, -2.0)] };
        let texted = LogprobsText::new(&codec(), entry);
        assert_eq!(texted.token_text, " baba");
        assert_eq!(texted.top_texts, ["a", " daba"]);
    }

    /// A model test: whatever the split of a text into tokens and the stop strings, the streamed
    /// deltas concatenate to the text up to the first stop string to appear as the text grows
    /// (of those, the one that begins first, then the first listed), and no delta holds part of
    /// one.
    #[test]
    fn streamed_text_matches_the_whole_text_cut_at_the_first_stop() {
        let mut rng = crate::rng::Rng::new(7);
        let alphabet = ["a", "b", "é", "✓", " "];
        for _ in 0..2000 {
            let len = 1 + rng.below(12) as usize;
            let text: String = (0..len).map(|_| alphabet[rng.below(5) as usize]).collect();
            let stops: Vec<String> = (0..1 + rng.below(3))
                .map(|_| (0..1 + rng.below(3)).map(|_| alphabet[rng.below(5) as usize]).collect())
                .collect();
            let stop_refs: Vec<&str> = stops.iter().map(String::as_str).collect();
            let (deltas, stop) = stream(&stop_refs, &codec().tokenize(&text).unwrap());
            let ends = text.char_indices().map(|(at, c)| at + c.len_utf8());
            let first = ends
                .filter_map(|end| {
                    let seen = &text[..end];
                    let found =
                        stops.iter().enumerate().filter_map(|(i, s)| seen.find(s.as_str()).map(|at| (at, i as u32)));
                    found.min()
                })
                .next();
            let expected = first.map_or(text.as_str(), |(at, _)| &text[..at]);
            assert_eq!(deltas.concat(), expected, "text {text:?} stops {stops:?}");
            assert_eq!(stop, first.map(|(_, i)| i), "text {text:?} stops {stops:?}");
        }
    }
}
