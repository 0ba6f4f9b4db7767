// The duplex WebSocket protocol (docs/duplex-protocol.md): JSON text frames in the style of the
// OpenAI Realtime API. This file parses client events into typed commands (every field checked,
// unknown fields refused) and builds server events; it holds no state and does no I/O.
//
// Wire names are snake_case; the TypeScript API's are camelCase. Fences travel as
// {session_id, incarnation, epoch, turn_id, response_seq}.

import { OrtexError } from '../../errors'
import { MAX_SESSION_ID_CHARS, charCount } from '../../validate'
import type { Fence, SessionEvent } from '../../duplex/events'
import type { DuplexAppendResult, DuplexSessionConfig, RespondMode } from '../../duplex/session'
import type { TurnOptions, TurnUsage } from '../../types'

export interface WireFence {
  session_id: string
  incarnation: number
  epoch: number
  turn_id: number
  response_seq: number
}

/** A client event, checked. */
export type ClientCommand =
  | { type: 'session.update'; config: DuplexSessionConfig }
  | { type: 'input_text.append'; text: string; final: boolean; operationId: string | null; fence: Fence | null }
  | { type: 'input.commit'; operationId: string | null; fence: Fence | null }
  | { type: 'response.create'; options: TurnOptions }
  | { type: 'response.cancel'; fence: Fence | null }
  | { type: 'barge_in'; fence: Fence | null; playedTokens: number | null }
  | { type: 'response.truncate'; playedTokens: number; fence: Fence | null }
  | { type: 'session.heartbeat' }
  | { type: 'session.resume'; sessionId: string; resumeToken: string; leaseGeneration: number; lastResponseSeq: number | null }
  | { type: 'session.close'; reason: string | null }

export const CLIENT_EVENT_TYPES = [
  'session.update',
  'input_text.append',
  'input.commit',
  'response.create',
  'response.cancel',
  'barge_in',
  'response.truncate',
  'session.heartbeat',
  'session.resume',
  'session.close',
] as const

/** Protocol-level error codes, besides OrtexError's. */
export type ProtocolErrorCode =
  | 'INVALID_JSON'
  | 'INVALID_EVENT'
  | 'UNKNOWN_EVENT'
  | 'MESSAGE_TOO_LARGE'
  | 'NO_SESSION'
  | 'INVALID_RESUME_TOKEN'
  | 'INTERNAL_ERROR'
  | 'SESSION_STORE_UNAVAILABLE'

/** A refusal of one client event; the connection keeps working. */
export class ProtocolError extends Error {
  constructor(
    readonly code: ProtocolErrorCode,
    message: string,
    /** The same event may succeed later (the session store is away). */
    readonly retryable = false,
  ) {
    super(message)
  }
}

/** The longest `event_id` and `resume_token`, in characters (the protocol's own strings; the
 *  session's ids, operation ids and reasons are limited by the core, in the same unit). */
export const MAX_EVENT_ID_CHARS = 256
const MAX_RESUME_TOKEN_CHARS = 256
/** Appended text is bounded by the message size; this only keeps a wrong client's mistake cheap. */
const MAX_TEXT_CHARS = 1 << 20

/** The client's `event_id` and `type` as far as the frame shows them, for the error about it:
 *  echoed whenever the frame is a JSON object with a string `event_id` (its first 256 chars). */
export interface EventLabels {
  eventType: string | null
  eventId: string | null
}

export interface ParsedEvent {
  command: ClientCommand
  /** The client's event_id, echoed in an error about this event. */
  eventId: string | null
}

/** Parses one JSON text frame. Throws ProtocolError; `labels` receives the event's type and id
 *  as soon as they are known, so that the error about a bad event can name it. */
