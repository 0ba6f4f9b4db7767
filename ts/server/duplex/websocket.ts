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
//
// This file is the started server: its sessions by id (each an Entry), the commands, resume
// (through the session store too), drain and close. start.ts starts it (options, handshake, the
// store); connection.ts is one connection (seq, pump, heartbeat, backpressure); persistence.ts
// writes the store's records; protocol.ts is the wire format.

import { createHash, randomBytes, timingSafeEqual } from 'node:crypto'
import type { AddressInfo } from 'node:net'
import { hostname } from 'node:os'

import type { RawData, WebSocket, WebSocketServer } from 'ws'

import { OrtexError } from '../../errors'
import type { ContinuationInput } from '../../duplex/core'
import type { DuplexSessionManager } from '../../duplex/manager'
import type { DuplexSessionConfig } from '../../duplex/session'
import type { TurnOptions } from '../../types'
import { type SessionStore, SessionStoreUnavailable, type StoredSession } from '../../store/session-store'
import { Connection, type Entry, OPEN, wireSession } from './connection'
import { SessionPersistence } from './persistence'
import type { FlowLimits } from '../flow'
import {
  type ClientCommand,
  ProtocolError,
  type EventLabels,
  committedEvent,
  errorEvent,
  fenceToWire,
  parseClientEvent,
} from './protocol'

/** The close code of a drain (RFC 6455 registry: "Service Restart"): resume the session. */
export const CLOSE_SERVICE_RESTART = 1012
/** How long detachAll() waits for the clients to answer the close. */
const DETACH_CLOSE_WAIT_MS = 1000

/** @internal What a started server was configured with (validated; start.ts). */
export interface ServerSettings {
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

/** @internal The session store of a server, and what it was opened with (start.ts). */
export interface StoreSettings {
  store: SessionStore
  /** The server connected it (from a URL): it disconnects it at close. */
  owned: boolean
  ttlMs: number
}

/** Most messages a connection may send while its resume waits for the store; they are handled,
 *  in order, once the resume is done. */
const MAX_MESSAGES_DURING_RESUME = 64

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
  /** @internal This server's id in a session store's records. */
  readonly owner: string
  /** @internal Set when the server has a session store. */
  readonly persistence: SessionPersistence | null = null
  /** Set by stopAccepting(): upgrades are refused with 503 (read by the handshake). */

