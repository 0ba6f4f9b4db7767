// DuplexSessionManager and DuplexSession over both backends, with a fake clock: the session rules
// of docs/api.md ("Full-duplex sessions"). The engine is caller-driven (runSync) except where a
// test says otherwise, so every run is deterministic.
import { afterEach, describe, expect, it } from 'vitest'
import { ortex, selectedBackends } from '../helpers/backends'
import { expectCode } from '../helpers/util'
import {
  type Engine,
  type Manager,
  checkGrammar,
  collect,
  responseEvents,
  runUntil,
  sameFence,
  settle,
  tokensOf,
} from './helpers'

describe.each(selectedBackends())('duplex sessions (%s)', (backend) => {
  const mod = ortex(backend)
  let engines: Engine[] = []
  let clock = 0

  function setup(options: Record<string, unknown> = {}, engineOptions: Record<string, unknown> = {}) {
    const engine = mod.Engine.simulated({ seed: 7, ...engineOptions })
    engines.push(engine)
    clock = 1_000
    const manager: Manager = new mod.DuplexSessionManager(engine, { now: () => clock, ...options })
    return { engine, manager }
  }

  afterEach(async () => {
    for (const engine of engines) await engine.close()
    engines = []
  })

  it('opens sessions with a zero fence, refuses a used id, reopens a closed id as a new incarnation', async () => {
    const { engine, manager } = setup()
    const session = manager.open({ sessionId: 'a' })
    expect(session.id).toBe('a')
    expect(session.fence).toEqual({ sessionId: 'a', incarnation: 0, epoch: 0, turnId: 0, responseSeq: 0 })
    expect(session.state).toBe('open')
    expect(session.leaseGeneration).toBe(0)
    expect(manager.get('a')).toBe(session)
    expectCode(mod, () => manager.open({ sessionId: 'a' }), 'SESSION_EXISTS')
    await session.close()
    expect(session.state).toBe('closed')
    expect(manager.get('a')).toBeUndefined()
    expectCode(mod, () => session.append('x'), 'SESSION_CLOSED')
    const again = manager.open({ sessionId: 'a' })
    expect(again.fence.incarnation).toBe(1)
    expect(typeof manager.open().id).toBe('string')
    expectCode(mod, () => manager.open({ sessionId: '' }), 'INVALID_ARGUMENT')
    expectCode(mod, () => manager.open({ respond: 'sometimes' as never }), 'INVALID_ARGUMENT')
    expectCode(mod, () => manager.open({ turn: { maxTokens: 3 } as never }), 'INVALID_ARGUMENT')
    expectCode(mod, () => new mod.DuplexSessionManager(engine, { idleTtlMs: 0 }), 'INVALID_ARGUMENT')
    expectCode(mod, () => new mod.DuplexSessionManager({} as never), 'INVALID_ARGUMENT')
    manager.checkInvariants()
  })

  it('refuses an open beyond maxSessions as retryable capacity, and the slot frees at close', async () => {
    const { engine, manager } = setup({ maxSessions: 2 })
    const a = manager.open()
    manager.open()
    let error: any
    try {
      manager.open()
    } catch (e) {
      error = e
    }
    expect(error).toBeInstanceOf(mod.OrtexError)
    expect(error.code).toBe('CAPACITY_EXHAUSTED')
    expect(error.retryable).toBe(true)
    expect(engine.stats().activeRequests).toBe(2, 'a refused open leaves no request behind')
    await a.close()
    expect(manager.size).toBe(1)
    manager.open()
    manager.checkInvariants()
  })

  it('never starts the engine: open, append, detach, resume, close and collectExpired work caller-driven', async () => {
    const { engine, manager } = setup({ disconnectGraceMs: 100 })
    const total = engine.stats().totalBlocks
    const session = manager.open()
    session.append('hello there, ')
    session.append('how are you', { final: true })
    session.detach()
    expect(session.resume(0)).toBe(1)
    const other = manager.open()
    other.append('bye')
    other.detach()
    clock += 100
    expect(manager.collectExpired().map((e) => e.sessionId)).toEqual([other.id])
    // The engine is still caller-driven: runSync is allowed (a driven engine throws ENGINE_DRIVEN).
    const buffer = engine.createEventBuffer(16)
    engine.runSync(buffer)
    await session.close()
    expect(engine.stats().activeRequests).toBe(0)
    await runUntil(engine, () => !engine.hasPendingWork())
    expect(engine.stats().freeBlocks).toBe(total)
  })

  it('only cancel changes the epoch; turnId and responseSeq never decrease within an epoch', async () => {
    const { engine, manager } = setup()
    const session = manager.open({ turn: { maxGeneratedTokens: 3 } })
    const events = collect(session)
    const fences = [session.fence]
    const record = () => fences.push(session.fence)
    session.append('one ')
    record()
    expect(session.fence.turnId).toBe(0)
    session.append('two', { final: true })
    record()
    expect(session.fence).toMatchObject({ epoch: 0, turnId: 1, responseSeq: 1 })
    await runUntil(engine, () => events.events.some((e) => e.type === 'response.done'))
    session.append('three', { final: true })
    record()
    expect(session.fence).toMatchObject({ epoch: 0, turnId: 2, responseSeq: 2 })
    const afterCancel = session.cancel()
    record()
    expect(afterCancel).toMatchObject({ epoch: 1, turnId: 2, responseSeq: 2 })
    session.append('four', { final: true })
    record()
    expect(session.fence).toMatchObject({ epoch: 1, turnId: 3, responseSeq: 3 })
    await runUntil(engine, () => responseEvents(events.events, session.fence).some((e) => e.type === 'response.done'))
    session.detach()
    session.resume(0)
    session.heartbeat()
    record()
    for (let i = 1; i < fences.length; i++) {
      const [before, after] = [fences[i - 1]!, fences[i]!]
      expect(after.epoch).toBeGreaterThanOrEqual(before.epoch)
      if (after.epoch === before.epoch) {
        expect(after.turnId).toBeGreaterThanOrEqual(before.turnId)
        expect(after.responseSeq).toBeGreaterThanOrEqual(before.responseSeq)
      }
    }
    expect(fences.filter((f, i) => i > 0 && f.epoch !== fences[i - 1]!.epoch)).toHaveLength(1)
    await session.close()
    await events.ended
    checkGrammar(events.events)
  })

  it('counts seq per session and turnSeq per user turn, restarting after a final append or a cancel', async () => {
    const { manager } = setup()
    const session = manager.open({ respond: 'manual' })
    const results = [
      session.append('a'),
      session.append('b'),
      session.append('c', { final: true }),
      session.append('d'),
    ]
    expect(results.map((r) => [r.seq, r.turnSeq, r.turnId, r.replayed])).toEqual([
      [1, 1, 0, false],
      [2, 2, 0, false],
      [3, 3, 0, false],
      [4, 1, 1, false],
    ])
    session.cancel()
    const after = session.append('e')
    expect([after.seq, after.turnSeq, after.turnId]).toEqual([5, 1, 1])
    expectCode(mod, () => session.append(''), 'INVALID_ARGUMENT')
    const commit = session.append('', { final: true })
    expect([commit.seq, commit.turnSeq, commit.final]).toEqual([6, 2, true])
  })

  it('replays an operation id with its first result and consumes nothing; other input is OPERATION_REUSED', async () => {
    const { engine, manager } = setup()
    const session = manager.open({ turn: { maxGeneratedTokens: 2 } })
    const events = collect(session)
    const first = session.append('hello', { operationId: 'op-1' })
    const tokensBefore = engine.stats().promptTokens
    const replay = session.append('hello', { operationId: 'op-1' })
    expect(replay).toEqual({ ...first, replayed: true, fence: session.fence })
    expect(session.append('more').seq).toBe(2, 'the replay consumed no seq')
    expectCode(mod, () => session.append('hellO', { operationId: 'op-1' }), 'OPERATION_REUSED')
    expectCode(mod, () => session.append('hello', { operationId: 'op-1', final: true }), 'OPERATION_REUSED')
    // A final append's retry carries the fence it was first sent with, which the append itself
    // moved on: it is still a replay, and it starts no second response.
    const fence = session.fence
    const end = session.append(' end', { final: true, operationId: 'op-2', fence })
    const endReplay = session.append(' end', { final: true, operationId: 'op-2', fence })
    expect(endReplay).toMatchObject({ seq: end.seq, turnSeq: end.turnSeq, replayed: true })
    expect(session.fence.responseSeq).toBe(1)
    await runUntil(engine, () => events.events.some((e) => e.type === 'response.done'))
    expect(events.events.filter((e) => e.type === 'response.created')).toHaveLength(1)
    expect(engine.stats().promptTokens).toBeGreaterThanOrEqual(tokensBefore)
    // A stale fence (an epoch a cancel left behind) is refused before anything is counted.
    session.cancel()
    expectCode(mod, () => session.append('late', { fence }), 'FENCE_MISMATCH')
    // seq counts appends per session (api.md): a cancel restarts turnSeq, not seq.
    expect(session.append('fresh', { fence: session.fence })).toMatchObject({ seq: end.seq + 1, turnSeq: 1 })
    await session.close()
  })

  it('bounds the completed-append cache by completedAppendLimit', () => {
    const { manager } = setup({ completedAppendLimit: 2 })
    const session = manager.open({ respond: 'manual' })
    session.append('a', { operationId: '1' })
    session.append('b', { operationId: '2' })
    session.append('c', { operationId: '3' })
    expect(session.append('c', { operationId: '3' }).replayed).toBe(true)
    // The oldest id was evicted: the same call is a new append now.
    const again = session.append('a', { operationId: '1' })
    expect(again.replayed).toBe(false)
    expect(again.seq).toBe(4)
  })

  it('detach keeps the lease generation; resume is a compare-and-swap on it', () => {
    const { manager } = setup()
    const session = manager.open()
    session.detach()
    expect(session.state).toBe('detached')
    expect(session.leaseGeneration).toBe(0)
    expectCode(mod, () => session.resume(1), 'LEASE_GENERATION_MISMATCH')
    expect(session.state).toBe('detached')
    expect(session.resume(0)).toBe(1)
    expect(session.state).toBe('open')
    expectCode(mod, () => session.resume(0), 'LEASE_GENERATION_MISMATCH')
    expect(session.resume(1)).toBe(2, 'an attached session can be taken over with the current generation')
    expectCode(mod, () => session.resume(-1), 'INVALID_ARGUMENT')
  })

  it('expires a detached session at detachedAt + disconnectGraceMs, freeing its KV and slot', async () => {
    const { engine, manager } = setup({ disconnectGraceMs: 500, idleTtlMs: 60_000, maxSessions: 1 })
    const total = engine.stats().totalBlocks
    const session = manager.open()
    const events = collect(session)
    session.append('some context that takes a few blocks of KV '.repeat(4))
    await runUntil(engine, () => !engine.hasPendingWork())
    expect(engine.stats().freeBlocks).toBeLessThan(total)
    clock = 2_000
    session.detach()
    expect(manager.collectExpired(2_499)).toEqual([])
    expectCode(mod, () => manager.open(), 'CAPACITY_EXHAUSTED')
    const fenceBefore = session.fence
    const expired = manager.collectExpired(2_500)
    expect(expired).toEqual([{ sessionId: session.id, fence: fenceBefore, leaseGeneration: 1, reason: 'disconnect_grace_expired' }])
    expect(session.state).toBe('closed')
    expect(engine.stats().activeRequests).toBe(0)
    expect(engine.stats().freeBlocks).toBe(total)
    expect(manager.collectExpired(10_000)).toEqual([], 'a session expires once')
    await events.ended
    expect(events.events.at(-1)).toEqual({ type: 'session.expired', fence: fenceBefore, reason: 'disconnect_grace_expired' })
    expectCode(mod, () => session.resume(0), 'SESSION_CLOSED')
    manager.open()
  })

  it('expires an idle session at lastActivity + idleTtlMs unless a response is in flight; null disables', async () => {
    const { engine, manager } = setup({ idleTtlMs: 1_000, disconnectGraceMs: 100 })
    const idle = manager.open({ sessionId: 'idle' })
    const busy = manager.open({ sessionId: 'busy', turn: { maxGeneratedTokens: 50 } })
    const busyEvents = collect(busy)
    clock = 1_500
    idle.heartbeat()
    busy.append('talk to me', { final: true })
    // The response is running (its turn is in the engine): an operation in flight.
    await runUntil(engine, () => busyEvents.events.some((e) => e.type === 'response.delta'))
    expect(manager.collectExpired(2_499)).toEqual([])
    const expired = manager.collectExpired(10_000)
    expect(expired.map((e) => [e.sessionId, e.reason])).toEqual([['idle', 'idle_ttl_expired']])
    expect(busy.state).toBe('open')
    busy.cancel()
    await runUntil(engine, () => !engine.hasPendingWork())
    clock = 20_000
    expect(manager.collectExpired().map((e) => e.sessionId)).toEqual(['busy'])

    const { manager: forever } = setup({ idleTtlMs: null })
    const kept = forever.open()
    expect(forever.collectExpired(Number.MAX_SAFE_INTEGER)).toEqual([])
    kept.detach()
    expect(forever.collectExpired(Number.MAX_SAFE_INTEGER)[0]!.reason).toBe('disconnect_grace_expired')
  })

  it('holds the slot until the request is closed: a closing session still counts', async () => {
    const { engine, manager } = setup({ maxSessions: 1 })
    const session = manager.open({ turn: { maxGeneratedTokens: 100 } })
    const events = collect(session)
    session.append('go', { final: true })
    await runUntil(engine, () => events.events.some((e) => e.type === 'response.delta'))
    let sizeAtTerminal = -1
    let requestsAtTerminal = -1
    const watcher = (async () => {
      await events.ended
      sizeAtTerminal = manager.size
      requestsAtTerminal = engine.stats().activeRequests
    })()
    const closing = session.close('bye')
    expect(session.state).toBe('closed')
    await closing
    await watcher
    expect([sizeAtTerminal, requestsAtTerminal]).toEqual([0, 0])
    expect(events.events.map((e) => e.type).slice(-2)).toEqual(['response.done', 'session.closed'])
    expect(events.events.at(-1).reason).toBe('bye')
    checkGrammar(events.events)
  })

  it('delivers nothing of a cancelled response after its response.done, and keeps what it generated', async () => {
    const { engine, manager } = setup()
    const session = manager.open({ turn: { maxGeneratedTokens: 40 } })
    const events = collect(session)
    session.append('tell me a long story', { final: true })
    const responseFence = session.fence
    await runUntil(engine, () => tokensOf(events.events, responseFence).length >= 5)
    const countBefore = engine.stats().generatedTokens
    const next = session.cancel()
    expect(next.epoch).toBe(1)
    // The done of the cancelled response is already queued: same tick.
    const doneIndex = events.events.length
    await settle()
    const done = events.events.find((e) => e.type === 'response.done')
    expect(done).toMatchObject({ status: 'cancelled', fence: responseFence })
    await runUntil(engine, () => !engine.hasPendingWork())
    await settle()
    const after = events.events.slice(events.events.indexOf(done) + 1)
    expect(after.filter((e) => sameFence(e.fence, responseFence))).toEqual([])
    expect(doneIndex).toBeGreaterThan(0)
    expect(engine.stats().generatedTokens - countBefore).toBeLessThanOrEqual(1)
    expect(done.usage.generatedTokens).toBe(tokensOf(events.events, responseFence).length)
    await session.close()
    await events.ended
    checkGrammar(events.events)
  })

  it('accepts an append right after a cancel and starts the next response when the engine is ready', async () => {
    const { engine, manager } = setup()
    const session = manager.open({ turn: { maxGeneratedTokens: 6 } })
    const events = collect(session)
    session.append('first question', { final: true })
    const first = session.fence
    await runUntil(engine, () => tokensOf(events.events, first).length >= 2)
    session.cancel()
    const result = session.append('second question', { final: true })
    expect(result).toMatchObject({ seq: 2, turnSeq: 1, replayed: false })
    const second = session.fence
    expect(second.epoch).toBe(1)
    // respond() cannot begin while the cancelled turn's finish is still in the engine.
    expectCode(mod, () => session.respond(), 'TURN_ACTIVE')
    await runUntil(engine, () => responseEvents(events.events, second).some((e) => e.type === 'response.done'))
    const done = responseEvents(events.events, second).find((e) => e.type === 'response.done')
    expect(done).toMatchObject({ status: 'completed', finishReason: 'max-generated-tokens' })
    expect(tokensOf(events.events, second)).toHaveLength(6)
    await session.close()
    await events.ended
    checkGrammar(events.events)
  })

  it('respond() right after a cancel is EVENTS_PENDING until the engine ran, then works', async () => {
    const { engine, manager } = setup()
    const session = manager.open({ respond: 'manual', turn: { maxGeneratedTokens: 30 } })
    const events = collect(session)
    session.append('question', { final: true })
    expect(session.fence.responseSeq).toBe(0, "'manual': a final append starts nothing")
    const turn = session.respond()
    expect(turn.id).toBe(1)
    expectCode(mod, () => session.respond(), 'TURN_ACTIVE')
    await runUntil(engine, () => events.events.some((e) => e.type === 'response.delta'))
    session.cancel()
    expectCode(mod, () => session.respond(), 'EVENTS_PENDING')
    await runUntil(engine, () => (turn as any)._state.finished)
    await settle()
    const again = session.respond({ maxGeneratedTokens: 2 })
    await runUntil(engine, () => responseEvents(events.events, session.fence).some((e) => e.type === 'response.done'))
    expect(tokensOf(events.events, session.fence)).toHaveLength(2)
    expect((await again.done).finishReason).toBe('max-generated-tokens')
    await session.close()
  })

  it('streams input into the KV as it arrives: the response equals the half-duplex one', async () => {
    const parts = ['The quick brown fox ', 'jumps over ', 'the lazy dog. ', 'What next?']
    const { engine, manager } = setup({}, { maxScheduledTokens: 8 })
    const session = manager.open({ turn: { maxGeneratedTokens: 12 } })
    const events = collect(session)
    for (const [i, part] of parts.entries()) {
      session.append(part, { final: i === parts.length - 1 })
      // Prefill makes progress between appends, as it does in a live session.
      await runUntil(engine, () => !engine.hasPendingWork() || i === parts.length - 1)
    }
    const fence = session.fence
    await runUntil(engine, () => responseEvents(events.events, fence).some((e) => e.type === 'response.done'))
    const streamed = tokensOf(events.events, fence)

    const baseline = mod.Engine.simulated({ seed: 7, maxScheduledTokens: 8 })
    engines.push(baseline)
    const turn = baseline.createRequest().beginTurn(parts.join(''), { maxGeneratedTokens: 12 })
    await runUntil(baseline, () => !baseline.hasPendingWork())
    expect(streamed).toEqual(Array.from((await turn.done).tokens))
    await session.close()
  })

  it('queues input that arrives while a response runs and prefills it, in order, when it ends', async () => {
    const { engine, manager } = setup()
    const session = manager.open({ turn: { maxGeneratedTokens: 5 } })
    const events = collect(session)
    session.append('first', { final: true })
    const first = session.fence
    await runUntil(engine, () => tokensOf(events.events, first).length >= 1)
    session.append(' and then')
    session.append(' more', { final: true })
    const second = session.fence
    expect(second.responseSeq).toBe(2)
    await runUntil(engine, () => responseEvents(events.events, second).some((e) => e.type === 'response.done'))
    // The same context on a plain request: prompt, first response, the queued input.
    const baseline = mod.Engine.simulated({ seed: 7 })
    engines.push(baseline)
    const request = baseline.createRequest()
    const t1 = request.beginTurn('first', { maxGeneratedTokens: 5 })
    await runUntil(baseline, () => !baseline.hasPendingWork())
    expect(tokensOf(events.events, first)).toEqual(Array.from((await t1.done).tokens))
    const t2 = request.beginTurn(' and then more', { maxGeneratedTokens: 5 })
    await runUntil(baseline, () => !baseline.hasPendingWork())
    expect(tokensOf(events.events, second)).toEqual(Array.from((await t2.done).tokens))
    await session.close()
    await events.ended
    checkGrammar(events.events)
  })

  it('bounds the responses waiting behind a running one (retryable capacity)', async () => {
    const { engine, manager } = setup()
    const session = manager.open({ turn: { maxGeneratedTokens: 2 } })
    const events = collect(session)
    session.append('go', { final: true })
    for (let i = 0; i < 16; i++) session.append('', { final: true })
    expectCode(mod, () => session.append('', { final: true }), 'CAPACITY_EXHAUSTED')
    expect(session.fence.responseSeq).toBe(17, 'the refused append started nothing')
    await runUntil(engine, () => events.events.filter((e) => e.type === 'response.done').length === 17)
    expect(events.events.filter((e) => e.type === 'response.done').every((e) => e.status === 'completed')).toBe(true)
    session.append('', { final: true })
    await session.close()
    await events.ended
    checkGrammar(events.events)
  })

  it('truncates the latest response to what the client played, freeing the KV past it', async () => {
    const { engine, manager } = setup({}, { blockSize: 4 })
    const session = manager.open({ turn: { maxGeneratedTokens: 20 } })
    const events = collect(session)
    session.append('abc', { final: true })
    const first = session.fence
    await runUntil(engine, () => responseEvents(events.events, first).some((e) => e.type === 'response.done'))
    const generated = tokensOf(events.events, first)
    const heldBefore = engine.stats().totalBlocks - engine.stats().freeBlocks
    session.truncate(3, { fence: first })
    await settle()
    const heldAfter = engine.stats().totalBlocks - engine.stats().freeBlocks
    expect(heldAfter).toBeLessThan(heldBefore)
    expectCode(mod, () => session.truncate(1, { fence: { ...first, responseSeq: 9 } }), 'FENCE_MISMATCH')
    session.append('d')
    expectCode(mod, () => session.truncate(1), 'INVALID_ARGUMENT')
    session.append('', { final: true })
    const second = session.fence
    await runUntil(engine, () => responseEvents(events.events, second).some((e) => e.type === 'response.done'))

    const baseline = mod.Engine.simulated({ seed: 7, blockSize: 4 })
    engines.push(baseline)
    const context = [...Array.from(baseline.tokenize('abc')), ...generated.slice(0, 3), ...Array.from(baseline.tokenize('d'))]
    const turn = baseline.createRequest().beginTurn(context, { maxGeneratedTokens: 20 })
    await runUntil(baseline, () => !baseline.hasPendingWork())
    expect(tokensOf(events.events, second)).toEqual(Array.from((await turn.done).tokens))
    await session.close()
  })

  it('barge-in with truncation: the cancelled response keeps only what was played', async () => {
    const { engine, manager } = setup()
    const session = manager.open({ turn: { maxGeneratedTokens: 50 } })
    const events = collect(session)
    session.append('hi', { final: true })
    const first = session.fence
    await runUntil(engine, () => tokensOf(events.events, first).length >= 6)
    const before = engine.stats().generatedTokens
    session.cancel(first)
    session.truncate(2)
    session.append('wait', { final: true })
    const second = session.fence
    await runUntil(engine, () => responseEvents(events.events, second).some((e) => e.type === 'response.done'))
    expect(engine.stats().generatedTokens - before).toBeGreaterThan(0)
    const baseline = mod.Engine.simulated({ seed: 7 })
    engines.push(baseline)
    const played = tokensOf(events.events, first).slice(0, 2)
    const context = [...Array.from(baseline.tokenize('hi')), ...played, ...Array.from(baseline.tokenize('wait'))]
    const turn = baseline.createRequest().beginTurn(context, { maxGeneratedTokens: 50 })
    await runUntil(baseline, () => !baseline.hasPendingWork())
    expect(tokensOf(events.events, second)).toEqual(Array.from((await turn.done).tokens))
    await session.close()
  })

  it('respond() again without new input continues the context exactly (its last token is recomputed)', async () => {
    const { engine, manager } = setup({}, { blockSize: 4 })
    const session = manager.open({ respond: 'manual', turn: { maxGeneratedTokens: 5 } })
    const events = collect(session)
    session.append('abcd', { final: true })
    session.respond()
    const first = session.fence
    await runUntil(engine, () => responseEvents(events.events, first).some((e) => e.type === 'response.done'))
    session.respond({ maxGeneratedTokens: 7 })
    const second = session.fence
    await runUntil(engine, () => responseEvents(events.events, second).some((e) => e.type === 'response.done'))
    const baseline = mod.Engine.simulated({ seed: 7, blockSize: 4 })
    engines.push(baseline)
    const context = [...Array.from(baseline.tokenize('abcd')), ...tokensOf(events.events, first)]
    const turn = baseline.createRequest().beginTurn(context, { maxGeneratedTokens: 7 })
    await runUntil(baseline, () => !baseline.hasPendingWork())
    expect(tokensOf(events.events, second)).toEqual(Array.from((await turn.done).tokens))
    expectCode(mod, () => manager.open({ respond: 'manual' }).respond(), 'INVALID_ARGUMENT')
    await manager.close()
  })

  it('a retried cancel of an old fence only cleans up; a fence newer than the session is refused', async () => {
    const { manager } = setup()
    const session = manager.open()
    const original = session.fence
    const first = session.cancel()
    const second = session.cancel()
    expect(second.epoch).toBe(2)
    expect(session.cancel(original)).toEqual(second)
    expect(session.fence).toEqual(second)
    expectCode(mod, () => session.cancel({ ...second, responseSeq: 5 }), 'FENCE_MISMATCH')
    expectCode(mod, () => session.cancel({ ...first, sessionId: 'other' }), 'FENCE_MISMATCH')
    expectCode(mod, () => session.cancel({ epoch: 1 } as never), 'INVALID_ARGUMENT')
  })

  // ----- hostile input (issue 15) -----

  it('refuses token ids outside the vocabulary in every form and leaves the session as it was', async () => {
    const { engine, manager } = setup()
    const session = manager.open()
    const { events } = collect(session)
    for (const input of [new Int32Array([4, -9, 4]), new Int32Array([-1]), [4, -1], new Int32Array([32000]), new Uint16Array([65535]), new Float64Array([1.5])]) {
      expectCode(mod, () => session.append(input), 'INVALID_ARGUMENT')
      expectCode(mod, () => session.append(input, { final: true }), 'INVALID_ARGUMENT')
    }
    expect(session.state).toBe('open')
    expect(session.fence.turnId).toBe(0)
    expect(session.append(new Int32Array([40, 41, 42])).seq).toBe(1, 'refused appends consumed no seq')
    expect(session.append(new Int32Array([43]), { final: true }).seq).toBe(2)
    await runUntil(engine, () => events.some((e) => e.type === 'response.done'))
    expect(events.find((e) => e.type === 'response.done').status).toBe('completed')
    manager.checkInvariants()
  })

  it('an engine-level failure closes every session once with engine_failure; later commands are refused', async () => {
    const { engine, manager } = setup({}, { faults: { fatalSteps: [3] } })
    const running = manager.open({ turn: { maxGeneratedTokens: 50 } })
    const idle = manager.open()
    const runningEvents = collect(running)
    const idleEvents = collect(idle)
    running.append('speak at length', { final: true })
    idle.append('just some context')
    await runUntil(engine, () => runningEvents.events.some((e) => e.type === 'session.closed'))
    await Promise.all([runningEvents.ended, idleEvents.ended])
    const done = runningEvents.events.find((e) => e.type === 'response.done')
    expect(done).toMatchObject({ status: 'failed', finishReason: 'failed', errorCode: 'engine-execution-failure' })
    for (const { events } of [runningEvents, idleEvents]) {
      const terminal = events.filter((e) => e.type === 'session.closed' || e.type === 'session.expired')
      expect(terminal).toHaveLength(1)
      expect(terminal[0].reason).toBe('engine_failure')
      checkGrammar(events)
    }
    for (const session of [running, idle]) {
      expect(session.state).toBe('closed')
      expectCode(mod, () => session.append('more', { final: true }), 'SESSION_CLOSED')
    }
    expect(manager.size).toBe(0)
    expectCode(mod, () => manager.open(), 'ENGINE_UNHEALTHY')
  })

  it('closing the engine closes every session with engine_closed', async () => {
    const { engine, manager } = setup()
    const a = manager.open({ turn: { maxGeneratedTokens: 200 } })
    const b = manager.open()
    const aEvents = collect(a)
    const bEvents = collect(b)
    a.append('a long answer please', { final: true })
    await runUntil(engine, () => aEvents.events.some((e) => e.type === 'response.delta'))
    await engine.close()
    await Promise.all([aEvents.ended, bEvents.ended])
    expect(aEvents.events.find((e) => e.type === 'response.done')).toMatchObject({ status: 'cancelled' })
    for (const { events } of [aEvents, bEvents]) {
      expect(events.filter((e) => e.type === 'session.closed').map((e) => e.reason)).toEqual(['engine_closed'])
      checkGrammar(events)
    }
    expectCode(mod, () => b.append('x'), 'SESSION_CLOSED')
    expect(manager.list()).toEqual([])
  })

  it('refuses session ids, operation ids and reasons that are not well-formed Unicode', async () => {
    const { engine, manager } = setup()
    expectCode(mod, () => manager.open({ sessionId: 'user-\uD83D' }), 'INVALID_ARGUMENT')
    expectCode(mod, () => manager.open({ sessionId: 'user-\uDE00x' }), 'INVALID_ARGUMENT')
    expect(manager.size).toBe(0)
    expect(engine.stats().activeRequests).toBe(0)
    const session = manager.open({ sessionId: 'user-\uD83D\uDE00' })
    expect(session.id).toBe('user-\uD83D\uDE00')
    expect(manager.get('user-\uD83D\uDE00')).toBe(session)
    expectCode(mod, () => session.append('x', { operationId: 'op-\uD800' }), 'INVALID_ARGUMENT')
    await expect(session.close('bye \uDFFF')).rejects.toMatchObject({ code: 'INVALID_ARGUMENT' })
    expect(session.state).toBe('open')
    await session.close()
    expect(manager.list()).toEqual([])
    manager.checkInvariants()
    // A detached session expires in the core and here, with session.expired, its request closed.
    const detached = manager.open({ sessionId: 'gone-\uD83D\uDE00' })
    const { events, ended } = collect(detached)
    detached.detach()
    clock += 31_000
    expect(manager.collectExpired().map((e) => e.sessionId)).toEqual(['gone-\uD83D\uDE00'])
    await ended
    expect(events.at(-1)).toMatchObject({ type: 'session.expired', reason: 'disconnect_grace_expired' })
    expect(engine.stats().activeRequests).toBe(0)
    expect(manager.list()).toEqual([])
  })

  it('checks the session id limit (128 characters) first at every entry that takes an id', () => {
    const { engine, manager } = setup()
    const long = 'é'.repeat(129)
    const named = (fn: () => unknown, what: string) => {
      expectCode(mod, fn, 'INVALID_ARGUMENT')
      expect(() => fn()).toThrow(what)
    }
    named(() => manager.open({ sessionId: long }), 'options.sessionId is longer than 128 characters')
    // Refused before the session's request was made.
    expect(engine.stats().activeRequests).toBe(0)
    named(() => manager.get(long), 'sessionId is longer than 128 characters')
    named(() => manager.get('user-\uD83D'), 'sessionId is not well-formed')
    const session = manager.open({ sessionId: 'é'.repeat(128) })
    expect(manager.get('é'.repeat(128))).toBe(session)
    expect(manager.get('é'.repeat(127))).toBeUndefined()
    const stale = { ...session.fence, sessionId: long }
    named(() => session.append('x', { fence: stale }), 'opts.fence.sessionId is longer than 128 characters')
    named(() => session.cancel(stale), 'cancelled.sessionId is longer than 128 characters')
    expect(session.fence.epoch).toBe(0)
    manager.checkInvariants()
  })

  it('a clock that fails once leaks nothing: later appends of every session keep working', async () => {
    let broken = false
    const { engine, manager } = setup({ now: () => (broken ? Number.NaN : clock) })
    const sessions = [manager.open(), manager.open()]
    for (let i = 0; i < 100; i++) {
      broken = true
      expectCode(mod, () => sessions[i % 2]!.append('tick '), 'INVALID_ARGUMENT')
      broken = false
    }
    for (const session of sessions) expect(session.append('still fine ').seq).toBe(1)
    engine.checkInvariants()
    manager.checkInvariants()
  })

  it('limits operation ids and close reasons in characters, and close() rejects instead of throwing', async () => {
    const { manager } = setup()
    const session = manager.open({ sessionId: 'é'.repeat(128) })
    expect(session.append('hi', { operationId: 'é'.repeat(256) }).seq).toBe(1)
    expectCode(mod, () => session.append('hi', { operationId: 'é'.repeat(257) }), 'INVALID_ARGUMENT')
    expectCode(mod, () => manager.open({ sessionId: 'é'.repeat(129) }), 'INVALID_ARGUMENT')
    let returned: unknown
    expect(() => {
      returned = session.close('x'.repeat(300))
    }).not.toThrow()
    await expect(returned).rejects.toMatchObject({ code: 'INVALID_ARGUMENT' })
    expect(session.state).toBe('open')
    await session.close('é'.repeat(200))
    expect(session.state).toBe('closed')
  })

  it('runs responses on a driven engine too (the caller starts it)', async () => {
    const { engine, manager } = setup()
    engine.start()
    const sessions = Array.from({ length: 4 }, () => manager.open({ turn: { maxGeneratedTokens: 8 } }))
    const collected = sessions.map((session) => collect(session))
    for (const [i, session] of sessions.entries()) session.append(`question ${i}`, { final: true })
    for (const c of collected) {
      for (let i = 0; i < 10_000 && !c.events.some((e) => e.type === 'response.done'); i++) await settle(1)
    }
    for (const c of collected) expect(c.events.find((e) => e.type === 'response.done')?.status).toBe('completed')
    await manager.close()
    await Promise.all(collected.map((c) => c.ended))
    for (const c of collected) checkGrammar(c.events)
    expect(engine.stats().activeRequests).toBe(0)
    await engine.stop()
  })
})
