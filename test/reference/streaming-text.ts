// The facade's streaming text as it was before the core made it (ts/text.ts until issue 29, item 1):
// a window detokenizer over `engine.detokenize` and a stop-string matcher on the text. The tests
// replay a turn's tokens through it to check that the core's deltas are exactly the text each
// token gave before.

const MAX_PENDING_TOKENS = 16
const REPLACEMENT = '\uFFFD'

export type Decode = (tokens: Int32Array) => string

class WindowDetokenizer {
  private prefixOffset = 0
  private readOffset = 0
  private prefixText = ''

  constructor(private readonly decode: Decode) {}

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

  flush(tokens: Int32Array, n: number): string {
    if (n <= this.readOffset) return ''
    const text = this.decode(tokens.subarray(this.prefixOffset, n))
    this.prefixOffset = this.readOffset = n
    return text.slice(this.prefixText.length)
  }
}

class Stops {
  private text = ''
  private emitted = 0
  private readonly longest: number

  constructor(private readonly stops: readonly string[]) {
    this.longest = Math.max(...stops.map((s) => s.length))
  }

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
    let held = 0
    for (let k = Math.min(this.longest - 1, this.text.length - this.emitted); k > 0; k--) {
      const tail = this.text.slice(this.text.length - k)
      if (this.stops.some((s) => s.startsWith(tail))) {
        held = k
        break
      }
    }
    const safe = this.text.length - held
    const out = this.text.slice(this.emitted, safe)
    this.emitted = safe
    return { text: out, stopIndex: null }
  }

  flush(): string {
    const out = this.text.slice(this.emitted)
    this.emitted = this.text.length
    return out
  }
}

/** The chunk texts the old facade gave `tokens` (the turn's generated tokens, in order), the
 *  held-back rest added to the last chunk; with `stop`, up to the token that completed the first
 *  stop string (`stopIndex`: its index). */
export function streamedChunks(decode: Decode, tokens: ArrayLike<number>, stop: readonly string[] = []): { chunks: string[]; stopIndex: number | null } {
  const ids = Int32Array.from(tokens)
  const detokenizer = new WindowDetokenizer(decode)
  const stops = stop.length > 0 ? new Stops(stop) : null
  const chunks: string[] = []
  for (let n = 1; n <= ids.length; n++) {
    const delta = detokenizer.next(ids, n)
    const pushed = stops === null ? { text: delta, stopIndex: null } : stops.push(delta)
    chunks.push(pushed.text)
    if (pushed.stopIndex !== null) return { chunks, stopIndex: pushed.stopIndex }
  }
  let rest = detokenizer.flush(ids, ids.length)
  let stopIndex: number | null = null
  if (stops !== null) {
    const pushed = stops.push(rest)
    stopIndex = pushed.stopIndex
    rest = stopIndex === null ? pushed.text + stops.flush() : pushed.text
  }
  if (chunks.length > 0) chunks[chunks.length - 1] += rest
  return { chunks, stopIndex }
}
