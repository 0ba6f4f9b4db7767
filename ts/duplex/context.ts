// What one duplex session's components share (in the shape of vllm-omni's
// vllm_omni/engine/duplex/session/context.py): DuplexRunState, the few flags more than one
// component reads or writes (`grep '\.run\.'` finds every mutation); DuplexSessionContext, the
// read-mostly collaborators every component is built with; RunnerServices, the one thing a
// component may ask the runner for; and the items the runner's mailbox takes (runner.ts).

import type { Engine } from '../engine'
import type { Request } from '../request'
import type { TurnResult } from '../types'
import type { SessionRules } from './core'
import type { Fence, SessionEventQueue } from './events'
import type { ResponseRecord } from './response'

/** The flags several components touch. Every field is written by one component and read by
 *  another; that is the criterion for living here. */
export class DuplexRunState {
  /** An irreversible close has begun: commands are refused with SESSION_CLOSED. */
  closing = false
  /** session.closed / session.expired has left the runner. */
  closedEmitted = false
  /** The terminal event waits until the manager has finalized the close (the slot is free). */
  closeDeferred = false
  closeReason: string | null = null
  terminalKind: 'session.closed' | 'session.expired' | null = null
  /** The session's fence as of the latest core call, for the terminal event. */
  fence: Fence
  constructor(fence: Fence) {
    this.fence = fence
  }
}

/** The only thing a component may ask the runner for. */
export interface RunnerServices {
  /** Runs `task` as a tracked background task of the session. */
  spawn(task: () => Promise<void>, name: string): void
  /** Posts an engine output to the mailbox. */
  post(item: MailboxItem): void
}

/** Tracked task handles of one session. */
export class SessionTasks {
  private readonly running = new Map<Promise<void>, string>()

  track(task: Promise<void>, name: string): void {
    this.running.set(task, name)
    void task.finally(() => this.running.delete(task))
  }

  /** Names of the tasks still running (diagnostics). */
  names(): string[] {
    return [...this.running.values()]
  }
}

/** The collaborators one session's components are built with. Read-mostly: mutable flags live in
 *  `run`; the request and rules are changed through their own APIs. */
export interface DuplexSessionContext {
  readonly sessionId: string
  readonly engine: Engine
  readonly request: Request
  readonly rules: SessionRules
  readonly now: () => number
  readonly events: SessionEventQueue
  readonly run: DuplexRunState
  readonly tasks: SessionTasks
  readonly services: RunnerServices
  /** The request's token limit: appended input beyond it is refused at append time. */
  readonly maxSessionTokens: number
}

export type MailboxItem =
  | { kind: 'turn-finished'; response: ResponseRecord; result: TurnResult }
  | { kind: 'announce'; response: ResponseRecord }
  | { kind: 'delta'; response: ResponseRecord; index: number; token: number; text: string }
  | { kind: 'response-done'; response: ResponseRecord; result: TurnResult }
  | { kind: 'terminal' }

