// A model's output split into content for the user and tool calls, as the text streams, for each
// format family (format.ts): the same parser gives a stream's deltas and a finished turn's result,
// so the pieces a stream sends add up to the result.
//
//   hermes    content <tool_call>{"name":..,"arguments":..}</tool_call> <tool_call>..</tool_call>
//   llama3    {"name":..,"parameters":..}        (or <|python_tag|>{...}); any other start is content
//   mistral   content [TOOL_CALLS][{"name":..,"arguments":..}, ...]
//   phi4      content <|tool_call|>[{"name":..,"arguments":..}, ...]<|/tool_call|>
//   generic   {"tool_calls":[{"name":..,"arguments":..}, ...]}  or  {"response": "content"}
//
// Text that may still turn out to start a call (`<tool_` at the end of what arrived) is held back
// until the next piece tells.

import { JsonScanner, type JsonLayout } from './json-scan'
import type { ToolFamily } from './format'
import { partialSuffix } from './reasoning'
import type { ToolCall } from '../types'

/** One streamed change to a call: its first delta has the id and name, later ones argument text. */
export interface ToolCallDelta {
  index: number
  id?: string
  name?: string
  arguments: string
}

export interface ParsedPiece {
  content: string
  calls: ToolCallDelta[]
}

export interface ParsedOutput {
  /** The text for the user; null when the output was only calls. */
  content: string | null
  /** Completed calls only (a call the turn's end cut short is left out). */
  toolCalls: ToolCall[]
}

interface FamilySyntax {
  /** The text that opens the calls; null: the output's first character decides. */
  trigger: string | null
  /** The text that closes each call (after its JSON). */
  closer: string | null
  layout: JsonLayout
}

const CALL = { callDepth: 1, callsKey: null, contentKey: null } as const
const SYNTAX: Record<ToolFamily, FamilySyntax> = {
  hermes: { trigger: '<tool_call>', closer: '</tool_call>', layout: { ...CALL, argumentKeys: ['arguments', 'parameters'] } },
  llama3: { trigger: null, closer: null, layout: { ...CALL, argumentKeys: ['parameters', 'arguments'] } },
  mistral: { trigger: '[TOOL_CALLS]', closer: null, layout: { callDepth: 2, callsKey: null, contentKey: null, argumentKeys: ['arguments', 'parameters'] } },
  phi4: { trigger: '<|tool_call|>', closer: '<|/tool_call|>', layout: { callDepth: 2, callsKey: null, contentKey: null, argumentKeys: ['arguments', 'parameters'] } },
  generic: { trigger: null, closer: null, layout: { callDepth: 3, callsKey: 'tool_calls', contentKey: 'response', argumentKeys: ['arguments', 'parameters'] } },
}

/** Llama 3.x may open a call with this tag before its JSON. */
const PYTHON_TAG = '<|python_tag|>'

interface CallState {
  id: string
  name: string | null
  arguments: string
  /** Argument text that arrived before the name (sent once the name is known). */
  unsent: string
  announced: boolean
  complete: boolean
}

type Mode = 'start' | 'text' | 'json' | 'closer'

export class ToolCallParser {
  private mode: Mode
  private held = ''
  private scanner: JsonScanner | null = null
  /** The JSON region's text so far, given back as content should it not be JSON after all. */
  private region = ''
  /** Content the JSON region itself gave (generic's `response`). */
  private regionContent = 0
  private readonly calls: CallState[] = []
  private content = ''
  private piece: ParsedPiece = { content: '', calls: [] }
  private readonly syntax: FamilySyntax

  constructor(
    private readonly family: ToolFamily,
    private readonly newId: () => string,
  ) {
    this.syntax = SYNTAX[family]
    this.mode = this.syntax.trigger === null ? 'start' : 'text'
  }

  /** The content and call deltas `text` completes. */
  push(text: string): ParsedPiece {
    this.held += text
    this.run(false)
    return this.take()
  }

  /** The end of the output: whatever was held back is content. */
  finish(): ParsedPiece {
    this.run(true)
    const unfinished = this.mode === 'json' && this.scanner !== null && !this.scanner.done
    if (unfinished && this.regionContent === 0 && this.calls.every((c) => !c.announced)) {
      // Never became calls (cut short before a name): the text was the user's.
      this.emitContent(this.region)
    }
    if (this.held.length > 0 && this.mode !== 'json') this.emitContent(this.held)
    this.held = ''
    return this.take()
  }

  /** What the whole output parsed into (after finish()). */
  result(): ParsedOutput {
    const toolCalls: ToolCall[] = this.calls
      .filter((c) => c.complete && c.name !== null)
      .map((c) => ({ id: c.id, type: 'function' as const, function: { name: c.name!, arguments: normalizedArguments(c.arguments) } }))
    const content = toolCalls.length > 0 ? this.content.trim() : this.content
    return { content: toolCalls.length > 0 && content.length === 0 ? null : content, toolCalls }
  }

