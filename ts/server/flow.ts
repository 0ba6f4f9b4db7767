// Bounds on what waits to be sent to one client, shared by the WebSocket connections (duplex/connection.ts)
// and the streamed HTTP responses (openai/complete.ts). The rule is the same for both:
//
//   buffered < maxBufferedBytes ──▶ keep sending
//   buffered ≥ maxBufferedBytes ──▶ stop feeding this client (stop reading it / stop writing
//                                   its stream) until it drained; a StallTimer starts
//   still there after sendStallMs ──▶ the client does not read: it is dropped (its turn or
//                                   session learns it from the socket's close)
//
// A streamed HTTP response stops pulling its turn's chunks while its client is above the bound,
// and a turn whose iterator falls behind is held in the engine (turn-state.ts: generation is paced by
// the reader), so a stalled client costs a few hundred chunks of generation, not sendStallMs of
// it; a client that never reads is still dropped after sendStallMs, which cancels its turn.

import * as v from '../validate'

export interface FlowLimits {
  /** Most bytes one client may have waiting to be sent before the server stops feeding it. */
  maxBufferedBytes: number
  /** How long a client may stay above maxBufferedBytes before it is dropped. */
  sendStallMs: number
}

export const DEFAULT_MAX_BUFFERED_BYTES = 1 << 20
export const DEFAULT_SEND_STALL_MS = 30_000

/** `options.maxBufferedBytes` / `options.sendStallMs` of an options map (v.options), checked. */
export function flowLimits(present: Map<string, unknown>): FlowLimits {
  return {
    maxBufferedBytes: present.has('maxBufferedBytes')
      ? v.integer('options.maxBufferedBytes', present.get('maxBufferedBytes'), 1024, 1 << 30)
      : DEFAULT_MAX_BUFFERED_BYTES,
    sendStallMs: present.has('sendStallMs')
      ? v.integer('options.sendStallMs', present.get('sendStallMs'), 1, Number.MAX_SAFE_INTEGER)
      : DEFAULT_SEND_STALL_MS,
  }
}

/** Calls `onStall` once a client stayed above its bound for `stallMs`; `clear` when it drained.
 *  Unref'd: a stalled client never keeps the process alive. */
export class StallTimer {
  private timer: NodeJS.Timeout | null = null

  constructor(
    private readonly stallMs: number,
    private readonly onStall: () => void,
  ) {}

  get running(): boolean {
    return this.timer !== null
  }

  /** Starts counting (no-op while already counting). */
  start(): void {
    if (this.timer !== null) return
    this.timer = setTimeout(() => {
      this.timer = null
      this.onStall()
    }, this.stallMs)
    this.timer.unref()
  }

  clear(): void {
    if (this.timer !== null) clearTimeout(this.timer)
    this.timer = null
  }
}
