// `ortex serve`: a WebSocket server (the `ws` package) over DuplexSessionManager, speaking the
// protocol of docs/duplex-protocol.md (parsing and event shapes in protocol.ts).
//
//   connection ──first command──▶ session.created {session, resume_token}
//        │  commands ─▶ DuplexSession ─▶ events() ─▶ pump ─▶ server events (server_event_seq)
//        ▼ drop
//   detached ──session.resume {id, token, generation} on a new connection──▶ same session
//        └──── disconnect grace runs out ──▶ collectExpired: session.expired, KV freed
//
// One session per connection. A session is created by the connection's first command other than
// session.resume. Every server event carries server_event_seq, counted per connection from 1.
// Events a session produces while detached wait in its queue (deltas pace the response) and are
// delivered after a resume. A bad message gets an error event; the connection and every other
// session keep working.

import { createHash, randomBytes, timingSafeEqual } from 'node:crypto'
import type { AddressInfo } from 'node:net'

import type { RawData, WebSocket, WebSocketServer } from 'ws'

import type { Engine } from '../engine'
import { OrtexError } from '../errors'
import type { SessionEvent } from '../duplex/events'
import { DuplexSessionManager } from '../duplex/manager'
import { type DuplexSession, checkConfig } from '../duplex/session'
import type { TurnOptions } from '../types'
import * as v from '../validate'
import {
  type ClientCommand,
  ProtocolError,
  type ServerEvent,
  committedEvent,
  errorEvent,
  fenceToWire,
  parseClientEvent,
  sessionEventToWire,
} from './protocol'

export interface DuplexServerOptions {
  /** Default 8787; 0 picks a free port. */
  port?: number
  /** Default '127.0.0.1'. */
  host?: string
  /** Sessions at once; default unlimited. Beyond it a session creation gets CAPACITY_EXHAUSTED. */
  maxSessions?: number
  idleTtlMs?: number | null
  disconnectGraceMs?: number
  completedAppendLimit?: number
  /** Largest message accepted, in bytes (default 65536); a larger one gets an error event. Frames
   *  above max(1 MiB, 4 x this) are refused by the WebSocket layer (close code 1009). */
  maxMessageBytes?: number
  /** How often expired sessions are collected (default 1000 ms; 0: never, call collectExpired). */
  sweepIntervalMs?: number
  /** Turn options of every response (session.update and response.create may override them);
   *  default {maxGeneratedTokens: 256}. */
  turn?: TurnOptions
  /** The sessions' clock (default Date.now); tests pass a fake one. */
  now?: () => number
}

export const DEFAULT_PORT = 8787
const DEFAULT_MAX_MESSAGE_BYTES = 65_536
const DEFAULT_SWEEP_INTERVAL_MS = 1000
const DEFAULT_TURN: TurnOptions = { maxGeneratedTokens: 256 }
/** Above this many bytes waiting in a socket, the pump waits for the send to complete. */
const SEND_HIGH_WATER_BYTES = 1 << 20
const OPEN = 1

interface Entry {
  session: DuplexSession
  /** sha256 of the resume token: compared in constant time, never stored in the clear. */
  tokenDigest: Buffer
  resumeToken: string
  connection: Connection | null
}

/** A started server. */
export class DuplexServer {
  readonly manager: DuplexSessionManager
  readonly host: string
  readonly port: number
  private readonly entries = new Map<string, Entry>()
  private readonly connections = new Set<Connection>()
  private readonly sweepTimer: NodeJS.Timeout | null
  private closing: Promise<void> | null = null

  /** @internal */
  constructor(
    private readonly wss: WebSocketServer,
    manager: DuplexSessionManager,
    readonly maxMessageBytes: number,
    readonly turn: TurnOptions,
    sweepIntervalMs: number,
  ) {
    this.manager = manager
    const address = wss.address() as AddressInfo
    this.host = address.address
    this.port = address.port
    wss.on('connection', (ws) => this.accept(ws))
    this.sweepTimer = sweepIntervalMs > 0 ? setInterval(() => this.collectExpired(), sweepIntervalMs) : null
    this.sweepTimer?.unref()
  }

