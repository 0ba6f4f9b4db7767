// A resumable scanner over the JSON a model writes for its tool calls: fed the text in pieces
// (as tokens arrive), it reports each call's start, its name once the name's string is complete,
// the raw text of its arguments as it grows, and its end; and, for the generic format, the
// `response` the model gave instead of calls. One pass, constant work per character, no
// backtracking, so a streamed turn costs what its text costs.
//
//   generic   {"tool_calls": [ {"name": "f", "arguments": {...}}, ... ]}   calls at depth 3
//             {"response": "..."}                                          content at depth 1
//   hermes    {"name": "f", "arguments": {...}}                            the call is the root
//   llama3    {"name": "f", "parameters": {...}}                           the call is the root
//   mistral   [ {"name": "f", "arguments": {...}}, ... ]                   calls at depth 2
//
// The arguments are reported as the model wrote them (their raw JSON text), so the pieces a
// stream sends add up to exactly the `arguments` string of the finished call.

/** Where a format's calls sit in its JSON. */
export interface JsonLayout {
  /** Open containers once inside a call object (the root object is depth 1). */
  callDepth: number
  /** The key of the array that holds the calls (generic's `tool_calls`); null: any. */
  callsKey: string | null
  /** The keys whose value is a call's arguments. */
  argumentKeys: readonly string[]
  /** The root object's key whose value is content for the user (generic's `response`). */
  contentKey: string | null
}

export interface ScanEvents {
  callStart(): void
  callName(name: string): void
  callArguments(piece: string): void
  callEnd(): void
  content(piece: string): void
}

/** Deepest nesting the scanner follows; deeper JSON is a failure (bounded work and memory). */
const MAX_DEPTH = 128

interface Frame {
  kind: 'object' | 'array'
  /** The key this container is the value of (in its parent object). */
  key: string | null
  /** The latest key read in this object. */
  currentKey: string | null
  /** An object waits for a key (after `{` or `,`). */
  expectKey: boolean
  isCall: boolean
}

interface Capture {
  kind: 'arguments' | 'content'
  /** The capture ends when a value ends at this depth. */
  depth: number
  /** A content string, streamed decoded instead of raw. */
  decode: boolean
}

export class JsonScanner {
  /** The root value is complete; text after it is not the scanner's. */
  done = false
  /** The text is not JSON of the layout's shape. */
  failed = false
  private readonly stack: Frame[] = []
  /** A string in progress: its raw body, whether it is a key, an escape pending. */
  private str: { raw: string; key: boolean; escaped: boolean; decodedTo: number } | null = null
  /** A number, true, false or null in progress. */
  private primitive: string | null = null
  private capture: Capture | null = null
  private pendingArguments = ''
  private started = false

  constructor(
    private readonly layout: JsonLayout,
    private readonly events: ScanEvents,
  ) {}

  /** Scans `text`; returns how many of its characters belong to the JSON (all of them unless
   *  the root value ended inside it or the text is not JSON). */
  feed(text: string): number {
    let i = 0
    for (; i < text.length && !this.done && !this.failed; i++) this.step(text[i]!)
    this.flush()
    return i
  }

  private step(c: string): void {
    if (this.str !== null) return this.stringChar(c)
    if (this.primitive !== null) {
      if (/[0-9A-Za-z.+-]/.test(c)) {
        this.primitive += c
        this.captured(c)
        return
      }
      this.primitive = null
      this.valueEnded(false)
      if (this.done) return
    }
    if (c === ' ' || c === '\n' || c === '\r' || c === '\t') {
      if (this.capture !== null && this.stack.length > this.capture.depth) this.captured(c)
      return
    }
    const top = this.stack[this.stack.length - 1]
    if (!this.started && c !== '{' && c !== '[') return this.fail()
    switch (c) {
      case '{':
      case '[':
        return this.open(c === '{' ? 'object' : 'array')
      case '}':
      case ']':
        return this.close(c === '}' ? 'object' : 'array')
      case '"':
        if (top?.kind === 'object' && top.expectKey) {
          this.str = { raw: '', key: true, escaped: false, decodedTo: 0 }
          this.captured(c)
          return
        }
        this.valueStarting()
        this.captured(c)
        this.str = { raw: '', key: false, escaped: false, decodedTo: 0 }
        return
      case ':':
        if (top?.kind !== 'object' || top.expectKey) return this.fail()
        return this.captured(c)
      case ',':
        if (top === undefined) return this.fail()
        if (top.kind === 'object') top.expectKey = true
        return this.captured(c)
      default:
        if (top === undefined || (top.kind === 'object' && top.expectKey)) return this.fail()
        this.valueStarting()
        this.primitive = c
        this.captured(c)
    }
  }

