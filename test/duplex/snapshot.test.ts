// What a session store gets of a session at a commit point (DuplexSession._snapshot, internal):
// the committed conversation in order, without the output of a response that has not ended (a
// failover loses that response), the fences of those responses, where the output of the latest
// responses that ended lies, and the core's continuation (fence, counters, completed appends).
// Over both backends, caller-driven, so every step is deterministic.
import { afterEach, describe, expect, it } from 'vitest'
import { ortex, selectedBackends } from '../helpers/backends'
import { type Engine, type Session, collect, runUntil, tokensOf } from './helpers'

interface Snapshot {
  tokens: Int32Array
  pendingResponses: unknown[]
  endedResponses: { fence: unknown; start: number; length: number }[]
  continuation: string
  config: string
}

const snapshot = (session: Session): Snapshot => (session as unknown as { _snapshot(): Snapshot })._snapshot()

describe.each(selectedBackends())('session snapshots (%s)', (backend) => {
  const mod = ortex(backend)
  let engines: Engine[] = []

  afterEach(async () => {
    for (const engine of engines) await engine.close()
    engines = []
  })

  it('hold the input in order, the output of ended responses only, and the fences of the others', async () => {
    const engine = mod.Engine.simulated({ seed: 3 })
    engines.push(engine)
    const manager = new mod.DuplexSessionManager(engine)
    const session = manager.open({ turn: { maxGeneratedTokens: 6 } })
    const events = collect(session).events
    const said = [...engine.tokenize('hello there, '), ...engine.tokenize('how are you?')]
    session.append('hello there, ')
    session.append('how are you?', { final: true })
    const fence = session.fence
    // The response began but has not run: its input is in, nothing of its output.
    const running = snapshot(session)
    expect([...running.tokens]).toEqual(said)
    expect(running.pendingResponses).toEqual([fence])
    expect(JSON.parse(running.config)).toEqual({ turn: { maxGeneratedTokens: 6 }, respond: 'on-final' })

    await runUntil(engine, () => events.some((e) => e.type === 'response.done'))
    const generated = tokensOf(events, fence)
    expect(generated).toHaveLength(6)
    const done = snapshot(session)
    expect([...done.tokens]).toEqual([...said, ...generated])
    expect(done.pendingResponses).toEqual([])

    // Input while a response runs waits in the session; it is part of the conversation, after
    // the context, and the running response's output is not.
    session.append('next', { final: true })
    const second = session.fence
    session.append(' and more')
    const queued = snapshot(session)
    expect([...queued.tokens]).toEqual([...said, ...generated, ...engine.tokenize('next'), ...engine.tokenize(' and more')])
    expect(queued.pendingResponses).toEqual([second])
    await runUntil(engine, () => events.filter((e) => e.type === 'response.done').length === 2)
    await session.close()
  })
  it('say where the output of the responses that ended lies, and carry the core\'s continuation', async () => {
    const engine = mod.Engine.simulated({ seed: 3 })
    engines.push(engine)
    const manager = new mod.DuplexSessionManager(engine)
    const session = manager.open({ turn: { maxGeneratedTokens: 6 } })
    const events = collect(session).events
    session.append('hello there, ', { final: true, operationId: 'one' })
    const first = session.fence
    await runUntil(engine, () => events.some((e) => e.type === 'response.done'))
    session.append('and again', { final: true, operationId: 'two' })
    const second = session.fence
    await runUntil(engine, () => events.filter((e) => e.type === 'response.done').length === 2)
    const [said1, said2] = [engine.tokenize('hello there, '), engine.tokenize('and again')]
    const [generated1, generated2] = [tokensOf(events, first), tokensOf(events, second)]
    const start2 = said1.length + generated1.length + said2.length
    const done = snapshot(session)
    expect(done.endedResponses).toEqual([
      { fence: first, start: said1.length, length: generated1.length },
      { fence: second, start: start2, length: generated2.length },
    ])
    expect([...done.tokens.subarray(start2, start2 + generated2.length)]).toEqual(generated2)
    const continuation = JSON.parse(done.continuation)
    expect(continuation).toMatchObject({ epoch: 0, turnId: 2, responseSeq: 2, seq: 2, turnSeq: 1 })
    expect(continuation.completedAppends.map((a: any) => [a.operationId, a.seq, a.final])).toEqual([['one', 1, true], ['two', 2, true]])
    // Truncated, the latest keeps fewer tokens in the context, and says so.
    session.truncate(2)
    await runUntil(engine, () => snapshot(session).tokens.length === start2 + 2)
    expect(snapshot(session).endedResponses[1]).toEqual({ fence: second, start: start2, length: 2 })
    await session.close()
  })

  it('leave out the output of a response the engine finished but its reader has not received', async () => {
    const engine = mod.Engine.simulated({ seed: 3 })
    engines.push(engine)
    // Room for two events and nobody reading: the response's deltas wait, its response.done too.
    const manager = new mod.DuplexSessionManager(engine, { eventBufferCapacity: 2 })
    const session = manager.open({ turn: { maxGeneratedTokens: 6 } })
    session.append('hello there, ', { final: true })
    const fence = session.fence
    await runUntil(engine, () => !engine.hasPendingWork())
    const finished = snapshot(session)
    expect([...finished.tokens]).toEqual([...engine.tokenize('hello there, ')])
    expect(finished.pendingResponses).toEqual([fence])
    expect(finished.endedResponses).toEqual([])
    await session.close()
  })
})
