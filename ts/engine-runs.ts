// An engine's runs: run() calls execute one after another (one promise chain, owned here), a
// runSync() is refused while one is queued, and each run's events are delivered: those of
// collected requests dropped, the rest routed to their turns (router.ts) with the text and
// log-probabilities they point into. The driven loop's runs (driver.ts) go through the same queue
// and tell a prefill step from a stall by the core's step counter.
//
// This module reaches its engine only through RunsHost, so it imports nothing of engine.ts.

import type { Backend } from './backend'
import type { CoreEngine } from './binding'
import { OrtexError } from './errors'
import { type EventBuffer, NO_RUN_OUTPUT, type RunOutput, outputsNeeded } from './events'
import { type RouterHost, anyProgress, dropEventsOfCollected, routeEvents } from './router'

/** What the runs need of their engine. */
export interface RunsHost {
  readonly core: CoreEngine
  readonly backend: Backend
  readonly router: RouterHost
  /** Closed, or failed at an engine level: no run makes progress any more. */
  readonly ended: boolean
  /** Calls the binding and converts what it throws into an OrtexError. */
  call<T>(fn: () => T): T
  convertError(error: unknown): OrtexError
  /** ENGINE_CLOSED or ENGINE_UNHEALTHY: what a queued run needs when its turn comes. */
  checkUsable(): void
}

/** @internal The run queue of one engine. */
export class EngineRuns {
  /** The last run() in the queue; run() calls execute one after another. */
  private runTail: Promise<unknown> = Promise.resolve()
  private runsQueued = 0
  /** stats().steps as last seen by the driven loop, to tell a prefill step from a stall. */
  private lastSteps = -1

  constructor(private readonly host: RunsHost) {}

  /** runSync: the same as a run, on the calling thread; RUN_IN_PROGRESS while a run is queued. */
  runSync(buffer: EventBuffer): number {
    if (this.runsQueued > 0) {
      throw new OrtexError('RUN_IN_PROGRESS', 'a run() of this engine has not finished yet; await it first')
    }
    const written = this.host.call(() => this.host.core.runSync(buffer._words, buffer.capacity))
    return this.deliver(buffer, written)
  }

  /** Runs `buffer` after the runs already queued, or at once when there are none (the driven
   *  loop's case: while driven, run() is refused, so nothing else queues). */
  enqueueRun(buffer: EventBuffer, onThisThread = false): Promise<number> {
    // A queued run starts however the one before it ended.
    const next = () => this.runNow(buffer, onThisThread)
    const ahead = this.runsQueued++
    const run = ahead === 0 ? next() : this.runTail.then(next, next)
    this.runTail = run
    return run
  }

  /** One run of the queue; leaves it (runsQueued) before its promise settles. `onThisThread`:
   *  executed here, as runSync does. */
  private async runNow(buffer: EventBuffer, onThisThread: boolean): Promise<number> {
    try {
      this.host.checkUsable()
      let written: number
      try {
        written = onThisThread
          ? this.host.core.runSync(buffer._words, buffer.capacity)
          : await this.host.backend.run(this.host.core, buffer._words, buffer.capacity)
      } catch (error) {
        throw this.host.convertError(error)
      }
      return this.deliver(buffer, written)
    } finally {
      this.runsQueued--
    }
  }

  /** A run's events: those of collected requests dropped, the rest routed to their turns with
   *  their text (one string per run from the core, sliced per event). */
  private deliver(buffer: EventBuffer, written: number): number {
    const output = this.runOutput(buffer._words, written)
    const count = dropEventsOfCollected(buffer._words, written, this.host.router)
    buffer._count = count
    buffer._output = output
    routeEvents(buffer._words, count, this.host.router, output)
    return count
  }

  /** The text and log-probabilities the run's events point into, fetched only when one does. */
  private runOutput(words: Int32Array, written: number): RunOutput {
    const needed = outputsNeeded(words, written)
    if (!needed.text && !needed.logprobs) return NO_RUN_OUTPUT
    return this.host.call(() => ({
      text: needed.text ? this.host.core.runText() : '',
      logprobs: needed.logprobs ? this.host.core.runLogprobs() : null,
    }))
  }

  /** One run of the driven loop on its own buffer (`onThisThread`: engine.ts's driveOnce says
   *  when); whether it made progress. */
  driveOnce(buffer: EventBuffer, onThisThread: boolean): Promise<boolean> {
    return this.enqueueRun(buffer, onThisThread).then(() => this.lastRunProgressed(buffer))
  }

  /** A run with only CapacityBlocked events (or none) may still have prefilled a prompt chunk;
   *  the step counter tells. */
  private lastRunProgressed(buffer: EventBuffer): boolean {
    if (anyProgress(buffer._words, buffer._count)) return true
    if (this.host.ended) return false
    const steps = this.statsStepsQuietly()
    if (steps === -1) return false
    const moved = steps !== this.lastSteps
    this.lastSteps = steps
    return moved
  }

  private statsStepsQuietly(): number {
    try {
      return this.host.core.stats().steps
    } catch {
      return -1
    }
  }

  /** Resolves once every queued run has settled (close). */
  settled(): Promise<void> {
    return this.runTail.then(noop, noop)
  }
}

function noop(): void {}
