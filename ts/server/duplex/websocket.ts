// `ortex serve`: a WebSocket server (the `ws` package) over DuplexSessionManager, speaking the
// protocol of docs/duplex-protocol.md (parsing and event shapes in protocol.ts).
//
//   connection ──first command──▶ session.created {session, resume_token}
//        │  commands ─▶ DuplexSession ─▶ events() ─▶ pump ─▶ server events (server_event_seq)
//        ▼ drop
//   detached ──session.resume {id, token, generation} on a new connection──▶ same session
//        └──── disconnect grace runs out ──▶ collectExpired: session.expired, KV freed
//
// With an apiKey, an upgrade without the key (auth.ts: the Authorization header or the
// `ortex-api-key.KEY` subprotocol) is refused with HTTP 401 before any WebSocket opens.
//
// One session per connection. A session is created by the connection's first command other than
// session.resume. Every server event carries server_event_seq, counted per connection from 1.
// Events a session produces while detached wait in its queue (deltas pace the response) and are
// delivered after a resume. A bad message gets an error event; the connection and every other
// session keep working.

import { createHash, randomBytes, timingSafeEqual } from 'node:crypto'
import type { AddressInfo } from 'node:net'

import type { RawData, ServerOptions as WsServerOptions, VerifyClientCallbackAsync, WebSocket, WebSocketServer } from 'ws'

