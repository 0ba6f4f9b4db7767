// What a session store keeps of a duplex session, so that another process can take the session
// over when its own process is gone (docs/scaling.md): the session's identity and lease (id,
// incarnation, lease generation, owner), the SHA-256 of its resume token, its configuration, the
// committed conversation, as token ids, that a new owner prefills to rebuild the KV, and where the
// session's rules stood (its fence, append counters and completed appends: a retry answered by
// the new owner is a replay), with the responses that had not ended and the latest that did.
//
// The record is written at commit points only (an append committed, a response done or
// cancelled, a truncate applied, a configuration replaced, a detach), never per token. Every write
// is conditional on the writer still owning the session: a process that lost the session to a
// claim elsewhere (the incarnation moved on) is refused ('fenced') and drops its copy.

import type { Fence } from '../duplex/events'

/** One session as the store holds it. */
export interface StoredSession {
  sessionId: string
  /** The life of the session id: each claim by another process increments it. */
  incarnation: number
  /** The lease generation: each resume (anywhere) increments it, as on one process. */
  leaseGeneration: number
  /** The process that holds the session (a random id per server). */
  owner: string
  /** SHA-256 of the resume token, hex. */
  tokenDigest: string
  /** The session's configuration, {turn, respond}, as JSON. */
  config: string
  /** The committed conversation: every token of the context a new owner prefills. */
  tokens: Int32Array
  /** Responses that had not ended at the commit: a new owner ends them `failed`. */
  pendingResponses: Fence[]
  /** The latest responses that ended, oldest first, and where their output lies in `tokens`. */
  endedResponses: StoredResponse[]
  /** The core's continuation (ContinuationView) as JSON; null in a record without one. */
  continuation: string | null
}

/** A response that ended: its output is `length` tokens of the conversation from `start`. */
export interface StoredResponse {
  fence: Fence
  start: number
  length: number
}

/** What a claim found. */
export type ClaimOutcome =
  /** The claimer already held the session (same owner and incarnation): the generation moved. */
  | { kind: 'kept'; leaseGeneration: number; incarnation: number }
  /** The session moves to the claimer, with the next incarnation; rebuild it from `record`. */
  | { kind: 'moved'; record: StoredSession }
  | { kind: 'missing' }
  | { kind: 'closed' }
  | { kind: 'bad-token' }
  | { kind: 'generation-mismatch'; current: number }

/** The store could not be reached or did not answer in time: the same call may succeed later. */
export class SessionStoreUnavailable extends Error {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options)
    this.name = 'SessionStoreUnavailable'
  }
}

/** Where sessions outlive their process. Every method rejects with SessionStoreUnavailable
 *  when the store cannot answer; none waits longer than the store's command timeout. */
export interface SessionStore {
  /**
   * Writes `record` if `record.owner` still holds the session at `record.incarnation` (or the
   * record is missing, as after the store lost its data: it is written anew). 'fenced': another
   * owner or incarnation holds it; 'closed': it was closed.
   */
  commit(record: StoredSession, ttlMs: number): Promise<'written' | 'fenced' | 'closed'>
  /**
   * The compare-and-set of a resume: succeeds only when `tokenDigest` matches and
   * `expectedGeneration` is the stored generation, which it then increments. A claimer that is
   * not the owner at `heldIncarnation` takes the session over with the next incarnation. Of any
   * number of racing claims, on any processes, exactly one succeeds.
   */
  claim(
    sessionId: string,
    tokenDigest: string,
    expectedGeneration: number,
    claimer: { owner: string; heldIncarnation: number | null },
    ttlMs: number,
  ): Promise<ClaimOutcome>
  /** The session ended for good (closed, expired): its record becomes a tombstone that refuses
   *  later claims and commits. Only the owner at `incarnation` may end it. */
  end(sessionId: string, owner: string, incarnation: number, ttlMs: number): Promise<void>
  /** Keeps the record from expiring (client activity without a commit: a heartbeat). */
  touch(sessionId: string, ttlMs: number): Promise<void>
  /** Closes the connection to the store. */
  quit(): Promise<void>
  /** Optional: `listener` runs each time the store is reachable again after it was not. The
   *  store may have lost its data (a restart without persistence): the server writes every
   *  session's record again. */
  onReconnect?(listener: () => void): void
}