  get url(): string {
    const host = this.host.includes(':') ? `[${this.host}]` : this.host
    return `ws://${host}:${this.port}`
  }

  /** Sessions holding a slot. */
  get sessionCount(): number {
    return this.manager.size
  }

  /** Expires what ran out (the timer calls this); returns how many sessions expired. */
  collectExpired(): number {
    let expired = 0
    try {
      expired = this.manager.collectExpired().length
    } catch {
      // A clock that went wrong is retried at the next sweep.
    }
    for (const [id, entry] of this.entries) {
      if (entry.session.state === 'closed' && entry.connection === null) this.entries.delete(id)
    }
    return expired
  }

  /** Stops accepting, drops every connection and closes every session (their KV is freed). The
   *  engine is the caller's: it is neither stopped nor closed. */
  close(): Promise<void> {
    if (this.closing !== null) return this.closing
    if (this.sweepTimer !== null) clearInterval(this.sweepTimer)
    this.closing = (async () => {
      for (const connection of this.connections) connection.ws.terminate()
      await this.manager.close('server_shutdown')
      this.entries.clear()
      await new Promise<void>((resolve) => this.wss.close(() => resolve()))
    })()
    return this.closing
  }

  // ---- connections -----------------------------------------------------------------------------

  private accept(ws: WebSocket): void {
    if (this.closing !== null) {
      ws.terminate()
      return
    }
    const connection = new Connection(ws, (entry) => {
      if (this.entries.get(entry.session.id) === entry) this.entries.delete(entry.session.id)
    })
    this.connections.add(connection)
    ws.on('message', (data: RawData, isBinary: boolean) => this.onMessage(connection, data, isBinary))
    ws.on('close', () => {
      this.connections.delete(connection)
      this.onDrop(connection)
    })
    ws.on('error', () => {
      // 'close' follows; a protocol-level failure (an oversize frame) ends only this connection.
    })
  }

  private onMessage(connection: Connection, data: RawData, isBinary: boolean): void {
    let eventType: string | null = null
    let eventId: string | null = null
    try {
      if (isBinary) throw new ProtocolError('INVALID_EVENT', 'binary frames are not supported; send JSON text')
      const size = byteLength(data)
      if (size > this.maxMessageBytes) {
        throw new ProtocolError('MESSAGE_TOO_LARGE', `a message may hold at most ${this.maxMessageBytes} bytes, got ${size}`)
      }
      const parsed = parseClientEvent(rawText(data))
      eventType = parsed.command.type
      eventId = parsed.eventId
      this.handle(connection, parsed.command)
    } catch (error) {
      connection.send(errorEvent(error, eventType, eventId))
    }
  }

  private handle(connection: Connection, command: ClientCommand): void {
    if (command.type === 'session.resume') {
      this.resume(connection, command.sessionId, command.resumeToken, command.leaseGeneration)
      return
    }
    if (command.type === 'session.close' || command.type === 'session.heartbeat') {
      const entry = connection.entry
      if (entry === null) throw new ProtocolError('NO_SESSION', 'this connection has no session')
      if (command.type === 'session.heartbeat') entry.session.heartbeat()
      else void entry.session.close(command.reason ?? 'client_close')
      return
    }
    const session = (connection.entry ?? this.create(connection)).session
    switch (command.type) {
      case 'session.update': {
        const generation = session.update(command.config)
        connection.send({ type: 'session.updated', session: wireSession(connection.entry!), config_generation: generation })
        return
      }
      case 'input_text.append': {
        const result = session.append(command.text, {
          final: command.final,
          operationId: command.operationId ?? undefined,
          fence: command.fence ?? undefined,
        })
        connection.send(committedEvent(result, command.operationId))
        return
      }
      case 'input.commit': {
        const result = session.append('', {
          final: true,
          operationId: command.operationId ?? undefined,
          fence: command.fence ?? undefined,
        })
        connection.send(committedEvent(result, command.operationId))
        return
      }
      case 'response.create':
        session.respond({ ...this.turn, ...command.options })
        return
      case 'response.cancel': {
        const fence = session.cancel(command.fence ?? undefined)
        connection.send({ type: 'response.cancelled', fence: fenceToWire(fence) })
        return
      }
      case 'barge_in': {
        const fence = session.cancel(command.fence ?? undefined)
        connection.send({ type: 'response.cancelled', fence: fenceToWire(fence) })
        if (command.playedTokens !== null) session.truncate(command.playedTokens)
        return
      }
      case 'response.truncate':
        session.truncate(command.playedTokens, { fence: command.fence ?? undefined })
        connection.send({ type: 'response.truncated', played_tokens: command.playedTokens })
        return
    }
  }

