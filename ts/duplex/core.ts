// The typed side of the core's session rules (binding.ts `CoreSessions`): JSON in, JSON out,
// binding errors turned into OrtexError. Nothing here decides anything; ortex-core's `session`
// module does (fences, leases, appends, cancel, two-phase close, expiry).

import type { CoreSessions } from '../binding'
import { toOrtexError } from '../errors'
import type { Fence, SessionState } from './events'

/** The session as the core sees it after a call. */
export interface SessionView {
  fence: Fence
  state: SessionState
  leaseGeneration: number
  configGeneration: number
  closeReason: string | null
  seq: number
  turnSeq: number
  lastActivityMs: number
  detachedAtMs: number | null
  operationsInFlight: number
}

export interface AppendResultJson {
  seq: number
  turnSeq: number
  turnId: number
  final: boolean
  replayed: boolean
}

export type AppendPlanJson = { replay: AppendResultJson } | { reservation: number; result: AppendResultJson }

export interface CancelOutcome {
  cancelled: Fence
  fence: Fence
  advanced: boolean
  requestIds: number[]
  session: SessionView
}

export interface CoreExpiry {
  sessionId: string
  fence: Fence
  leaseGeneration: number
  reason: string
  submittedRequestIds: number[]
  reservedRequestIds: number[]
}

export type LeaseActivity = 'append' | 'respond' | 'cancel' | 'heartbeat' | 'attach' | 'detach' | 'model-output' | 'config'

export interface CoreSessionsOptions {
  maxSessions: number | null
  idleTtlMs: number | null
  disconnectGraceMs: number
  completedAppendLimit: number
}

function call<T>(fn: () => T): T {
  try {
    return fn()
  } catch (error) {
    throw toOrtexError(error)
  }
}

function fenceJson(fence: Fence | null | undefined): string {
  return fence == null ? 'null' : JSON.stringify(fence)
}

/** One engine's session rules. */
export class SessionRules {
  constructor(private readonly core: CoreSessions) {}

  open(sessionId: string, nowMs: number): SessionView {
    return JSON.parse(call(() => this.core.open(sessionId, nowMs))) as SessionView
  }

  view(sessionId: string): SessionView {
    return JSON.parse(call(() => this.core.get(sessionId))) as SessionView
  }

  bindRequest(sessionId: string, requestId: number): void {
    call(() => this.core.bindRequest(sessionId, requestId))
  }

  prepareAppend(
    sessionId: string,
    request: { fence: Fence | null; final: boolean; operationId: string | null; inputDigest: number },
  ): AppendPlanJson {
    return JSON.parse(call(() => this.core.prepareAppend(sessionId, JSON.stringify(request)))) as AppendPlanJson
  }

  commitAppend(reservation: number, nowMs: number): { result: AppendResultJson; session: SessionView } {
    return JSON.parse(call(() => this.core.commitAppend(reservation, nowMs))) as {
      result: AppendResultJson
      session: SessionView
    }
  }

  discardReservation(reservation: number): void {
    try {
      this.core.discardReservation(reservation)
    } catch {
      // Forgetting a reservation cannot fail in a way the caller could act on.
    }
  }

  startResponse(sessionId: string, nowMs: number): SessionView {
    return JSON.parse(call(() => this.core.startResponse(sessionId, nowMs))) as SessionView
  }

  cancel(sessionId: string, cancelled: Fence | null, nowMs: number): CancelOutcome {
    return JSON.parse(call(() => this.core.cancel(sessionId, fenceJson(cancelled), nowMs))) as CancelOutcome
  }

  validateFence(sessionId: string, fence: Fence | null | undefined): void {
    if (fence == null) return
    call(() => this.core.validateFence(sessionId, fenceJson(fence)))
  }

  touch(sessionId: string, nowMs: number, activity: LeaseActivity): void {
    call(() => this.core.touch(sessionId, nowMs, activity))
  }

  detach(sessionId: string, nowMs: number): SessionView {
    return JSON.parse(call(() => this.core.detach(sessionId, nowMs))) as SessionView
  }

  resume(sessionId: string, nowMs: number, expectedGeneration: number): SessionView {
    return JSON.parse(call(() => this.core.resume(sessionId, nowMs, expectedGeneration))) as SessionView
  }

  beginOperation(sessionId: string, nowMs: number, operationId: string): void {
    call(() => this.core.beginOperation(sessionId, nowMs, operationId))
  }

  endOperation(sessionId: string, nowMs: number, operationId: string): void {
    call(() => this.core.endOperation(sessionId, nowMs, operationId))
  }

  replaceConfigs(sessionId: string, configs: { session?: Record<string, string>; runtime?: Record<string, string> }): number {
    return call(() => this.core.replaceConfigs(sessionId, JSON.stringify(configs)))
  }

  beginClose(sessionId: string, fence: Fence | null, reason: string): boolean {
    return call(() => this.core.beginClose(sessionId, fenceJson(fence), reason))
  }

  finalizeClose(sessionId: string): number[] {
    return JSON.parse(call(() => this.core.finalizeClose(sessionId))) as number[]
  }

  collectExpired(nowMs: number): CoreExpiry[] {
    return JSON.parse(call(() => this.core.collectExpired(nowMs))) as CoreExpiry[]
  }

  numSessions(): number {
    return call(() => this.core.numSessions())
  }

  checkInvariants(): void {
    call(() => this.core.checkInvariants())
  }
}
