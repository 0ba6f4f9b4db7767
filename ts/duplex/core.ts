// The typed side of the core's session rules (binding.ts `CoreSessions`): typed inputs, views
// out (both generated from the Rust side), binding errors turned into OrtexError. Nothing here
// decides anything; ortex-core's `session` module does (fences, leases, appends, cancel,
// two-phase close, expiry).

import type { CoreSessions } from '../binding'
import { toOrtexError } from '../errors'
import type {
  AppendPlanView,
  CancelView,
  CommitView,
  ContinuationInput,
  ContinuationView,
  ExpiryView,
  FenceInput,
  SessionView,
  SessionsOptionsInput,
} from '../generated/boundary'
import type { Fence } from './events'

export type { AppendPlanView, CancelView, CommitView, ContinuationInput, ContinuationView, ExpiryView, SessionView, SessionsOptionsInput }

export type LeaseActivity = 'append' | 'respond' | 'cancel' | 'heartbeat' | 'attach' | 'detach' | 'model-output' | 'config'

/** What an append asks the rules for. */
export interface AppendInput {
  fence: Fence | null
  final: boolean
  operationId: string | null
  inputDigest: number
}

function call<T>(fn: () => T): T {
  try {
    return fn()
  } catch (error) {
    throw toOrtexError(error)
  }
}

function fenceInput(fence: Fence | null | undefined): FenceInput | null {
  return fence == null ? null : { ...fence }
}

/** One engine's session rules. */
export class SessionRules {
  constructor(private readonly core: CoreSessions) {}

  open(sessionId: string, nowMs: number): SessionView {
    return call(() => this.core.open(sessionId, nowMs))
  }

  restore(sessionId: string, nowMs: number, incarnation: number, leaseGeneration: number, continuation: ContinuationInput | null): SessionView {
    return call(() => this.core.restore(sessionId, nowMs, incarnation, leaseGeneration, continuation))
  }

  continuation(sessionId: string): ContinuationView {
    return call(() => this.core.continuation(sessionId))
  }

  view(sessionId: string): SessionView {
    return call(() => this.core.get(sessionId))
  }

  bindRequest(sessionId: string, requestId: number): void {
    call(() => this.core.bindRequest(sessionId, requestId))
  }

  prepareAppend(sessionId: string, request: AppendInput): AppendPlanView {
    const { fence, final, operationId, inputDigest } = request
    return call(() => this.core.prepareAppend(sessionId, final, operationId, inputDigest, fenceInput(fence)))
  }

  commitAppend(reservation: number, nowMs: number): CommitView {
    return call(() => this.core.commitAppend(reservation, nowMs))
  }

  discardReservation(reservation: number): void {
    try {
      this.core.discardReservation(reservation)
    } catch {
      // Forgetting a reservation cannot fail in a way the caller could act on.
    }
  }

  startResponse(sessionId: string, nowMs: number): SessionView {
    return call(() => this.core.startResponse(sessionId, nowMs))
  }

  cancel(sessionId: string, cancelled: Fence | null, nowMs: number): CancelView {
    return call(() => this.core.cancel(sessionId, fenceInput(cancelled), nowMs))
  }

  validateFence(sessionId: string, fence: Fence | null | undefined): void {
    if (fence == null) return
    call(() => this.core.validateFence(sessionId, { ...fence }))
  }

  touch(sessionId: string, nowMs: number, activity: LeaseActivity): void {
    call(() => this.core.touch(sessionId, nowMs, activity))
  }

  detach(sessionId: string, nowMs: number): SessionView {
    return call(() => this.core.detach(sessionId, nowMs))
  }

  resume(sessionId: string, nowMs: number, expectedGeneration: number): SessionView {
    return call(() => this.core.resume(sessionId, nowMs, expectedGeneration))
  }

  beginOperation(sessionId: string, nowMs: number, operationId: string): void {
    call(() => this.core.beginOperation(sessionId, nowMs, operationId))
  }

  endOperation(sessionId: string, nowMs: number, operationId: string): void {
    call(() => this.core.endOperation(sessionId, nowMs, operationId))
  }

  replaceConfigs(sessionId: string, configs: { session?: Record<string, string>; runtime?: Record<string, string> }): number {
    return call(() => this.core.replaceConfigs(sessionId, configs))
  }

  beginClose(sessionId: string, fence: Fence | null, reason: string): boolean {
    return call(() => this.core.beginClose(sessionId, fenceInput(fence), reason))
  }

  finalizeClose(sessionId: string): number[] {
    return Array.from(call(() => this.core.finalizeClose(sessionId)))
  }

  collectExpired(nowMs: number): ExpiryView[] {
    return call(() => this.core.collectExpired(nowMs))
  }

  numSessions(): number {
    return call(() => this.core.numSessions())
  }

  checkInvariants(): void {
    call(() => this.core.checkInvariants())
  }
}