  /** The connection's first command creates its session. */
  private create(connection: Connection): Entry {
    const session = this.manager.open({ turn: this.turn })
    const resumeToken = randomBytes(32).toString('base64url')
    const entry: Entry = { session, resumeToken, tokenDigest: digest(resumeToken), connection: null }
    this.entries.set(session.id, entry)
    connection.attach(entry, 'session.created')
    return entry
  }

  private resume(connection: Connection, sessionId: string, token: string, generation: number): void {
    if (connection.entry !== null) {
      throw new ProtocolError('INVALID_EVENT', 'this connection already has a session; resume on a new connection')
    }
    const entry = this.entries.get(sessionId)
    if (entry === undefined || entry.session.state === 'closed' || entry.session.state === 'closing') {
      throw new OrtexError('SESSION_CLOSED', `there is no open session ${JSON.stringify(sessionId.slice(0, 128))}`)
    }
    // Constant time: both sides are sha256 digests of equal length.
    if (!timingSafeEqual(digest(token), entry.tokenDigest)) {
      throw new ProtocolError('INVALID_RESUME_TOKEN', 'the resume token does not match the session')
    }
    entry.session.resume(generation)
    // A connection that still holds the session (a half-open socket) loses it to this one.
    entry.connection?.release(entry)
    connection.attach(entry, 'session.resumed')
  }

  private onDrop(connection: Connection): void {
    const entry = connection.entry
    if (entry === null) return
    connection.release(entry)
    const state = entry.session.state
    if (state !== 'open') return
    try {
      entry.session.detach()
    } catch {
      // The session began closing meanwhile.
    }
  }
}

/** One WebSocket connection and the session it drives. */
class Connection {
  entry: Entry | null = null
  private seq = 0
  private stopPump: (() => void) | null = null

  constructor(
    readonly ws: WebSocket,
    /** The session's terminal event went out: the server forgets it. */
    private readonly ended: (entry: Entry) => void,
  ) {}

  /** Sends a server event, stamped with the next server_event_seq. Resolves when the socket has
   *  room again (the pump waits on it; commands do not). */
  send(event: ServerEvent): Promise<void> | void {
    if (this.ws.readyState !== OPEN) return
    const { type, ...fields } = event
    const data = JSON.stringify({ type, server_event_seq: ++this.seq, ...fields })
    if (this.ws.bufferedAmount < SEND_HIGH_WATER_BYTES) {
      this.ws.send(data)
      return
    }
    return new Promise((resolve) => this.ws.send(data, () => resolve()))
  }

  attach(entry: Entry, kind: 'session.created' | 'session.resumed'): void {
    this.entry = entry
    entry.connection = this
    const announced: ServerEvent = { type: kind, session: wireSession(entry) }
    if (kind === 'session.created') announced.resume_token = entry.resumeToken
    this.send(announced)
    this.pump(entry)
  }

