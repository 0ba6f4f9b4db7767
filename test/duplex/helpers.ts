// Helpers for the duplex suites: collecting a session's events and running a caller-driven
// engine until something holds. Every loop is bounded; nothing depends on wall-clock time.
import type { OrtexModule } from '../helpers/backends'
import { macrotask } from '../helpers/util'

export type Mod = OrtexModule
export type Engine = ReturnType<Mod['Engine']['simulated']>
export type Manager = InstanceType<Mod['DuplexSessionManager']>
export type Session = ReturnType<Manager['open']>

export interface Collected {
  events: any[]
  /** Resolves when the session's event stream ended (after its terminal event). */
  ended: Promise<void>
}

/** Reads every event of `session` in the background. */
export function collect(session: Session): Collected {
  const events: any[] = []
  const ended = (async () => {
    for await (const event of session.events()) events.push(event)
  })()
  return { events, ended }
}

/**
 * Runs the engine caller-driven (runSync) and yields to the event loop between runs, until
 * `done()` holds. Bounded: fails after `maxRounds` rounds.
 */
export async function runUntil(engine: Engine, done: () => boolean, maxRounds = 20_000): Promise<void> {
  const buffer = engine.createEventBuffer(256)
  for (let round = 0; round < maxRounds; round++) {
    if (done()) return
    if (engine.hasPendingWork()) {
      engine.runSync(buffer)
      engine.checkInvariants()
    }
    await macrotask()
  }
  if (!done()) throw new Error(`condition not reached after ${maxRounds} rounds`)
}

/** Yields to the event loop `n` times (lets the session's tasks run). */
export async function settle(n = 5): Promise<void> {
  for (let i = 0; i < n; i++) await macrotask()
}

export function fenceKey(fence: { epoch: number; turnId: number; responseSeq: number }): string {
  return `${fence.epoch}/${fence.turnId}/${fence.responseSeq}`
}

export function sameFence(a: any, b: any): boolean {
  return (
    a.sessionId === b.sessionId &&
    a.incarnation === b.incarnation &&
    a.epoch === b.epoch &&
    a.turnId === b.turnId &&
    a.responseSeq === b.responseSeq
  )
}

/** The events of the response started under `fence`. */
export function responseEvents(events: any[], fence: any): any[] {
  return events.filter((e) => e.type.startsWith('response.') && sameFence(e.fence, fence))
}

export function tokensOf(events: any[], fence: any): number[] {
  return responseEvents(events, fence)
    .filter((e) => e.type === 'response.delta' && e.token !== null)
    .map((e) => e.token)
}

/** Checks the per-response event grammar over a session's whole event list: created, deltas,
 *  done, nothing after done, one terminal event last. */
export function checkGrammar(events: any[]): void {
  const state = new Map<string, 'created' | 'done'>()
  let terminal = 0
  for (const [i, event] of events.entries()) {
    if (terminal > 0) throw new Error(`event ${i} (${event.type}) follows the terminal event`)
    if (event.type === 'session.closed' || event.type === 'session.expired') {
      terminal++
      continue
    }
    const key = `${event.fence.incarnation}:${fenceKey(event.fence)}`
    const seen = state.get(key)
    if (event.type === 'response.created') {
      if (seen !== undefined) throw new Error(`response ${key} created twice`)
      state.set(key, 'created')
    } else if (event.type === 'response.delta') {
      if (seen !== 'created') throw new Error(`delta of response ${key} ${seen === 'done' ? 'after its done' : 'before created'}`)
    } else if (event.type === 'response.done') {
      if (seen !== 'created') throw new Error(`done of response ${key} ${seen === 'done' ? 'twice' : 'before created'}`)
      state.set(key, 'done')
    }
  }
}