  private take(): ParsedPiece {
    const out = this.piece
    this.piece = { content: '', calls: [] }
    return out
  }

  private run(ending: boolean): void {
    for (let guard = 0; this.held.length > 0 && guard < 1_000_000; guard++) {
      const before = this.held.length
      const mode = this.mode
      if (mode === 'start') this.start(ending)
      else if (mode === 'text') this.text(ending)
      else if (mode === 'json') this.json()
      else this.closer(ending)
      if (this.held.length === before && this.mode === mode) return
    }
  }

  /** llama3 and generic: leading whitespace waits; a `{` (or llama3's tag) opens the JSON. */
  private start(ending: boolean): void {
    const text = this.held.trimStart()
    if (text.length === 0) return
    if (this.family === 'llama3' && PYTHON_TAG.startsWith(text) && !ending) return
    if (this.family === 'llama3' && text.startsWith(PYTHON_TAG)) {
      this.held = text.slice(PYTHON_TAG.length)
      this.openJson()
      return
    }
    if (text.startsWith('{') || (this.family === 'mistral' && text.startsWith('['))) {
      this.held = text
      this.openJson()
      return
    }
    // Not a call: everything is content from here on.
    this.mode = 'text'
  }

  /** Content up to the trigger; a trigger's possible beginning at the end waits. */
  private text(ending: boolean): void {
    const trigger = this.syntax.trigger
    if (trigger === null) {
      this.emitContent(this.held)
      this.held = ''
      return
    }
    const at = this.held.indexOf(trigger)
    if (at >= 0) {
      this.emitContent(this.held.slice(0, at))
      this.held = this.held.slice(at + trigger.length)
      this.openJson()
      return
    }
    const keep = ending ? 0 : partialSuffix(this.held, trigger)
    this.emitContent(this.held.slice(0, this.held.length - keep))
    this.held = this.held.slice(this.held.length - keep)
  }

  private openJson(): void {
    this.mode = 'json'
    this.region = ''
    this.regionContent = 0
    this.scanner = new JsonScanner(this.syntax.layout, {
      callStart: () => this.calls.push({ id: this.newId(), name: null, arguments: '', unsent: '', announced: false, complete: false }),
      callName: (name) => this.named(name),
      callArguments: (piece) => this.argumentPiece(piece),
      callEnd: () => this.callEnded(),
      content: (piece) => {
        this.regionContent += piece.length
        this.emitContent(piece)
      },
    })
  }

  private json(): void {
    const scanner = this.scanner!
    // Whitespace before the JSON (hermes writes a newline after its tag) is not the JSON's.
    if (this.region.length === 0) {
      const trimmed = this.held.trimStart()
      if (trimmed.length === 0) return
      this.held = trimmed
    }
    const used = scanner.feed(this.held)
    this.region += this.held.slice(0, used)
    this.held = this.held.slice(used)
    if (scanner.failed) {
      // Not a call after all: what looked like one is the user's text.
      this.emitContent(this.region + this.held)
      this.held = ''
      this.mode = 'text'
      this.scanner = null
      return
    }
    if (scanner.done) this.mode = this.syntax.closer !== null ? 'closer' : 'text'
  }

  /** hermes and phi4: whitespace and the closing tag after the calls' JSON are not content. */
  private closer(ending: boolean): void {
    const closer = this.syntax.closer!
    const text = this.held.trimStart()
    if (text.startsWith(closer)) {
      this.held = text.slice(closer.length)
      this.mode = 'text'
      return
    }
    if (!ending && closer.startsWith(text)) return
    this.mode = 'text'
  }

  private named(name: string): void {
    const call = this.calls[this.calls.length - 1]
    if (call === undefined || call.name !== null) return
    call.name = name
    call.announced = true
    this.piece.calls.push({ index: this.calls.length - 1, id: call.id, name, arguments: call.unsent })
    call.unsent = ''
  }

  private argumentPiece(piece: string): void {
    const call = this.calls[this.calls.length - 1]
    if (call === undefined) return
    call.arguments += piece
    if (!call.announced) {
      call.unsent += piece
      return
    }
    const last = this.piece.calls[this.piece.calls.length - 1]
    if (last !== undefined && last.index === this.calls.length - 1) last.arguments += piece
    else this.piece.calls.push({ index: this.calls.length - 1, arguments: piece })
  }

  private callEnded(): void {
    const call = this.calls[this.calls.length - 1]
    if (call !== undefined) call.complete = true
  }

  private emitContent(text: string): void {
    if (text.length === 0) return
    this.content += text
    this.piece.content += text
  }
}

/** A call's arguments as OpenAI gives them: JSON text of an object. A model that wrote them as a
 *  JSON string holding the JSON (some do) has it unwrapped. */
function normalizedArguments(raw: string): string {
  if (!raw.startsWith('"')) return raw
  try {
    const inner = JSON.parse(raw) as unknown
    return typeof inner === 'string' ? inner : raw
  } catch {
    return raw
  }
}
