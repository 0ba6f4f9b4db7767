// Shared assertions and drivers for the facade suites. Everything here goes through the public
// contract in docs/api.md, plus the `checkInvariants()` test hook.
import { expect } from 'vitest'
import WebSocket from 'ws'
import type { OrtexModule } from './backends'

type Engine = ReturnType<OrtexModule['Engine']['simulated']>
type EventBuffer = ReturnType<Engine['createEventBuffer']>
type Request = ReturnType<Engine['createRequest']>

/** A plain copy of one event, safe to keep after the buffer's next run. */
export interface EventCopy {
  flags: number
  request: Request | null
  turnId: number
  token: number
  finishReason: string
  errorCode: string
  usage: { promptTokens: number; generatedTokens: number; cachedPromptTokens: number } | null
  /** The text the event adds to its turn's ('' when none). */
  text: string
}

export const FLAGS = { Token: 1, TurnFinished: 2, CapacityBlocked: 4, Failed: 8, Retryable: 16 } as const

export function copyEvent(ev: any): EventCopy {
  return {
    flags: ev.flags,
    request: ev.request,
    turnId: ev.turnId,
    token: ev.token,
    finishReason: ev.finishReason,
    errorCode: ev.errorCode,
    usage: ev.usage
      ? {
          promptTokens: ev.usage.promptTokens,
          generatedTokens: ev.usage.generatedTokens,
          cachedPromptTokens: ev.usage.cachedPromptTokens,
        }
      : null,
    text: ev.text,
  }
}

/** Copies the `count` events the last run wrote. */
export function readEvents(buffer: EventBuffer, count: number): EventCopy[] {
  expect(buffer.count).toBe(count)
  const out: EventCopy[] = []
  for (let i = 0; i < count; i++) out.push(copyEvent(buffer.at(i)))
  return out
}

/** One runSync, returning copies of its events. */
export function step(engine: Engine, buffer: EventBuffer): EventCopy[] {
  const n = engine.runSync(buffer)
  expect(n).toBeLessThanOrEqual(buffer.capacity)
  return readEvents(buffer, n)
}

/** Runs the engine (caller-driven) until it has no pending work; checks invariants each run. */
export function drain(engine: Engine, buffer: EventBuffer, maxRuns = 100_000): EventCopy[] {
  const events: EventCopy[] = []
  let runs = 0
  while (engine.hasPendingWork()) {
    if (++runs > maxRuns) throw new Error(`engine still has pending work after ${maxRuns} runs`)
    events.push(...step(engine, buffer))
    ;(engine as any).checkInvariants()
  }
  return events
}

export function eventsOf(events: EventCopy[], request: Request): EventCopy[] {
  return events.filter((e) => e.request === request)
}

export function tokensOf(events: EventCopy[], request: Request, turnId?: number): number[] {
  return eventsOf(events, request)
    .filter((e) => e.flags & FLAGS.Token && (turnId === undefined || e.turnId === turnId))
    .map((e) => e.token)
}

export function finishesOf(events: EventCopy[], request: Request): EventCopy[] {
  return eventsOf(events, request).filter((e) => e.flags & FLAGS.TurnFinished)
}

function checkOrtexError(mod: OrtexModule, error: unknown, code: string): void {
  if (!(error instanceof mod.OrtexError)) {
    throw new Error(`expected an OrtexError with code ${code}, got ${String(error)} (${(error as any)?.constructor?.name})`)
  }
  expect(error).toBeInstanceOf(Error)
  expect((error as any).code).toBe(code)
  expect(typeof (error as any).retryable).toBe('boolean')
  // docs/api.md's error table: these two are retryable, every other code is not.
  expect((error as any).retryable).toBe(code === 'CAPACITY_EXHAUSTED' || code === 'RUN_IN_PROGRESS')
}

/** `fn` must throw an OrtexError with `code` synchronously. */
export function expectCode(mod: OrtexModule, fn: () => unknown, code: string): void {
  let result: unknown
  try {
    result = fn()
  } catch (error) {
    checkOrtexError(mod, error, code)
    return
  }
  if (result && typeof (result as any).then === 'function') (result as Promise<unknown>).catch(() => {})
  throw new Error(`expected ${code} to be thrown, but the call returned ${describe(result)}`)
}

