// DuplexSessionManager: the full-duplex sessions of one engine (docs/api.md). It owns the core's
// session manager (capacity, two-phase close, expiry: crates/ortex-core/src/session) and opens
// each session on its own engine Request. It never starts the engine: open, append, close,
// detach, resume and collectExpired need no driven engine; responses do.

import { randomUUID } from 'node:crypto'

import { Engine } from '../engine'
import { OrtexError, invalidArgument } from '../errors'
import type { DuplexHost } from '../link'
import type { TurnOptions } from '../types'
import * as v from '../validate'
import { type ContinuationInput, SessionRules, type SessionView, type SessionsOptionsInput } from './core'
import { DEFAULT_EVENT_BUFFER_CAPACITY, type Fence, SessionEventQueue } from './events'
import {
  type DuplexSessionConfig,
  type DuplexSessionOptions,
  DuplexSession,
  type RespondMode,
  type SessionHost,
  type SessionInit,
  checkConfig,
} from './session'

export interface DuplexSessionManagerOptions {
  /** Sessions holding a slot at once (closing ones included); default unlimited. */
  maxSessions?: number
  /** Default 300000; null disables idle expiry. */
  idleTtlMs?: number | null
  /** Default 30000. */
  disconnectGraceMs?: number
  /** Completed appends remembered per session for idempotent retries; default 256. */
  completedAppendLimit?: number
  /** Default Date.now; a test passes a fake clock. */
  now?: () => number
  /** Addition: events a session buffers for its reader before deltas wait; default 1024. */
  eventBufferCapacity?: number
}

/** One session ended by collectExpired(). */
export interface SessionExpiry {
  sessionId: string
  fence: Fence
  /** The generation after the lease ended (ending bumps it). */
  leaseGeneration: number
  /** 'disconnect_grace_expired' (checked first) or 'idle_ttl_expired'. */
  reason: string
}

const MANAGER_KEYS = [
  'maxSessions',
  'idleTtlMs',
  'disconnectGraceMs',
  'completedAppendLimit',
  'now',
  'eventBufferCapacity',
] as const
const OPEN_KEYS = ['sessionId', 'turn', 'respond'] as const

/** What a session store (the WebSocket server's) is told of the sessions (internal). */
export interface SessionPersistenceHooks {
  /** A commit point of `session`. */
  committed(session: DuplexSession): void
  /** The commit points of `session` so far (its events are stamped with it). */
  commits(session: DuplexSession): number
  /** `session` closed (its slot is free); `reason` as in its terminal event. */
  ended(session: DuplexSession, reason: string): void
}

/** A session as a store kept it, for a new owner to rebuild (internal). */
export interface RestoredSession {
  sessionId: string
  incarnation: number
  leaseGeneration: number
  config: DuplexSessionConfig
  tokens: Int32Array
  /** Where the core's rules carry on from (null: at zero, as a record of an older ortex has it). */
  continuation: ContinuationInput | null
}

export class DuplexSessionManager {
  readonly engine: Engine
  private readonly rules: SessionRules
  private readonly now: () => number
  private readonly eventBufferCapacity: number
  private readonly sessions = new Map<string, DuplexSession>()
  private readonly host: SessionHost
  private readonly stopWatching: () => void
  private readonly duplex: DuplexHost
  /** Most sessions at once (undefined: no limit). */
  private readonly maxSessions: number | undefined
  /** @internal Set by a server with a session store. */
  _persistence: SessionPersistenceHooks | null = null

