// A duplex session's client side (Delivery): one tracked task that turns responses into events,
// in order: response.created, the deltas (paced by the consumer), response.done, and after a
// close the one terminal event. It posts them to the runner's mailbox (runner.ts), which checks
// each against its response before it is emitted.

import type { DuplexSessionContext } from './context'
import type { ResponseRecord } from './response'

/**
 * The client side: one tracked task turns responses into events, in the order they were
 * created, paced by the consumer (a delta waits for room in the event queue).
 */
export class Delivery {
  private readonly queue: ResponseRecord[] = []
  private wake: (() => void) | null = null

  constructor(private readonly ctx: DuplexSessionContext) {}

  start(): void {
    this.ctx.services.spawn(() => this.loop(), 'delivery')
  }

  enqueue(response: ResponseRecord): void {
    this.queue.push(response)
    this.poke()
  }

  /** Something changed (a response queued, the session closing). */
  poke(): void {
    const wake = this.wake
    this.wake = null
    wake?.()
  }

  private async loop(): Promise<void> {
    for (;;) {
      const response = this.queue.shift()
      if (response === undefined) {
        if (this.ctx.run.closing && !this.ctx.run.closeDeferred) {
          this.ctx.services.post({ kind: 'terminal' })
          return
        }
        await new Promise<void>((resolve) => {
          this.wake = resolve
        })
        continue
      }
      await this.deliver(response)
    }
  }

  private async deliver(response: ResponseRecord): Promise<void> {
    this.ctx.services.post({ kind: 'announce', response })
    while (response.status === 'queued') await response.changed()
    if (response.status !== 'running' || response.turn === null) return
    const turn = response.turn
    const cursor = turn._cursor()
    response.cursor = cursor
    let index = 0
    for (;;) {
      if (response.status !== 'running') return
      if (!this.ctx.events.hasRoom()) {
        await Promise.race([this.ctx.events.waitForRoom(), response.stopped])
        continue
      }
      const chunk = cursor.read()
      if (chunk !== null) {
        this.ctx.services.post({ kind: 'delta', response, index: index++, token: chunk.token, text: chunk.text })
        continue
      }
      if (cursor.ended) break
      await Promise.race([cursor.wait(), response.stopped])
    }
    const result = await Promise.race([turn.done, response.stopped.then(() => null)])
    if (result !== null) this.ctx.services.post({ kind: 'response-done', response, result })
  }
}

