// One WebSocket connection of the duplex server and the session it drives: its server_event_seq,
// the pump that forwards the session's events to it, its heartbeat, and the bound on what waits
// to be sent (flow.ts): above it the server stops reading the connection, and closes one that
// stays there for sendStallMs.
//
// With a session store, nothing reaches the client before the store holds every commit made
// before it was produced (an append's input.committed, a response.done, and whatever follows them
// in order): events wait in the connection's outbox, in order, until the store has them. So what
// a client was told survives its process; the cost is one store write per commit point.
//
//   reply or session event ──▶ stamped with the session's commits ──▶ outbox ──(store holds them)──▶ socket
//                                                                            └─(never will: the session
//                                                                               lives on elsewhere)──▶ dropped
//
// A session the server holds is an Entry (websocket.ts keeps them by session id); its connection
// is the one driving it now, or null while it is detached.

import type { RawData, WebSocket } from 'ws'

import type { SessionEvent } from '../../duplex/events'
import type { DuplexSession } from '../../duplex/session'
import { type FlowLimits, StallTimer } from '../flow'
import { type ServerEvent, fenceToWire, sessionEventToWire } from './protocol'

/** The close code for a connection whose client stopped reading (RFC 6455: policy violation). */
export const CLOSE_SEND_STALLED = 1008
/** A WebSocket's readyState while open. */
export const OPEN = 1

/** Most events a connection's outbox holds while they wait for the store; above it the server
 *  stops reading the connection (a client that keeps sending while the store is away cannot make
 *  the replies pile up without end), and reads again once half went out. */
const MAX_OUTBOX_EVENTS = 1024

/** When the store holds a session's commits (persistence.ts; absent without a store). */
export interface Durability {
  /** The session's commit points so far. */
  commits(session: DuplexSession): number
  /** null when the store holds the first `commits`; else whether it ever will. */
  held(session: DuplexSession, commits: number): Promise<boolean> | null
}

/** An event waiting for the store, and, for one of the session's own events, the session's queue
 *  it goes back to if this connection ends first. */
interface Pending {
  event: ServerEvent
  session: DuplexSession | null
  commits: number
  sessionEvent: SessionEvent | null
  sent: () => void
}

/** A session the server holds, and the connection driving it (null while detached). */
export interface Entry {
  session: DuplexSession
  /** sha256 of the resume token: compared in constant time, never stored in the clear. */
  tokenDigest: Buffer
  /** The token itself, for session.created only (null for a session taken over from a store). */
  resumeToken: string | null
  connection: Connection | null
}

/** One WebSocket connection and the session it drives. Bounded: what waits to be sent is at most
 *  about FlowLimits.maxBufferedBytes (plus the replies to one socket read); above it the server
 *  stops reading the connection, and one that stays above for sendStallMs is closed. */
export class Connection {
  entry: Entry | null = null
  /** While a resume waits for the session store: the messages that came after it. */
  resuming: { data: RawData; isBinary: boolean }[] | null = null
  /** Answered the last ping (or sent something) since the previous one. */
  alive = true
  /** The server stopped reading this connection: its client does not read what it is sent. */
  readingPaused = false
  private seq = 0
  private stopPump: (() => void) | null = null
  private readonly stall: StallTimer
  /** Events waiting for the store, in order (see the file comment). */
  private outbox: Pending[] = []
  private draining = false
  /** Reading stopped because the outbox is full. */
  private outboxFull = false
  /** Who waits for the outbox to be empty (outboxSent()). */
  private emptied: (() => void)[] = []

  constructor(
    readonly ws: WebSocket,
    private readonly flow: FlowLimits,
    /** The session's terminal event went out: the server forgets it. */
    private readonly ended: (entry: Entry) => void,
    private readonly durability: Durability | null = null,
  ) {
    this.stall = new StallTimer(flow.sendStallMs, () => {
      if (this.readingPaused && this.ws.readyState === OPEN) this.closeStalled()
    })
    ws.on('pong', () => {
      this.alive = true
    })
    ws.on('close', () => this.stall.clear())
  }