  constructor(engine: Engine, options?: DuplexSessionManagerOptions) {
    if (!(engine instanceof Engine)) {
      throw invalidArgument(`engine must be an Engine, got ${v.describe(engine)}`)
    }
    const present = v.options('options', options, MANAGER_KEYS)
    // Only what the caller gave: the defaults are the core's (LIMITS in ts/generated/boundary.ts).
    const core: SessionsOptionsInput = {}
    if (present.has('maxSessions')) core.maxSessions = v.integer('options.maxSessions', present.get('maxSessions'), 1)
    if (present.has('idleTtlMs')) {
      const ttl = present.get('idleTtlMs')
      core.idleTtlMs = ttl === null ? null : v.integer('options.idleTtlMs', ttl, 1, Number.MAX_SAFE_INTEGER)
    }
    if (present.has('disconnectGraceMs')) {
      core.disconnectGraceMs = v.integer('options.disconnectGraceMs', present.get('disconnectGraceMs'), 1, Number.MAX_SAFE_INTEGER)
    }
    if (present.has('completedAppendLimit')) {
      core.completedAppendLimit = v.integer('options.completedAppendLimit', present.get('completedAppendLimit'), 1)
    }
    const now = present.get('now')
    if (now !== undefined && typeof now !== 'function') {
      throw invalidArgument(`options.now must be a function, got ${v.describe(now)}`)
    }
    this.maxSessions = core.maxSessions ?? undefined
    this.now = now === undefined ? Date.now : (now as () => number)
    this.eventBufferCapacity = present.has('eventBufferCapacity')
      ? v.integer('options.eventBufferCapacity', present.get('eventBufferCapacity'), 1, 1 << 20)
      : DEFAULT_EVENT_BUFFER_CAPACITY
    const duplex = engine._duplex
    duplex.checkOpen()
    this.engine = engine
    this.duplex = duplex
    // Weakly: the engine's listener must not keep a manager the program dropped alive.
    const self = new WeakRef(this)
    this.stopWatching = duplex.onEnd((reason) => self.deref()?.endAll(reason))
    this.rules = new SessionRules(duplex.createSessions(core))
    this.host = {
      engine,
      duplex,
      rules: this.rules,
      now: () => this.clock(),
      finalize: (session) => this.finalize(session),
      committed: (session) => this._persistence?.committed(session),
    }
  }

  /** Sessions holding a slot (a closing one keeps its slot until its request is closed). */
  get size(): number {
    return this.rules.numSessions()
  }

  /** Whether an open() now would be refused with CAPACITY_EXHAUSTED (maxSessions are held). */
  get full(): boolean {
    return this.maxSessions !== undefined && this.size >= this.maxSessions
  }

  /**
   * Opens a session on a new engine Request. CAPACITY_EXHAUSTED (retryable) when maxSessions are
   * open, SESSION_EXISTS for an id in use; a closed id opens again as a new incarnation.
   */
  open(options?: DuplexSessionOptions): DuplexSession {
    const present = v.options('options', options, OPEN_KEYS)
    const sessionId = present.has('sessionId') ? v.sessionId('options.sessionId', present.get('sessionId')) : randomUUID()
    const config = checkConfig('options', {
      ...(present.has('turn') ? { turn: present.get('turn') } : {}),
      ...(present.has('respond') ? { respond: present.get('respond') } : {}),
    }, this.engine)
    return this.openWith(sessionId, config, (now) => this.rules.open(sessionId, now))
  }

  /**
   * @internal Rebuilds a session a store kept (another process held it): it opens at the stored
   * incarnation, its lease at the stored generation, and its conversation is prefilled.
   */
  _restore(state: RestoredSession): DuplexSession {
    const config = checkConfig('state.config', state.config, this.engine)
    const session = this.openWith(state.sessionId, config, (now) =>
      this.rules.restore(state.sessionId, now, state.incarnation, state.leaseGeneration, state.continuation),
    )
    try {
      session._restore(state.tokens)
    } catch (error) {
      void session.close('restore_failed')
      throw error
    }
    return session
  }

