// The WebSocket server's side of a session store (ts/store/session-store.ts): it writes each
// session's record at the session's commit points, coalesced (one write in flight per session;
// commits that arrive meanwhile are covered by one more write of the newest snapshot, since a
// record is always written whole), ends the record when the session ends for good, and tells the
// server when a write found that another process has taken the session over (fenced out).
//
// It also says when the store holds a commit: the server sends a client nothing that depends on
// a commit before the store holds it (connection.ts), so that what a client was told survives the
// process. Commit points are counted per session; a write covers every commit counted when its
// snapshot was taken.
//
//   commit point ──▶ commits + 1, dirty ──▶ (one write at a time) snapshot ──▶ store.commit ─┬─ written: held = commits then
//                                                                                           ├─ fenced/closed ──▶ onFenced
//                                                                                           └─ store down ──▶ retry later

import type { DuplexSessionManager, SessionPersistenceHooks } from '../../duplex/manager'
import type { DuplexSession } from '../../duplex/session'
import type { SessionStore, StoredSession } from '../../store/session-store'

/** Close reasons after which the record stays, for another process to take the session over:
 *  the process is stopping, lost the session, or cannot run it. */
const RESUMABLE_ELSEWHERE = new Set(['server_shutdown', 'fenced_out', 'engine_failure', 'engine_closed', 'restore_failed', 'internal_error'])

/** How long a write that failed (the store is away) waits before it is tried again. */
const RETRY_AFTER_FAILURE_MS = 500

interface Waiter {
  commits: number
  resolve: (held: boolean) => void
}

interface Writer {
  /** A commit point came after the last snapshot was taken. */
  dirty: boolean
  writing: Promise<void> | null
  retry: NodeJS.Timeout | null
  /** The session's commit points so far. */
  commits: number
  /** How many of them the store holds (a write covers every commit before its snapshot). */
  held: number
  /** Who waits for the store to hold a commit, in the order they came. */
  waiters: Waiter[]
}

export interface PersistenceSettings {
  store: SessionStore
  /** This server's id in the records. */
  owner: string
  /** The records' time to live, renewed at each write. */
  ttlMs: number
  /** The SHA-256 (hex) of the session's resume token. */
  tokenDigestOf(session: DuplexSession): string | null
  /** A write found the session held by another process (or closed): drop the local copy. */
  onFenced(session: DuplexSession): void
}

export class SessionPersistence implements SessionPersistenceHooks {
  private readonly writers = new Map<DuplexSession, Writer>()
  /** Sessions that ended here, and whether what they said before is to be delivered: a session
   *  that lives on elsewhere from its record must not tell its client what the record lacks. */
  private readonly endings = new WeakMap<DuplexSession, boolean>()
  /** Writes that failed because the store was away (monitoring and tests). */
  failedWrites = 0

  constructor(private readonly settings: PersistenceSettings) {}

  attach(manager: DuplexSessionManager): void {
    manager._persistence = this
    // A store back after an outage may have restarted empty: every record is written again (a
    // session another process claimed meanwhile is fenced out by that write, as it should be).
    this.settings.store.onReconnect?.(() => {
      for (const session of this.writers.keys()) this.committed(session)
    })
  }

  committed(session: DuplexSession): void {
    let writer = this.writers.get(session)
    if (writer === undefined) {
      writer = { dirty: false, writing: null, retry: null, commits: 0, held: 0, waiters: [] }
      this.writers.set(session, writer)
    }
    writer.commits++
    writer.dirty = true
    writer.writing ??= this.write(session, writer)
  }

  /** The commit points of `session` so far: an event produced now depends on all of them. */
  commits(session: DuplexSession): number {
    return this.writers.get(session)?.commits ?? 0
  }