  /** @internal */
  constructor(
    private readonly wss: WebSocketServer,
    manager: DuplexSessionManager,
    settings: ServerSettings,
    /** Read by the handshake: closed, upgrades are refused with 503. */
    private readonly admission: { open: boolean },
    private readonly storage: StoreSettings | null = null,
  ) {
    this.manager = manager
    this.maxMessageBytes = settings.maxMessageBytes
    this.turn = settings.turn
    this.flow = settings.flow
    const address = wss.address() as AddressInfo
    this.host = address.address
    this.port = address.port
    this.owner = `${hostname()}:${process.pid}:${randomBytes(6).toString('hex')}`
    if (storage !== null) {
      this.persistence = new SessionPersistence({
        store: storage.store,
        owner: this.owner,
        ttlMs: storage.ttlMs,
        tokenDigestOf: (session) => this.entries.get(session.id)?.tokenDigest.toString('hex') ?? null,
        onFenced: (session) => void session.close('fenced_out').catch(() => {}),
      })
      this.persistence.attach(manager)
    }
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

  /** New WebSocket upgrades are refused with HTTP 503 from now on (a drain). */
  stopAccepting(): void {
    this.admission.open = false
  }

  /** Whether any session has a response that has not ended. */
  responding(): boolean {
    return this.manager.list().some((session) => session.responding)
  }

  /**
   * Detaches every session from its connection with a resumable close: the connection is closed
   * with code 1012 ("service restart"), which tells the client to reconnect and resume. Resolves
   * once the clients have answered the close (at most DETACH_CLOSE_WAIT_MS).
   */
  async detachAll(): Promise<void> {
    // The sessions' last commits reach the store before their clients are told to move, and
    // what waited for them reaches the clients.
    await this.persistence?.flush()
    const sent = Promise.all([...this.connections].map((connection) => connection.outboxSent()))
    await Promise.race([sent, new Promise((resolve) => setTimeout(resolve, DETACH_CLOSE_WAIT_MS).unref())])
    const closed: Promise<void>[] = []
    for (const connection of this.connections) {
      if (connection.ws.readyState !== OPEN) continue
      closed.push(new Promise((resolve) => connection.ws.once('close', () => resolve())))
      connection.ws.close(CLOSE_SERVICE_RESTART, 'the server is draining: resume the session')
    }
    await Promise.race([Promise.all(closed), new Promise((resolve) => setTimeout(resolve, DETACH_CLOSE_WAIT_MS).unref())])
  }

  /** Stops accepting, drops every connection and closes every session (their KV is freed). The
   *  engine is the caller's: it is neither stopped nor closed. */
  close(): Promise<void> {
    if (this.closing !== null) return this.closing
    for (const timer of this.timers) clearInterval(timer)
    this.closing = (async () => {
      for (const connection of this.connections) connection.ws.terminate()
      // The last snapshots (the detaches just now) go to the store before the sessions close.
      await this.persistence?.flush()
      await this.manager.close('server_shutdown')
      this.entries.clear()
      await new Promise<void>((resolve) => this.wss.close(() => resolve()))
      if (this.storage?.owned === true) await this.storage.store.quit()
    })()
    return this.closing
  }

  // ---- connections -----------------------------------------------------------------------------

  private accept(ws: WebSocket): void {
    if (this.closing !== null) {
      ws.terminate()
      return
    }
    const connection = new Connection(
      ws,
      this.flow,
      (entry) => {
        if (this.entries.get(entry.session.id) === entry) this.entries.delete(entry.session.id)
      },
      this.persistence,
    )
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
    if (connection.resuming !== null) {
      // The session is being taken over from the store: what follows it waits, in order.
      if (connection.resuming.length < MAX_MESSAGES_DURING_RESUME) connection.resuming.push({ data, isBinary })
      else connection.send(errorEvent(new ProtocolError('INVALID_EVENT', 'too many events while a resume is in progress; wait for session.resumed'), null, null))
      return
    }
    const labels: EventLabels = { eventType: null, eventId: null }
    try {
      if (isBinary) throw new ProtocolError('INVALID_EVENT', 'binary frames are not supported; send JSON text')
      const size = byteLength(data)
      if (size > this.maxMessageBytes) {
        throw new ProtocolError('MESSAGE_TOO_LARGE', `a message may hold at most ${this.maxMessageBytes} bytes, got ${size}`)
      }
      const parsed = parseClientEvent(rawText(data), labels)
      this.handle(connection, parsed.command, labels)
    } catch (error) {
      connection.send(errorEvent(error, labels.eventType, labels.eventId))
    }
  }

  private handle(connection: Connection, command: ClientCommand, labels: EventLabels): void {
    if (command.type === 'session.resume') {
      if (this.storage === null) this.resume(connection, command.sessionId, command.resumeToken, command.leaseGeneration)
      else this.resumeThroughStore(connection, command, labels)
      return
    }
    if (command.type === 'session.close' || command.type === 'session.heartbeat') {
      const entry = connection.entry
      if (entry === null) throw new ProtocolError('NO_SESSION', 'this connection has no session')
      if (command.type === 'session.heartbeat') {
        entry.session.heartbeat()
        this.persistence?.touch(entry.session)
      } else void entry.session.close(command.reason ?? 'client_close')
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
        // The session's configuration began as the server's turn options and has every
        // session.update since; the event's own options override it for this response only.
        session.respond(command.options)
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
    // The record exists from the start, so the session can move before its first commit; the
    // client learns of the session once the store holds it.
    this.persistence?.committed(session)
    connection.attach(entry, 'session.created')
    return entry
  }

  /**
   * session.resume with a session store: the store's compare-and-set on the lease generation
   * decides, whichever process the resume reached. If this process holds the session (same
   * owner and incarnation) the generation moves and the session goes on here; otherwise the
   * session moves here with the next incarnation (its old owner is fenced out at its next
   * write) and is rebuilt from the stored conversation. Messages that follow the resume wait.
   */
  private resumeThroughStore(connection: Connection, resume: Extract<ClientCommand, { type: 'session.resume' }>, labels: EventLabels): void {
    if (connection.entry !== null) {
      throw new ProtocolError('INVALID_EVENT', 'this connection already has a session; resume on a new connection')
    }
    const requestLabels = { ...labels }
    connection.resuming = []
    void this.claim(connection, resume)
      .then(() => {
        // The connection dropped while the store answered: its 'close' found no session to
        // detach, so the session is detached now (it waits for the next resume, then expires).
        if (connection.ws.readyState !== OPEN) this.onDrop(connection)
      })
      .catch((error: unknown) => connection.send(errorEvent(error, requestLabels.eventType, requestLabels.eventId)))
      .finally(() => {
        const waiting = connection.resuming ?? []
        connection.resuming = null
        for (const message of waiting) this.onMessage(connection, message.data, message.isBinary)
      })
  }

  private async claim(connection: Connection, resume: Extract<ClientCommand, { type: 'session.resume' }>): Promise<void> {
    const { sessionId, resumeToken: token, leaseGeneration: generation } = resume
    const store = this.storage!.store
    const tokenDigest = digest(token)
    const held = (): Entry | undefined => {
      const entry = this.entries.get(sessionId)
      return entry !== undefined && entry.session.state !== 'closed' && entry.session.state !== 'closing' ? entry : undefined
    }
    const claimer = (): { owner: string; heldIncarnation: number | null } => ({
      owner: this.owner,
      heldIncarnation: held()?.session.fence.incarnation ?? null,
    })
    const ttlMs = this.storage!.ttlMs
    // A session this process would have no slot for must not be claimed: a claim cannot be undone.
    if (held() === undefined && this.manager.full) {
      throw new OrtexError('CAPACITY_EXHAUSTED', 'this server holds its most sessions; resume on another')
    }
    let outcome = await this.storeCall(() => store.claim(sessionId, tokenDigest.toString('hex'), generation, claimer(), ttlMs))
    if (outcome.kind === 'missing' && held() !== undefined) {
      // The store lost its data (a restart without persistence): the owner writes it again.
      this.persistence!.committed(held()!.session)
      await this.persistence!.flush()
      outcome = await this.storeCall(() => store.claim(sessionId, tokenDigest.toString('hex'), generation, claimer(), ttlMs))
    }
    switch (outcome.kind) {
      case 'missing':
      case 'closed':
        throw new OrtexError('SESSION_CLOSED', `there is no open session ${JSON.stringify(sessionId.slice(0, 128))}`)
      case 'bad-token':
        throw new ProtocolError('INVALID_RESUME_TOKEN', 'the resume token does not match the session')
      case 'generation-mismatch':
        throw new OrtexError('LEASE_GENERATION_MISMATCH', `lease generation mismatch: expected ${outcome.current}, got ${generation}`)
      case 'kept': {
        const entry = held()
        if (entry === undefined) throw new OrtexError('SESSION_CLOSED', `session ${sessionId} closed during the resume`)
        this.resume(connection, sessionId, token, generation)
        return
      }
      case 'moved':
        this.takeOver(connection, outcome.record, tokenDigest, resume.lastResponseSeq)
    }
  }

  /**
   * The session moved here: a local copy of an older life is dropped, and the session is rebuilt
   * from its record, its rules carrying on where they stood. Responses that had not ended there
   * end here, failed; so do those that ended after the last one the client saw end
   * (`lastResponseSeq`, when it says): their output is taken out of the conversation, which is
   * then what the client knows of it.
   */
  private takeOver(connection: Connection, claimed: StoredSession, tokenDigest: Buffer, lastResponseSeq: number | null): void {
    // A store of the application's own may answer without the newer fields.
    const stored = { ...claimed, continuation: claimed.continuation ?? null, endedResponses: claimed.endedResponses ?? [] }
    const record = lastResponseSeq === null ? stored : withoutUnseen(stored, lastResponseSeq)
    const stale = this.entries.get(record.sessionId)
    if (stale !== undefined) {
      stale.connection?.release(stale)
      this.entries.delete(record.sessionId)
      if (stale.session.state !== 'closed') void stale.session.close('fenced_out').catch(() => {})
    }
    const session = this.manager._restore({
      sessionId: record.sessionId,
      incarnation: record.incarnation,
      leaseGeneration: record.leaseGeneration,
      config: JSON.parse(record.config) as DuplexSessionConfig,
      tokens: record.tokens,
      continuation: record.continuation === null ? null : (JSON.parse(record.continuation) as ContinuationInput),
    })
    const entry: Entry = { session, tokenDigest, resumeToken: null, connection: null }
    this.entries.set(session.id, entry)
    connection.attach(entry, 'session.resumed')
    // The record of this life (the responses below taken back) is written before they are told.
    this.persistence!.committed(session)
    for (const fence of record.pendingResponses) {
      session._eventQueue.push({
        type: 'response.done',
        fence,
        status: 'failed',
        finishReason: 'failed',
        errorCode: 'none',
        usage: { promptTokens: 0, generatedTokens: 0, cachedPromptTokens: 0 },
      })
    }
  }

  /** A store call; the store being away is the retryable SESSION_STORE_UNAVAILABLE. */
  private async storeCall<T>(call: () => Promise<T>): Promise<T> {
    try {
      return await call()
    } catch (error) {
      if (error instanceof SessionStoreUnavailable) {
        throw new ProtocolError('SESSION_STORE_UNAVAILABLE', `${error.message}; retry the resume`, true)
      }
      throw error
    }
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

/**
 * `record` as the client that saw the end of response `lastResponseSeq` (and none after) knows
 * it: each response that ended after it is taken back (its output out of the conversation) and
 * joins the pending ones, which a new owner ends failed. Only the latest responses' places are
 * kept (RECENT_RESPONSES); an older one stays.
 */
function withoutUnseen(record: StoredSession, lastResponseSeq: number): StoredSession {
  const unseen = record.endedResponses.filter((response) => response.fence.responseSeq > lastResponseSeq)
  if (unseen.length === 0) return record
  const parts: Int32Array[] = []
  let at = 0
  for (const { start, length } of [...unseen].sort((a, b) => a.start - b.start)) {
    if (length === 0 || start < at) continue
    parts.push(record.tokens.subarray(at, start))
    at = start + length
  }
  parts.push(record.tokens.subarray(at))
  const tokens = new Int32Array(parts.reduce((sum, part) => sum + part.length, 0))
  let offset = 0
  for (const part of parts) {
    tokens.set(part, offset)
    offset += part.length
  }
  const pendingResponses = [...unseen.map((response) => response.fence), ...record.pendingResponses]
  pendingResponses.sort((a, b) => a.responseSeq - b.responseSeq)
  const endedResponses = record.endedResponses.filter((response) => response.fence.responseSeq <= lastResponseSeq)
  return { ...record, tokens, pendingResponses, endedResponses }
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