  private openWith(sessionId: string, config: DuplexSessionConfig, openRules: (now: number) => SessionView): DuplexSession {
    this.duplex.checkUsable()
    // The request first: a refused open closes it again, and the rules are left untouched.
    const request = this.engine.createRequest()
    let view: SessionView
    try {
      view = openRules(this.clock())
    } catch (error) {
      request.close()
      throw error
    }
    try {
      this.rules.bindRequest(sessionId, request.id)
    } catch (error) {
      request.close()
      this.rules.beginClose(sessionId, null, 'open_failed')
      this.rules.finalizeClose(sessionId)
      throw error
    }
    let session: DuplexSession | null = null
    const commits = (): number => (session === null ? 0 : (this._persistence?.commits(session) ?? 0))
    const init: SessionInit = {
      host: this.host,
      request,
      view,
      config: { turn: config.turn ?? {}, respond: config.respond ?? ('on-final' satisfies RespondMode) },
      events: new SessionEventQueue(this.eventBufferCapacity, commits),
    }
    session = DuplexSession._create(init)
    // Keyed by the id the core holds, so that the two sides can never disagree about a session.
    this.sessions.set(session.id, session)
    return session
  }

  /** The open (or detached) session with this id. */
  get(sessionId: string): DuplexSession | undefined {
    v.sessionId('sessionId', sessionId)
    return this.sessions.get(sessionId)
  }

  /** Every session holding a slot, in opening order. */
  list(): DuplexSession[] {
    return [...this.sessions.values()]
  }

  /**
   * Ends every session whose disconnect grace (checked first) or idle TTL ran out at `nowMs`
   * (default: the clock): each one's close begins, its request is closed (KV freed), its slot is
   * freed, and it emits session.expired.
   */
  collectExpired(nowMs?: number): SessionExpiry[] {
    const at = nowMs === undefined ? this.clock() : v.finite('nowMs', nowMs, 0, Number.MAX_SAFE_INTEGER)
    const expired = this.rules.collectExpired(at)
    for (const expiry of expired) {
      const session = this.sessions.get(expiry.sessionId)
      if (session !== undefined) session._expire(expiry.reason, expiry.fence)
      else this.releaseUnknown(expiry.sessionId)
    }
    return expired.map(({ sessionId, fence, leaseGeneration, reason }) => ({ sessionId, fence, leaseGeneration, reason }))
  }

  /** Closes every session (addition). */
  async close(reason = 'manager_close'): Promise<void> {
    this.stopWatching()
    await Promise.all(this.list().map((session) => session.close(reason)))
  }

  /** Test hook: the core's session accounting invariants. */
  checkInvariants(): void {
    this.rules.checkInvariants()
    if (this.rules.numSessions() !== this.sessions.size) {
      throw new Error(`session manager drift: core holds ${this.rules.numSessions()}, facade ${this.sessions.size}`)
    }
  }

  private clock(): number {
    const now = this.now()
    if (typeof now !== 'number' || !Number.isFinite(now) || now < 0) {
      throw invalidArgument(`the session clock returned ${v.describe(now)}; it must return milliseconds >= 0`)
    }
    return now
  }

  /** A session the core expired that this manager does not hold (it never should): its slot is
   *  freed and the requests bound to it are closed, so that nothing it held stays alive. */
  private releaseUnknown(sessionId: string): void {
    for (const requestId of this.rules.finalizeClose(sessionId)) this.duplex.closeRequest(requestId)
  }

  /** The engine failed or was closed: every session ends with one session.closed carrying the
   *  reason, and later commands are refused with SESSION_CLOSED. */
  private endAll(reason: 'engine_failure' | 'engine_closed'): void {
    for (const session of this.list()) session._endForEngine(reason)
  }

  /** The second phase of a close: frees the slot. Returns the session's last fence. */
  private finalize(session: DuplexSession): Fence {
    const fence = session.fence
    try {
      this.rules.finalizeClose(session.id)
    } catch (error) {
      // Only rules that are gone answer so: their WebAssembly instance trapped (ENGINE_UNHEALTHY),
      // and the slot went with them. The session still ends here, with its session.closed.
      if (!(error instanceof OrtexError && error.code === 'ENGINE_UNHEALTHY')) throw error
    }
    if (this.sessions.get(session.id) === session) this.sessions.delete(session.id)
    this._persistence?.ended(session, session.closeReason ?? 'closed')
    return fence
  }
}

export type { DuplexSessionOptions, TurnOptions }