  /** Sends a server event once the store holds every commit its session made so far (at once
   *  without a store), after the events before it. Resolves when it went out and the socket is
   *  back under its bound (the pump waits on it; command replies do not). */
  send(event: ServerEvent, sessionEvent: SessionEvent | null = null): Promise<void> | void {
    if (this.ws.readyState !== OPEN) return
    const session = this.entry?.session ?? null
    // A session's event depends on the commits made before it was produced; a reply, on all so far.
    let commits = 0
    if (session !== null && this.durability !== null) {
      commits = sessionEvent === null ? this.durability.commits(session) : session._eventQueue.stampOf(sessionEvent)
    }
    if (this.outbox.length === 0 && (commits === 0 || this.durability!.held(session!, commits) === null)) return this.transmit(event)
    return new Promise((sent) => {
      this.outbox.push({ event, session, commits, sessionEvent, sent })
      if (this.outbox.length > MAX_OUTBOX_EVENTS && !this.outboxFull) {
        this.outboxFull = true
        this.ws.pause()
      }
      void this.drain()
    })
  }

  /** Resolves once nothing waits in the outbox (sent, dropped, or given back to the session). */
  outboxSent(): Promise<void> {
    if (this.outbox.length === 0) return Promise.resolve()
    return new Promise((resolve) => this.emptied.push(resolve))
  }

  private wakeEmptied(): void {
    if (this.outbox.length > 0) return
    const waiters = this.emptied
    this.emptied = []
    for (const wake of waiters) wake()
  }

  /** Sends the outbox in order, each event once the store holds what it depends on. */
  private async drain(): Promise<void> {
    if (this.draining) return
    this.draining = true
    try {
      while (this.outbox.length > 0) {
        const head = this.outbox[0]!
        const waiting = head.session === null || head.commits === 0 ? null : this.durability!.held(head.session, head.commits)
        const deliver = waiting === null ? true : await waiting
        // The connection ended meanwhile: release() gives (or gave) the session's events back.
        if (this.outbox[0] !== head || this.ws.readyState !== OPEN) return
        this.outbox.shift()
        if (this.outboxFull && this.outbox.length <= MAX_OUTBOX_EVENTS / 2) this.outboxEmptied()
        if (deliver || isTerminal(head.event)) await this.transmit(head.event)
        head.sent()
      }
    } finally {
      this.draining = false
      this.wakeEmptied()
    }
  }

  /** Stamps the next server_event_seq and writes the event to the socket. */
  private transmit(event: ServerEvent): Promise<void> | void {
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
    if (kind === 'session.created' && entry.resumeToken !== null) announced.resume_token = entry.resumeToken
    this.send(announced)
    this.pump(entry)
  }

  /** The connection no longer drives `entry`'s session; its events stay queued for the next,
   *  those still waiting in the outbox too. */
  release(entry: Entry): void {
    if (this.entry !== entry) return
    this.entry = null
    if (entry.connection === this) entry.connection = null
    const waiting = this.outbox
    this.outbox = []
    if (this.outboxFull) this.outboxEmptied()
    for (const pending of waiting.reverse()) {
      if (pending.sessionEvent !== null && pending.session === entry.session) entry.session._eventQueue.putBack(pending.sessionEvent)
      pending.sent()
    }
    this.wakeEmptied()
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
    if (this.ws.readyState === OPEN && !this.outboxFull) this.ws.resume()
  }

  /** The outbox went down to half its bound: reading resumes (unless the socket is full). */
  private outboxEmptied(): void {
    this.outboxFull = false
    if (this.ws.readyState === OPEN && !this.readingPaused) this.ws.resume()
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
        await this.send(sessionEventToWire(event), event)
        // Released while it waited for the store: the event went back to the session's queue.
        if (released) return
        if (event.type === 'session.closed' || event.type === 'session.expired') {
          this.release(entry)
          this.ended(entry)
          return
        }
      }
    })()
  }
}

function isTerminal(event: ServerEvent): boolean {
  return event.type === 'session.closed' || event.type === 'session.expired'
}

export function wireSession(entry: Entry): Record<string, unknown> {
  const session = entry.session
  return {
    id: session.id,
    fence: fenceToWire(session.fence),
    lease_generation: session.leaseGeneration,
    respond: session.respondMode,
  }
}