export function parseClientEvent(text: string, labels?: EventLabels): ParsedEvent {
  let value: unknown
  try {
    value = JSON.parse(text)
  } catch (error) {
    throw new ProtocolError('INVALID_JSON', `the message is not JSON: ${(error as Error).message}`)
  }
  if (typeof value !== 'object' || value === null || Array.isArray(value)) {
    throw new ProtocolError('INVALID_EVENT', 'an event must be a JSON object')
  }
  const event = value as Record<string, unknown>
  if (labels !== undefined) {
    if (typeof event.event_id === 'string') labels.eventId = event.event_id.slice(0, MAX_EVENT_ID_CHARS)
    if (typeof event.type === 'string') labels.eventType = event.type.slice(0, 64)
  }
  const eventId = event.event_id === undefined ? null : str(event, 'event_id', MAX_EVENT_ID_CHARS)
  const type = event.type
  if (typeof type !== 'string') throw new ProtocolError('INVALID_EVENT', 'an event needs a string "type"')
  const fields = new Fields(event, type)
  const command = parseCommand(type, fields)
  fields.refuseUnknown()
  return { command, eventId }
}

function parseCommand(type: string, f: Fields): ClientCommand {
  switch (type) {
    case 'session.update':
      return { type, config: sessionConfig(f.object('session', false)) }
    case 'input_text.append':
      return {
        type,
        text: f.string('text', true, MAX_TEXT_CHARS)!,
        final: f.boolean('final') ?? false,
        operationId: f.string('operation_id', false),
        fence: f.fence('fence'),
      }
    case 'input.commit':
      return { type, operationId: f.string('operation_id', false), fence: f.fence('fence') }
    case 'response.create':
      return { type, options: turnOptions(f.object('response', false), 'response') }
    case 'response.cancel':
      return { type, fence: f.fence('fence') }
    case 'barge_in':
      return { type, fence: f.fence('fence'), playedTokens: f.count('played_tokens', false) }
    case 'response.truncate':
      return { type, playedTokens: f.count('played_tokens', true)!, fence: f.fence('fence') }
    case 'session.heartbeat':
      return { type }
    case 'session.resume':
      return {
        type,
        // The limit first: a resume naming an id no session can have is a wrong event, not a
        // closed session.
        sessionId: f.string('session_id', true, MAX_SESSION_ID_CHARS)!,
        resumeToken: f.string('resume_token', true, MAX_RESUME_TOKEN_CHARS)!,
        leaseGeneration: f.count('lease_generation', true)!,
        lastResponseSeq: f.count('last_response_seq', false),
      }
    case 'session.close':
      return { type, reason: f.string('reason', false) }
    default:
      throw new ProtocolError('UNKNOWN_EVENT', `unknown event type ${JSON.stringify(type.slice(0, 64))}`)
  }
}

/** session.update's `session` object: {respond?, max_output_tokens?, temperature?, top_k?, top_p?,
 *  seed?, ignore_eos?, stop?}. */
function sessionConfig(value: Record<string, unknown> | null): DuplexSessionConfig {
  if (value === null) return {}
  const config: DuplexSessionConfig = {}
  const { respond, ...turn } = value
  if (respond !== undefined) {
    if (respond !== 'on-final' && respond !== 'manual') {
      throw new ProtocolError('INVALID_EVENT', `session.respond must be 'on-final' or 'manual'`)
    }
    config.respond = respond as RespondMode
  }
  const options = turnOptions(turn, 'session')
  if (Object.keys(options).length > 0) config.turn = options
  return config
}

const TURN_FIELDS: Record<string, keyof TurnOptions> = {
  max_output_tokens: 'maxGeneratedTokens',
  temperature: 'temperature',
  top_k: 'topK',
  top_p: 'topP',
  seed: 'seed',
  ignore_eos: 'ignoreEos',
  stop: 'stop',
}