  /**
   * Whether the store holds the first `commits` commit points of `session`: null when it does
   * already; else a promise of true once it does, or of false when it never will (the session
   * ended here and goes on elsewhere from a record without them: what depends on them must not
   * be told). While the store is away the promise waits: the writes are retried.
   */
  held(session: DuplexSession, commits: number): Promise<boolean> | null {
    const writer = this.writers.get(session)
    if (writer === undefined) {
      const deliver = this.endings.get(session)
      return deliver === undefined ? null : Promise.resolve(deliver)
    }
    if (writer.held >= commits) return null
    return new Promise((resolve) => writer.waiters.push({ commits, resolve }))
  }

  ended(session: DuplexSession, reason: string): void {
    const writer = this.writers.get(session)
    if (writer?.retry != null) clearTimeout(writer.retry)
    this.writers.delete(session)
    const resumable = RESUMABLE_ELSEWHERE.has(reason)
    // Ended for good here, nothing can contradict what the session said; ended to go on
    // elsewhere, what the record does not hold is unsaid.
    this.endings.set(session, !resumable)
    for (const waiter of writer?.waiters ?? []) waiter.resolve(!resumable)
    if (resumable) return
    const { store, owner, ttlMs } = this.settings
    // Lost in an outage, the tombstone is missing and the record expires with its TTL instead.
    store.end(session.id, owner, session.fence.incarnation, ttlMs).catch(() => {})
  }

  /** Client activity without a commit (a heartbeat): the record must not expire. */
  touch(session: DuplexSession): void {
    this.settings.store.touch(session.id, this.settings.ttlMs).catch(() => {})
  }

  /** Resolves when every write in flight, and the one each dirty session still needs, is done
   *  (a drain's last snapshots). A write that fails is not retried here. */
  async flush(): Promise<void> {
    for (const [session, writer] of this.writers) {
      if (writer.dirty && writer.writing === null) writer.writing = this.write(session, writer)
    }
    await Promise.all([...this.writers.values()].map((writer) => writer.writing))
  }

  /** Writes the newest snapshot until no commit point is left unwritten. */
  private async write(session: DuplexSession, writer: Writer): Promise<void> {
    // Commit points of one tick (a cancel and its response.done) share one write.
    await Promise.resolve()
    try {
      while (writer.dirty && session.state !== 'closed' && session.state !== 'closing') {
        writer.dirty = false
        // The snapshot is taken now, with every commit counted so far.
        const covered = writer.commits
        const record = this.record(session)
        if (record === null) return
        let outcome: 'written' | 'fenced' | 'closed'
        try {
          outcome = await this.settings.store.commit(record, this.settings.ttlMs)
        } catch {
          this.failedWrites++
          this.retryLater(session, writer)
          return
        }
        if (outcome !== 'written') {
          this.settings.onFenced(session)
          return
        }
        this.markHeld(writer, covered)
      }
    } finally {
      writer.writing = null
    }
  }

  private markHeld(writer: Writer, commits: number): void {
    writer.held = Math.max(writer.held, commits)
    const ready = writer.waiters.filter((waiter) => waiter.commits <= writer.held)
    writer.waiters = writer.waiters.filter((waiter) => waiter.commits > writer.held)
    for (const waiter of ready) waiter.resolve(true)
  }

  private retryLater(session: DuplexSession, writer: Writer): void {
    writer.dirty = true
    if (writer.retry !== null) return
    writer.retry = setTimeout(() => {
      writer.retry = null
      if (this.writers.get(session) === writer) this.committed(session)
    }, RETRY_AFTER_FAILURE_MS)
    writer.retry.unref()
  }

  private record(session: DuplexSession): StoredSession | null {
    const tokenDigest = this.settings.tokenDigestOf(session)
    if (tokenDigest === null) return null
    const snapshot = session._snapshot()
    return {
      sessionId: session.id,
      incarnation: session.fence.incarnation,
      leaseGeneration: session.leaseGeneration,
      owner: this.settings.owner,
      tokenDigest,
      config: snapshot.config,
      tokens: snapshot.tokens,
      pendingResponses: snapshot.pendingResponses,
      endedResponses: snapshot.endedResponses,
      continuation: snapshot.continuation,
    }
  }
}
