// One WebSocket connection of the duplex server and the session it drives: its server_event_seq,
// the pump that forwards the session's events to it, its heartbeat, and the bound on what waits
// to be sent (flow.ts): above it the server stops reading the connection, and closes one that
// stays there for sendStallMs.
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
    if (kind === 'session.created' && entry.resumeToken !== null) announced.resume_token = entry.resumeToken
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

export function wireSession(entry: Entry): Record<string, unknown> {
  const session = entry.session
  return {
    id: session.id,
    fence: fenceToWire(session.fence),
    lease_generation: session.leaseGeneration,
    respond: session.respondMode,
  }
}
