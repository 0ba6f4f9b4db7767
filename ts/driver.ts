// Driven mode: the engine runs itself and routes events to its turns.
//
//   caller ──start()──▶ driven ──stop()──▶ stopping ──(transaction commits)──▶ caller
//                         ▲  │                 │
//                         └──┴── start() ◀─────┘
//
// While driven, the loop executes at most one transaction per macrotask (setImmediate, never a
// chain of microtasks, which would starve timers and I/O) and delivers that transaction's events
// to their turns before it schedules the next, so a consumer that reacts to a chunk (cancels,
// aborts) is seen before the following step. With no work left it schedules nothing, so the
// process can exit; a command (beginTurn, prefill, cancel, close, a reclaimed request) wakes it.
// A step that moved nothing (every waiting request blocked on KV capacity) does not spin: the loop
// waits for the next command, or retries after a short unref'd timer.

export interface DriverHost {
  /** One run (a drain or a transaction) on the engine's serialized run path, its events routed
   *  to their turns. Resolves whether it made progress. */
  _driveOnce(): Promise<boolean>
  /** Whether any work remains (false once the engine is closed or unhealthy). */
  _hasWorkQuietly(): boolean
  /**
   * Driven, the engine keeps every unfinished turn's request alive (the loop is working on it,
   * and a program may hold only its `done` promise); caller-driven, only generate() requests, so
   * a Request the program drops can be collected and reclaimed.
   */
  _pinRequests(driven: boolean): void
}

type Mode = 'caller' | 'driven' | 'stopping'

/** Longest wait between retries of a step that moved nothing. */
const MAX_STALL_BACKOFF_MS = 50

export class Driver {
  private mode: Mode = 'caller'
  private immediate: NodeJS.Immediate | null = null
  private timer: NodeJS.Timeout | null = null
  private inFlight: Promise<void> | null = null
  /** A command arrived while a step was in flight: run again even if that step moved nothing. */
  private kicked = false
  private backoffMs = 0
  private stopWaiters: (() => void)[] = []

  constructor(private readonly host: DriverHost) {}

  /** run / runSync are refused while this is true. */
  get driven(): boolean {
    return this.mode !== 'caller'
  }

  start(): void {
    if (this.mode === 'driven') return
    this.mode = 'driven'
    this.host._pinRequests(true)
    this.kick()
  }

  /** Back to caller-driven mode once the transaction in flight (if any) commits. */
  stop(): Promise<void> {
    if (this.mode === 'caller') return Promise.resolve()
    this.cancelSchedule()
    this.host._pinRequests(false)
    if (this.inFlight === null) {
      this.mode = 'caller'
      return Promise.resolve()
    }
    this.mode = 'stopping'
    return new Promise((resolve) => this.stopWaiters.push(resolve))
  }

  /** New work may be ready: schedule a step unless one is already due. */
  kick(): void {
    if (this.mode !== 'driven') return
    if (this.inFlight !== null) {
      this.kicked = true
      return
    }
    if (this.immediate !== null) return
    if (this.timer !== null) {
      clearTimeout(this.timer)
      this.timer = null
    }
    this.backoffMs = 0
    this.immediate = setImmediate(this.step)
  }

  private readonly step = (): void => {
    this.immediate = null
    if (this.mode !== 'driven') return
    this.kicked = false
    this.inFlight = this.host._driveOnce().then(
      (progressed) => this.afterStep(progressed),
      // The engine has already recorded what went wrong (unhealthy, closed).
      () => this.afterStep(false),
    )
  }

  private afterStep(progressed: boolean): void {
    this.inFlight = null
    if (this.stopWaiters.length > 0) {
      const waiters = this.stopWaiters
      this.stopWaiters = []
      if (this.mode === 'stopping') this.mode = 'caller'
      for (const resolve of waiters) resolve()
    }
    if (this.mode !== 'driven') return
    if (!this.host._hasWorkQuietly()) return
    if (progressed || this.kicked) {
      this.backoffMs = 0
      this.immediate = setImmediate(this.step)
      return
    }
    this.backoffMs = Math.min(Math.max(1, this.backoffMs * 2), MAX_STALL_BACKOFF_MS)
    this.timer = setTimeout(() => {
      this.timer = null
      this.step()
    }, this.backoffMs)
    this.timer.unref()
  }

  private cancelSchedule(): void {
    if (this.immediate !== null) {
      clearImmediate(this.immediate)
      this.immediate = null
    }
    if (this.timer !== null) {
      clearTimeout(this.timer)
      this.timer = null
    }
  }
}
