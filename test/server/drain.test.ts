// SIGTERM drains `ortex serve` (a real child process over the tiny ONNX model, so streams take a
// while): health turns 503 "draining", new requests and sessions are refused with 503, the
// streams in flight run to their end, a duplex session's connection is closed with 1012 (resume
// elsewhere), and the process exits with status 0.
import { mkdtempSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { makeModel } from '../../ts/modelkit/make-model'
import { DuplexClient, type ServeProcess, type StreamOutcome, sleep, startServe, streamCompletion, within } from '../scale/processes'

let root = ''
let modelDir = ''

beforeAll(async () => {
  root = mkdtempSync(join(tmpdir(), 'ortex-drain-'))
  modelDir = join(root, 'tiny')
  await makeModel({ outDir: modelDir, size: 'tiny' })
})
afterAll(() => {
  if (root) rmSync(root, { recursive: true, force: true })
})

const STREAMS = 12

describe('ortex serve: SIGTERM drains', () => {
  let server: ServeProcess | null = null
  afterAll(() => {
    if (server !== null && server.child.exitCode === null) server.child.kill('SIGKILL')
  })

  it('lets streams in flight finish, refuses new work with 503, detaches sessions with 1012, exits 0', async () => {
    server = await startServe(['--model', modelDir, '--drain-timeout-ms', '60000'])
    const base = server.url
    // A session with one finished response: it must be detached resumably.
    const client = await DuplexClient.connect(base.replace('http', 'ws'))
    client.send({ type: 'input_text.append', text: 'hello there', final: true })
    await client.next((e) => e.type === 'response.done')

    let started = 0
    let streams: Promise<StreamOutcome>[] = []
    const allStarted = new Promise<void>((resolve) => {
      const onFirst = (): void => {
        if (++started === STREAMS) resolve()
      }
      streams = Array.from({ length: STREAMS }, (_, i) => {
        let first = true
        return streamCompletion(base, { model: 'tiny', prompt: `stream ${i}`, max_tokens: 1500, temperature: 0 }, {}, () => {
          if (first) onFirst()
          first = false
        })
      })
    })
    await within(30_000, 'every stream to start', () => allStarted)
    const finishedBeforeSignal = await countSettled(streams)
    server.child.kill('SIGTERM')
    await within(10_000, 'the drain to begin', async () => {
      while (!/draining/.test(server!.output())) await sleep(5)
    })

    // While the streams run: draining, and nothing new is taken.
    const health = await fetch(`${base}/health`)
    expect(health.status).toBe(503)
    expect(await health.json()).toMatchObject({ status: 'draining' })
    const refused = await fetch(`${base}/v1/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: 'tiny', prompt: 'late', max_tokens: 4 }),
    })
    expect(refused.status).toBe(503)
    expect((await refused.json()).error.code).toBe('server_draining')
    await expect(DuplexClient.connect(base.replace('http', 'ws'))).rejects.toThrow(/HTTP 503/)

    const outcomes = await Promise.all(streams)
    for (const outcome of outcomes) {
      expect(outcome).toMatchObject({ status: 200, done: true, error: null })
      expect(outcome.finishReason).not.toBe('cancelled')
    }
    // The drain was tested: streams were still running when the signal came.
    expect(finishedBeforeSignal).toBeLessThan(STREAMS)
    expect(await client.closed()).toBe(1012)
    expect(await within(30_000, 'the exit', () => server!.exited)).toBe(0)
    expect(server.output()).toMatch(/draining/)
  })
})

/** How many of `promises` have settled by now. */
async function countSettled(promises: Promise<unknown>[]): Promise<number> {
  const marker = Symbol('pending')
  const states = await Promise.all(promises.map((p) => Promise.race([p, Promise.resolve(marker)])))
  return states.filter((state) => state !== marker).length
}