/** Turn options in wire names; values are checked by the session as beginTurn checks them. */
function turnOptions(value: Record<string, unknown> | null, name: string): TurnOptions {
  const options: Record<string, unknown> = {}
  if (value === null) return options
  for (const [key, v] of Object.entries(value)) {
    const mapped = TURN_FIELDS[key]
    if (mapped === undefined) {
      throw new ProtocolError('INVALID_EVENT', `${name} has an unknown field "${key.slice(0, 64)}" (known: ${Object.keys(TURN_FIELDS).join(', ')})`)
    }
    if (v !== undefined && v !== null) options[mapped] = v
  }
  return options as TurnOptions
}

/** Reads the fields of one event and remembers which were read, to refuse the rest. */
class Fields {
  private readonly seen = new Set<string>(['type', 'event_id'])

  constructor(
    private readonly event: Record<string, unknown>,
    private readonly type: string,
  ) {}

  /** A string field; `maxChars` only where the protocol itself sets the limit (the core checks
   *  the lengths of what it keeps). */
  string(key: string, required: boolean, maxChars = Number.POSITIVE_INFINITY): string | null {
    this.seen.add(key)
    if (this.absent(key, required)) return null
    return str(this.event, key, maxChars)
  }

  boolean(key: string): boolean | null {
    this.seen.add(key)
    if (this.absent(key, false)) return null
    const value = this.event[key]
    if (typeof value !== 'boolean') throw this.invalid(key, 'must be a boolean')
    return value
  }

  count(key: string, required: boolean): number | null {
    this.seen.add(key)
    if (this.absent(key, required)) return null
    const value = this.event[key]
    if (typeof value !== 'number' || !Number.isSafeInteger(value) || value < 0) {
      throw this.invalid(key, 'must be a non-negative integer')
    }
    return value
  }

  object(key: string, required: boolean): Record<string, unknown> | null {
    this.seen.add(key)
    if (this.absent(key, required)) return null
    const value = this.event[key]
    if (typeof value !== 'object' || value === null || Array.isArray(value)) throw this.invalid(key, 'must be an object')
    return value as Record<string, unknown>
  }

  fence(key: string): Fence | null {
    const value = this.object(key, false)
    return value === null ? null : fenceFromWire(value)
  }

  refuseUnknown(): void {
    for (const key of Object.keys(this.event)) {
      if (!this.seen.has(key)) throw this.invalid(key.slice(0, 64), 'is not a field of this event')
    }
  }

  private absent(key: string, required: boolean): boolean {
    const value = this.event[key]
    if (value !== undefined && value !== null) return false
    if (required) throw this.invalid(key, 'is required')
    return true
  }

  private invalid(key: string, what: string): ProtocolError {
    return new ProtocolError('INVALID_EVENT', `${this.type}: "${key}" ${what}`)
  }
}

function str(event: Record<string, unknown>, key: string, maxChars: number): string {
  const value = event[key]
  if (typeof value !== 'string') throw new ProtocolError('INVALID_EVENT', `"${key}" must be a string`)
  if (!(value as unknown as { isWellFormed(): boolean }).isWellFormed()) {
    throw new ProtocolError('INVALID_EVENT', `"${key}" is not well-formed Unicode (it holds a lone surrogate)`)
  }
  if (value.length > maxChars && charCount(value) > maxChars) {
    throw new ProtocolError('INVALID_EVENT', `"${key}" is longer than ${maxChars} characters`)
  }
  return value
}

const FENCE_FIELDS = ['session_id', 'incarnation', 'epoch', 'turn_id', 'response_seq'] as const

export function fenceFromWire(value: Record<string, unknown>): Fence {
  for (const key of Object.keys(value)) {
    if (!(FENCE_FIELDS as readonly string[]).includes(key)) {
      throw new ProtocolError('INVALID_EVENT', `fence has an unknown field "${key.slice(0, 64)}"`)
    }
  }
  const count = (key: string): number => {
    const v = value[key]
    if (typeof v !== 'number' || !Number.isSafeInteger(v) || v < 0) {
      throw new ProtocolError('INVALID_EVENT', `fence.${key} must be a non-negative integer`)
    }
    return v
  }
  const sessionId = value.session_id
  if (typeof sessionId !== 'string') throw new ProtocolError('INVALID_EVENT', 'fence.session_id must be a string')
  str(value, 'session_id', MAX_SESSION_ID_CHARS)
  return {
    sessionId,
    incarnation: count('incarnation'),
    epoch: count('epoch'),
    turnId: count('turn_id'),
    responseSeq: count('response_seq'),
  }
}

