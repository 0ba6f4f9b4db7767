// Streaming text: token ids in, text deltas out, and `stop` strings found in that text.
//
// Detokenizing token by token is wrong for real tokenizers (a multi-byte character spans tokens;
// SentencePiece drops or adds a leading space depending on context), and detokenizing the whole
// turn at every token is quadratic. StreamingDetokenizer decodes a small window instead (the
// approach of Hugging Face text-generation-inference):
//
//   tokens:  ... | prefix window          | new tokens            |
//                 ^prefixOffset            ^readOffset             ^n
//   delta = decode(tokens[prefixOffset:n]) minus decode(tokens[prefixOffset:readOffset])
//
// The delta is emitted only when the decoded window does not end in U+FFFD (an incomplete UTF-8
// sequence, which the next token may complete); then the window slides forward.

/** A window of pending tokens longer than this is emitted even if it ends in U+FFFD (a model may
 *  really produce invalid UTF-8, and the window must stay small). */
const MAX_PENDING_TOKENS = 16
const REPLACEMENT = '\uFFFD'

export type Decode = (tokens: Int32Array) => string

export class StreamingDetokenizer {
  private prefixOffset = 0
  private readOffset = 0
  private prefixText = ''

  constructor(private readonly decode: Decode) {}

  /** `tokens[0:n]` is every token so far, the newest last. Returns the text the newest token
   *  completes ('' while it is held back). */
  next(tokens: Int32Array, n: number): string {
    const text = this.decode(tokens.subarray(this.prefixOffset, n))
    const overdue = n - this.readOffset > MAX_PENDING_TOKENS
    if (!overdue && (text.endsWith(REPLACEMENT) || text.length <= this.prefixText.length)) return ''
    const delta = text.slice(this.prefixText.length)
    this.prefixOffset = this.readOffset
    this.readOffset = n
    this.prefixText = this.decode(tokens.subarray(this.prefixOffset, this.readOffset))
    return delta
  }

  /** At the end of the turn: the held-back text, incomplete or not. */
  flush(tokens: Int32Array, n: number): string {
    if (n <= this.readOffset) return ''
    const text = this.decode(tokens.subarray(this.prefixOffset, n))
    this.prefixOffset = this.readOffset = n
    const delta = text.slice(this.prefixText.length)
    this.prefixText = ''
    return delta
  }
}

/**
 * Finds `stop` strings in streamed text. The core has no text, so the facade matches them and
 * tells the core which one ended the turn (finishReason 'stop' with the string's index); the
 * text is cut just before the earliest stop string. Text that could be the beginning of a stop
 * string is held back until the next delta decides, so a consumer never sees part of one.
 */
export class StopMatcher {
  private text = ''
  private emitted = 0
  private readonly longest: number

  constructor(private readonly stops: readonly string[]) {
    this.longest = Math.max(...stops.map((s) => s.length))
  }

  /** Adds a delta; returns the text now safe to emit and, when a stop string was found, its
   *  index in `stops` (then the returned text ends just before it, and nothing more will be
   *  emitted). Of two found at the same place, the earlier in `stops` wins. */
  push(delta: string): { text: string; stopIndex: number | null } {
    const from = Math.max(0, this.emitted - this.longest + 1)
    this.text += delta
    let found = -1
    let stopIndex: number | null = null
    this.stops.forEach((stop, index) => {
      const at = this.text.indexOf(stop, from)
      if (at !== -1 && (found === -1 || at < found)) {
        found = at
        stopIndex = index
      }
    })
    if (stopIndex !== null) {
      const out = found > this.emitted ? this.text.slice(this.emitted, found) : ''
      this.emitted = Math.max(this.emitted, found)
      return { text: out, stopIndex }
    }
    const safe = this.text.length - this.heldBack()
    const out = this.text.slice(this.emitted, safe)
    this.emitted = safe
    // Keep only what a future match can still touch.
    if (this.emitted > 4 * this.longest + 256) {
      const cut = this.emitted - this.longest
      this.text = this.text.slice(cut)
      this.emitted -= cut
    }
    return { text: out, stopIndex: null }
  }

  /** At the end of the turn: the held-back text. */
  flush(): string {
    const out = this.text.slice(this.emitted)
    this.emitted = this.text.length
    return out
  }

  /** Length of the longest suffix of the text that begins some stop string. */
  private heldBack(): number {
    const max = Math.min(this.longest - 1, this.text.length - this.emitted)
    for (let k = max; k > 0; k--) {
      const tail = this.text.slice(this.text.length - k)
      if (this.stops.some((s) => s.startsWith(tail))) return k
    }
    return 0
  }
}