  private stringChar(c: string): void {
    const str = this.str!
    const decoded = this.capture?.decode === true && !str.key
    if (!decoded) this.captured(c)
    if (str.escaped) {
      str.raw += c
      str.escaped = false
      return
    }
    if (c === '\\') {
      str.raw += c
      str.escaped = true
      return
    }
    if (c !== '"') {
      str.raw += c
      return
    }
    this.str = null
    if (decoded) this.emitDecoded(str, true)
    if (str.key) {
      const top = this.stack[this.stack.length - 1]!
      top.currentKey = decodeJsonString(str.raw)
      top.expectKey = false
      return
    }
    const top = this.stack[this.stack.length - 1]
    if (top?.isCall === true && top.currentKey === 'name') {
      const name = decodeJsonString(str.raw)
      if (name !== null) this.events.callName(name)
    }
    this.valueEnded(false)
  }

  private open(kind: Frame['kind']): void {
    if (this.stack.length >= MAX_DEPTH) return this.fail()
    const parent = this.stack[this.stack.length - 1]
    if (parent?.kind === 'object' && parent.expectKey) return this.fail()
    this.valueStarting()
    this.captured(kind === 'object' ? '{' : '[')
    const isCall = kind === 'object' && this.stack.length === this.layout.callDepth - 1 && this.inCallsContainer()
    this.stack.push({ kind, key: parent?.kind === 'object' ? parent.currentKey : null, currentKey: null, expectKey: kind === 'object', isCall })
    this.started = true
    if (isCall) this.events.callStart()
  }

  private close(kind: Frame['kind']): void {
    const top = this.stack[this.stack.length - 1]
    if (top === undefined || top.kind !== kind) return this.fail()
    this.stack.pop()
    this.captured(kind === 'object' ? '}' : ']')
    this.valueEnded(top.isCall)
  }

  /** The calls' parent: the root (hermes, llama3), the root array (mistral), or the array under
   *  callsKey (generic). */
  private inCallsContainer(): boolean {
    const depth = this.layout.callDepth
    if (depth === 1) return this.stack.length === 0
    const parent = this.stack[depth - 2]
    return parent?.kind === 'array' && (this.layout.callsKey === null || parent.key === this.layout.callsKey)
  }

  /** A value (not a key) begins at the current depth: it may start a capture. */
  private valueStarting(): void {
    if (this.capture !== null) return
    const top = this.stack[this.stack.length - 1]
    if (top === undefined || top.kind !== 'object') return
    const key = top.currentKey
    if (top.isCall && key !== null && this.layout.argumentKeys.includes(key)) {
      this.capture = { kind: 'arguments', depth: this.stack.length, decode: false }
    } else if (this.stack.length === 1 && key !== null && key === this.layout.contentKey) {
      this.capture = { kind: 'content', depth: 1, decode: false }
    }
  }

  /** A value ended; the stack is back at its parent's depth. */
  private valueEnded(wasCall: boolean): void {
    if (this.capture !== null && this.stack.length === this.capture.depth) {
      this.flush()
      this.capture = null
    }
    if (wasCall) this.events.callEnd()
    if (this.stack.length === 0) this.done = true
  }

  private captured(c: string): void {
    const capture = this.capture
    if (capture === null) return
    if (capture.kind === 'arguments') {
      this.pendingArguments += c
      return
    }
    // Content: a string value streams decoded (its quotes are not content); anything else raw.
    if (c === '"' && this.str === null && this.primitive === null && this.stack.length === capture.depth) {
      capture.decode = true
      return
    }
    this.events.content(c)
  }

  private flush(): void {
    if (this.pendingArguments.length > 0) {
      this.events.callArguments(this.pendingArguments)
      this.pendingArguments = ''
    }
    const str = this.str
    if (str !== null && this.capture?.decode === true && !str.key) this.emitDecoded(str, false)
  }

  /** Emits the decoded part of a content string not yet emitted, up to its last complete escape. */
  private emitDecoded(str: { raw: string; decodedTo: number }, complete: boolean): void {
    let end = str.decodedTo
    if (complete) end = str.raw.length
    else {
      for (let i = str.decodedTo; i < str.raw.length; ) {
        const width = str.raw[i] !== '\\' ? 1 : str.raw[i + 1] === 'u' ? 6 : 2
        if (i + width > str.raw.length) break
        i += width
        end = i
      }
    }
    if (end === str.decodedTo) return
    const piece = decodeJsonString(str.raw.slice(str.decodedTo, end))
    str.decodedTo = end
    if (piece !== null && piece.length > 0) this.events.content(piece)
  }

  private fail(): void {
    this.failed = true
  }
}

/** The value of a JSON string's raw body; null when it is not valid JSON. */
export function decodeJsonString(raw: string): string | null {
  try {
    return JSON.parse(`"${raw}"`) as string
  } catch {
    return null
  }
}