  /** The connection no longer drives `entry`'s session; its events stay queued for the next. */
  release(entry: Entry): void {
    if (this.entry !== entry) return
    this.entry = null
    if (entry.connection === this) entry.connection = null
    const stop = this.stopPump
    this.stopPump = null
    stop?.()
  }

  /** Forwards the session's events to this connection until it is released or the session ends. */
  private pump(entry: Entry): void {
    const queue = entry.session._eventQueue
    const events = queue[Symbol.asyncIterator]()
    let released = false
    this.stopPump = () => {
      released = true
      void events.return?.()
    }
    void (async () => {
      for (;;) {
        const next = await events.next()
        if (next.done === true) return
        const event: SessionEvent = next.value
        if (released || this.ws.readyState !== OPEN) {
          // Taken just as the connection went away: the next connection gets it.
          queue.putBack(event)
          return
        }
        await this.send(sessionEventToWire(event))
        if (event.type === 'session.closed' || event.type === 'session.expired') {
          this.release(entry)
          this.ended(entry)
          return
        }
      }
    })()
  }
}

function wireSession(entry: Entry): Record<string, unknown> {
  const session = entry.session
  return {
    id: session.id,
    fence: fenceToWire(session.fence),
    lease_generation: session.leaseGeneration,
    respond: session.respondMode,
  }
}

function digest(token: string): Buffer {
  return createHash('sha256').update(token, 'utf8').digest()
}

function byteLength(data: RawData): number {
  if (Array.isArray(data)) return data.reduce((sum, chunk) => sum + chunk.length, 0)
  return data instanceof ArrayBuffer ? data.byteLength : data.length
}

function rawText(data: RawData): string {
  if (Array.isArray(data)) return Buffer.concat(data).toString('utf8')
  return Buffer.from(data as ArrayBuffer).toString('utf8')
}

/** Starts a server over `engine` (driven: the server calls engine.start()). */
export async function startDuplexServer(engine: Engine, options?: DuplexServerOptions): Promise<DuplexServer> {
  const present = v.options('options', options, [
    'port',
    'host',
    'maxSessions',
    'idleTtlMs',
    'disconnectGraceMs',
    'completedAppendLimit',
    'maxMessageBytes',
    'sweepIntervalMs',
    'turn',
    'now',
  ])
  const port = present.has('port') ? v.integer('options.port', present.get('port'), 0, 65_535) : DEFAULT_PORT
  const host = present.has('host') ? v.string('options.host', present.get('host')) : '127.0.0.1'
  const maxMessageBytes = present.has('maxMessageBytes')
    ? v.integer('options.maxMessageBytes', present.get('maxMessageBytes'), 64, 1 << 26)
    : DEFAULT_MAX_MESSAGE_BYTES
  const sweepIntervalMs = present.has('sweepIntervalMs')
    ? v.integer('options.sweepIntervalMs', present.get('sweepIntervalMs'), 0)
    : DEFAULT_SWEEP_INTERVAL_MS
  const turn = (present.get('turn') as TurnOptions | undefined) ?? DEFAULT_TURN
  const manager = new DuplexSessionManager(engine, {
    maxSessions: present.get('maxSessions') as number | undefined,
    idleTtlMs: present.get('idleTtlMs') as number | null | undefined,
    disconnectGraceMs: present.get('disconnectGraceMs') as number | undefined,
    completedAppendLimit: present.get('completedAppendLimit') as number | undefined,
    now: present.get('now') as (() => number) | undefined,
  })
  // Checks the turn options once, as every session would.
  checkConfig('options', { turn })
  const ws = await import('ws')
  const wss = await new Promise<WebSocketServer>((resolve, reject) => {
    const server = new ws.WebSocketServer({ port, host, maxPayload: Math.max(1 << 20, 4 * maxMessageBytes) })
    server.once('listening', () => resolve(server))
    server.once('error', reject)
  })
  engine.start()
  return new DuplexServer(wss, manager, maxMessageBytes, turn, sweepIntervalMs)
}