/** `fn` must throw or reject with an OrtexError with `code` (async API: either form is accepted). */
export async function expectCodeAsync(mod: OrtexModule, fn: () => unknown, code: string): Promise<void> {
  let result: unknown
  try {
    result = fn()
  } catch (error) {
    checkOrtexError(mod, error, code)
    return
  }
  if (!result || typeof (result as any).then !== 'function') {
    throw new Error(`expected ${code}, but the call returned ${describe(result)}`)
  }
  try {
    const value = await result
    throw Object.assign(new Error(`expected ${code} to be rejected, but it resolved to ${describe(value)}`), { notRejected: true })
  } catch (error) {
    if ((error as any)?.notRejected) throw error
    checkOrtexError(mod, error, code)
  }
}

function describe(value: unknown): string {
  try {
    return typeof value === 'object' ? String(JSON.stringify(value)) : String(value)
  } catch {
    return String(value)
  }
}

/** Yields to the event loop once (a macrotask turn). */
export function macrotask(): Promise<void> {
  return new Promise((resolve) => setImmediate(resolve))
}

/** Requires `global.gc` (vitest.config.ts passes --expose-gc to the workers). */
export function requireGc(): () => void {
  const gc = (globalThis as any).gc
  if (typeof gc !== 'function') {
    throw new Error('global.gc is missing: run through vitest.config.ts, which passes --expose-gc to its workers')
  }
  return gc
}

/**
 * Collects garbage until `done()` holds, giving FinalizationRegistry callbacks turns to run. The
 * collection happens in a later job than `poke()`: a run derefs the WeakRefs of the requests it
 * routes events to, which keeps them alive until the end of that job (ECMAScript KeepDuringJob).
 */
export async function gcUntil(done: () => boolean, poke: () => void, rounds = 40): Promise<boolean> {
  const gc = requireGc()
  for (let i = 0; i < rounds; i++) {
    poke()
    if (done()) return true
    if (process.env.DEBUG_GC) console.log('gcUntil round', i)
    await macrotask()
    gc()
    await macrotask()
    await new Promise((resolve) => setTimeout(resolve, 1))
  }
  poke()
  return done()
}

/** A short generation on a fresh request: proves the engine still works (caller-driven). */
export function smokeGeneration(engine: Engine, tokens = 3): void {
  const request = engine.createRequest()
  const turn = request.beginTurn('ok', { maxGeneratedTokens: tokens })
  expect(turn.id).toBe(1)
  const buffer = engine.createEventBuffer(64)
  const events = drain(engine, buffer)
  expect(tokensOf(events, request)).toHaveLength(tokens)
  const finish = finishesOf(events, request)
  expect(finish).toHaveLength(1)
  expect(finish[0].finishReason).toBe('max-generated-tokens')
  request.close()
}

export type { Engine, EventBuffer, Request }

/** `fn` must return a promise that rejects with an OrtexError with `code` (it must not throw). */
export async function expectRejects(mod: OrtexModule, fn: () => unknown, code: string): Promise<void> {
  let result: unknown
  try {
    result = fn()
  } catch (error) {
    throw new Error(`expected a promise rejecting with ${code}, but the call threw synchronously: ${String(error)}`)
  }
  if (!result || typeof (result as any).then !== 'function') {
    throw new Error(`expected a promise rejecting with ${code}, got ${describe(result)}`)
  }
  let settled: { ok: true; value: unknown } | { ok: false; error: unknown }
  try {
    settled = { ok: true, value: await result }
  } catch (error) {
    settled = { ok: false, error }
  }
  if (settled.ok) throw new Error(`expected a rejection with ${code}, but it resolved to ${describe(settled.value)}`)
  checkOrtexError(mod, settled.error, code)
}

/** The HTTP status (and WWW-Authenticate) of a WebSocket upgrade the server refuses; rejects if
 *  the WebSocket opens. */
export function refusedUpgrade(
  url: string,
  protocols: string[] = [],
  options: WebSocket.ClientOptions = {},
): Promise<{ status: number; authenticate: unknown }> {
  const ws = new WebSocket(url, protocols, options)
  return new Promise((resolve, reject) => {
    ws.once('open', () => {
      ws.terminate()
      reject(new Error('the upgrade was accepted'))
    })
    ws.once('unexpected-response', (_req, res) => {
      resolve({ status: res.statusCode ?? -1, authenticate: res.headers['www-authenticate'] })
      ws.terminate()
    })
    ws.once('error', () => {})
  })
}

