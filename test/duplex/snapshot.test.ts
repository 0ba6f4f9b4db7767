// What a session store gets of a session at a commit point (DuplexSession._snapshot, internal):
// the committed conversation in order, without the output of a response still running (a
// failover loses that response), and the fences of the responses that have not ended. Over both
// backends, caller-driven, so every step is deterministic.
import { afterEach, describe, expect, it } from 'vitest'
import { ortex, selectedBackends } from '../helpers/backends'
import { type Engine, type Session, collect, runUntil, tokensOf } from './helpers'

interface Snapshot {
  tokens: Int32Array
  pendingResponses: unknown[]
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
})