export function fenceToWire(fence: Fence): WireFence {
  return {
    session_id: fence.sessionId,
    incarnation: fence.incarnation,
    epoch: fence.epoch,
    turn_id: fence.turnId,
    response_seq: fence.responseSeq,
  }
}

// ---- server events -----------------------------------------------------------------------------

/** A server event before the connection stamps its server_event_seq. */
export type ServerEvent = { type: string } & Record<string, unknown>

export interface WireSession {
  id: string
  fence: WireFence
  lease_generation: number
  respond: RespondMode
}

function wireUsage(usage: TurnUsage): Record<string, number> {
  return {
    input_tokens: usage.promptTokens,
    output_tokens: usage.generatedTokens,
    cached_input_tokens: usage.cachedPromptTokens,
  }
}

/** A session event in wire form. */
export function sessionEventToWire(event: SessionEvent): ServerEvent {
  switch (event.type) {
    case 'response.created':
      return { type: 'response.created', fence: fenceToWire(event.fence), response_seq: event.fence.responseSeq }
    case 'response.delta':
      return {
        type: 'response.output_text.delta',
        fence: fenceToWire(event.fence),
        delta: event.text,
        token: event.token,
        index: event.index,
      }
    case 'response.done':
      return {
        type: 'response.done',
        fence: fenceToWire(event.fence),
        status: event.status,
        finish_reason: event.finishReason,
        error_code: event.errorCode,
        usage: wireUsage(event.usage),
      }
    case 'session.closed':
    case 'session.expired':
      return { type: event.type, fence: fenceToWire(event.fence), reason: event.reason }
  }
}

export function committedEvent(result: DuplexAppendResult, operationId: string | null): ServerEvent {
  return {
    type: 'input.committed',
    seq: result.seq,
    turn_seq: result.turnSeq,
    turn_id: result.turnId,
    final: result.final,
    replayed: result.replayed,
    operation_id: operationId,
    fence: fenceToWire(result.fence),
  }
}

/** The `error.type` of a code. */
export function errorType(code: string): string {
  switch (code) {
    case 'CAPACITY_EXHAUSTED':
      return 'capacity_error'
    case 'FENCE_MISMATCH':
    case 'LEASE_GENERATION_MISMATCH':
    case 'SESSION_CLOSED':
    case 'SESSION_EXISTS':
    case 'OPERATION_REUSED':
    case 'STALE_RESERVATION':
    case 'TURN_ACTIVE':
    case 'EVENTS_PENDING':
    case 'INVALID_RESUME_TOKEN':
    case 'NO_SESSION':
      return 'session_error'
    case 'ENGINE_UNHEALTHY':
    case 'ENGINE_CLOSED':
    case 'INTERNAL_ERROR':
    case 'RUN_IN_PROGRESS':
    case 'SESSION_STORE_UNAVAILABLE':
      return 'server_error'
    default:
      return 'invalid_request_error'
  }
}

/** An error event for whatever a command threw. */
export function errorEvent(error: unknown, eventType: string | null, eventId: string | null): ServerEvent {
  let code: string
  let message: string
  let retryable = false
  if (error instanceof ProtocolError) {
    code = error.code
    message = error.message
    retryable = error.retryable
  } else if (error instanceof OrtexError) {
    code = error.code
    message = error.message
    retryable = error.retryable
  } else {
    code = 'INTERNAL_ERROR'
    message = error instanceof Error ? error.message : String(error)
  }
  return {
    type: 'error',
    error: { type: errorType(code), code, message, retryable, event_type: eventType, event_id: eventId },
  }
}