import type { Engine } from '../../engine'
import { OrtexError } from '../../errors'
import type { SessionEvent } from '../../duplex/events'
import { DuplexSessionManager } from '../../duplex/manager'
import { type DuplexSession, checkConfig } from '../../duplex/session'
import type { TurnOptions } from '../../types'
import * as v from '../../validate'
import { ApiKey, selectSubprotocol } from '../auth'
import { type FlowLimits, StallTimer, flowLimits } from '../flow'
import {
  type ClientCommand,
  ProtocolError,
  type EventLabels,
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
  /** Upgrades need this key, as `Authorization: Bearer <apiKey>` or as the subprotocol
   *  `ortex-api-key.<apiKey>` offered beside `ortex` (docs/duplex-protocol.md); without it the
   *  upgrade is refused with HTTP 401. Default: none needed. startServer sets it to its own. */
  apiKey?: string
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
  /** Most bytes one connection may have waiting to be sent (default 1 MiB). Above it the server
   *  stops reading that connection and its session's events wait in the session. */
  maxBufferedBytes?: number
  /** A connection that stays above maxBufferedBytes this long is closed with code 1008
   *  (default 30000 ms). */
  sendStallMs?: number
  /** How often the server pings each connection; one that has not answered the previous ping is
   *  dropped, so a half-open connection detaches its session (default 30000 ms; 0 disables). */
  pingIntervalMs?: number
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
const DEFAULT_PING_INTERVAL_MS = 30_000
/** The close code for a connection whose client stopped reading (RFC 6455: policy violation). */
export const CLOSE_SEND_STALLED = 1008
const OPEN = 1

/** What a started server was configured with (validated). */
interface ServerSettings {
  maxMessageBytes: number
  turn: TurnOptions
  sweepIntervalMs: number
  flow: FlowLimits
  pingIntervalMs: number
}

/** What the server holds right now (addition, for monitoring). */
export interface DuplexServerStats {
  connections: number
  /** Sessions holding a slot. */
  sessions: number
  /** Connections the server stopped reading because their client does not read. */
  pausedConnections: number
  /** Bytes waiting to be sent, over all connections, and the most of any one. */
  bufferedBytes: number
  maxConnectionBufferedBytes: number
}

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
  readonly maxMessageBytes: number
  readonly turn: TurnOptions
  private readonly flow: FlowLimits
  private readonly timers: NodeJS.Timeout[] = []
  private closing: Promise<void> | null = null

  /** @internal */
  constructor(
    private readonly wss: WebSocketServer,
    manager: DuplexSessionManager,
    settings: ServerSettings,
  ) {
    this.manager = manager
    this.maxMessageBytes = settings.maxMessageBytes
    this.turn = settings.turn
    this.flow = settings.flow
    const address = wss.address() as AddressInfo
    this.host = address.address
    this.port = address.port
    wss.on('connection', (ws) => this.accept(ws))
    this.every(settings.sweepIntervalMs, () => this.collectExpired())
    this.every(settings.pingIntervalMs, () => this.pingAll())
  }

  /** Runs `task` every `intervalMs` (0: never) on an unref'd timer. */
  private every(intervalMs: number, task: () => void): void {
    if (intervalMs <= 0) return
    const timer = setInterval(task, intervalMs)
    timer.unref()
    this.timers.push(timer)
  }

  get url(): string {
    const host = this.host.includes(':') ? `[${this.host}]` : this.host
    return `ws://${host}:${this.port}`
  }

  /** Sessions holding a slot. */
  get sessionCount(): number {
    return this.manager.size
  }

  stats(): DuplexServerStats {
    let bufferedBytes = 0
    let maxConnectionBufferedBytes = 0
    let pausedConnections = 0
    for (const connection of this.connections) {
      const buffered = connection.ws.bufferedAmount
      bufferedBytes += buffered
      maxConnectionBufferedBytes = Math.max(maxConnectionBufferedBytes, buffered)
      if (connection.readingPaused) pausedConnections++
    }
    const connections = this.connections.size
    return { connections, sessions: this.manager.size, pausedConnections, bufferedBytes, maxConnectionBufferedBytes }
  }

  /** Drops every connection that did not answer the previous ping, then pings the rest. */
  private pingAll(): void {
    for (const connection of this.connections) connection.ping()
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
    for (const timer of this.timers) clearInterval(timer)
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
    const connection = new Connection(ws, this.flow, (entry) => {
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
    connection.alive = true
    const labels: EventLabels = { eventType: null, eventId: null }
    try {
      if (isBinary) throw new ProtocolError('INVALID_EVENT', 'binary frames are not supported; send JSON text')
      const size = byteLength(data)
      if (size > this.maxMessageBytes) {
        throw new ProtocolError('MESSAGE_TOO_LARGE', `a message may hold at most ${this.maxMessageBytes} bytes, got ${size}`)
      }
      const parsed = parseClientEvent(rawText(data), labels)
      this.handle(connection, parsed.command)
    } catch (error) {
      connection.send(errorEvent(error, labels.eventType, labels.eventId))
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

/** One WebSocket connection and the session it drives. Bounded: what waits to be sent is at most
 *  about FlowLimits.maxBufferedBytes (plus the replies to one socket read); above it the server
 *  stops reading the connection, and one that stays above for sendStallMs is closed. */
class Connection {
  entry: Entry | null = null
  /** Answered the last ping (or sent something) since the previous one. */
  alive = true
  /** The server stopped reading this connection: its client does not read what it is sent. */
  readingPaused = false
  private seq = 0
  private stopPump: (() => void) | null = null
  private readonly stall: StallTimer

  constructor(
    readonly ws: WebSocket,
    private readonly flow: FlowLimits,
    /** The session's terminal event went out: the server forgets it. */
    private readonly ended: (entry: Entry) => void,
  ) {
    this.stall = new StallTimer(flow.sendStallMs, () => {
      if (this.readingPaused && this.ws.readyState === OPEN) this.closeStalled()
    })
    ws.on('pong', () => {
      this.alive = true
    })
    ws.on('close', () => this.stall.clear())
  }

  /** Sends a server event, stamped with the next server_event_seq. Resolves when the socket is
   *  back under its bound (the pump waits on it; command replies do not). */
  send(event: ServerEvent): Promise<void> | void {
    if (this.ws.readyState !== OPEN) return
    const { type, ...fields } = event
    const data = JSON.stringify({ type, server_event_seq: ++this.seq, ...fields })
    if (this.ws.bufferedAmount < this.flow.maxBufferedBytes) {
      this.ws.send(data, () => this.written())
      this.checkBound()
      return
    }
    return new Promise((resolve) =>
      this.ws.send(data, () => {
        this.written()
        resolve()
      }),
    )
  }

  /** A heartbeat tick: a connection that did not answer the previous ping is dropped (its session
   *  detaches and may be resumed); the others are pinged. */
  ping(): void {
    if (!this.alive) {
      this.ws.terminate()
      return
    }
    this.alive = false
    try {
      this.ws.ping()
    } catch {
      // The socket is closing; its 'close' handler detaches the session.
    }
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

  /** Above the bound: stop reading, so that a client that floods without reading cannot make the
   *  server buffer replies without end, and close the connection if it stays there. */
  private checkBound(): void {
    if (this.readingPaused || this.ws.bufferedAmount <= this.flow.maxBufferedBytes) return
    this.readingPaused = true
    this.ws.pause()
    this.stall.start()
  }

  /**
   * The client stayed above the bound: the close frame (1008) goes after what is already buffered,
   * for a client that reads again to see, and reading resumes so that the client's own close
   * frame can arrive; what the client still sends is read and dropped (a closing connection
   * sends nothing). One that never completes the close is destroyed after the WebSocket layer's
   * close timeout.
   */
  private closeStalled(): void {
    this.ws.close(CLOSE_SEND_STALLED, 'the client does not read its events')
    this.readingPaused = false
    this.ws.resume()
  }

  /** A send completed: under half the bound again, reading resumes. */
  private written(): void {
    if (!this.readingPaused || this.ws.bufferedAmount > this.flow.maxBufferedBytes / 2) return
    this.readingPaused = false
    this.stall.clear()
    if (this.ws.readyState === OPEN) this.ws.resume()
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

/** The WebSocket layer's handshake: the key checked before the upgrade (a refused client gets
 *  HTTP 401 and never an open WebSocket), and a subprotocol chosen that never echoes the key. */
function upgradeOptions(apiKey: ApiKey | null, maxPayload: number): WsServerOptions {
  const options: WsServerOptions = { maxPayload, handleProtocols: selectSubprotocol }
  if (apiKey === null) return options
  const verify: VerifyClientCallbackAsync = (info, callback) => {
    if (apiKey.inUpgrade(info.req)) callback(true)
    else callback(false, 401, 'Unauthorized', { 'WWW-Authenticate': 'Bearer' })
  }
  options.verifyClient = verify
  return options
}

/** Starts a server over `engine` (driven: the server calls engine.start()). `httpServer`: an
 *  HTTP server already listening whose upgrade requests the sessions take (startServer's, which
 *  serves the HTTP API on the same port); absent, the WebSocket layer listens on its own. */
export async function startDuplexServer(
  engine: Engine,
  options?: DuplexServerOptions,
  httpServer?: import('node:http').Server,
): Promise<DuplexServer> {
  const present = v.options('options', options, [
    'port',
    'host',
    'apiKey',
    'maxSessions',
    'idleTtlMs',
    'disconnectGraceMs',
    'completedAppendLimit',
    'maxMessageBytes',
    'sweepIntervalMs',
    'maxBufferedBytes',
    'sendStallMs',
    'pingIntervalMs',
    'turn',
    'now',
  ])
  const count = (key: string, fallback: number, min: number, max = Number.MAX_SAFE_INTEGER): number =>
    present.has(key) ? v.integer(`options.${key}`, present.get(key), min, max) : fallback
  const port = count('port', DEFAULT_PORT, 0, 65_535)
  const host = present.has('host') ? v.string('options.host', present.get('host')) : '127.0.0.1'
  const apiKey = ApiKey.fromOption('options.apiKey', present)
  const settings: ServerSettings = {
    maxMessageBytes: count('maxMessageBytes', DEFAULT_MAX_MESSAGE_BYTES, 64, 1 << 26),
    turn: (present.get('turn') as TurnOptions | undefined) ?? DEFAULT_TURN,
    sweepIntervalMs: count('sweepIntervalMs', DEFAULT_SWEEP_INTERVAL_MS, 0),
    flow: flowLimits(present),
    pingIntervalMs: count('pingIntervalMs', DEFAULT_PING_INTERVAL_MS, 0),
  }
  const manager = new DuplexSessionManager(engine, {
    maxSessions: present.get('maxSessions') as number | undefined,
    idleTtlMs: present.get('idleTtlMs') as number | null | undefined,
    disconnectGraceMs: present.get('disconnectGraceMs') as number | undefined,
    completedAppendLimit: present.get('completedAppendLimit') as number | undefined,
    now: present.get('now') as (() => number) | undefined,
  })
  // Checks the turn options once, as every session would.
  checkConfig('options', { turn: settings.turn }, engine)
  const ws = await import('ws')
  const wss = await new Promise<WebSocketServer>((resolve, reject) => {
    const common = upgradeOptions(apiKey, Math.max(1 << 20, 4 * settings.maxMessageBytes))
    if (httpServer !== undefined) {
      resolve(new ws.WebSocketServer({ ...common, server: httpServer }))
      return
    }
    const server = new ws.WebSocketServer({ ...common, port, host })
    server.once('listening', () => resolve(server))
    server.once('error', reject)
  })
  engine.start()
  return new DuplexServer(wss, manager, settings)
}
