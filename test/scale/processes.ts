// Real processes for the drain and scale suites: `ortex serve` children (the built CLI), and the
// small clients that talk to them over HTTP and WebSocket. Every wait is bounded.
//
// Each child is started in a process group of its own (detached), so that it can be stopped with
// whatever it started (nginx's workers, a redis-server's rewrite child), and every group is
// remembered: a suite ends with `livingProcesses()`, which must be empty.
import { type ChildProcess, type SpawnOptions, spawn } from 'node:child_process'
import { readdirSync, readFileSync } from 'node:fs'
import path from 'node:path'
import WebSocket from 'ws'

/** The built CLI (a function: bench/failover.ts bundles this file as ESM, without __dirname). */
const cli = (): string => path.resolve(__dirname, '../../dist/cli.js')

export interface ServeProcess {
  child: ChildProcess
  /** http://127.0.0.1:PORT */
  url: string
  port: number
  /** Everything the child wrote, both streams. */
  output: () => string
  /** The exit status (or the signal's name). */
  exited: Promise<number | string>
}

/** The process groups this process started (their leaders' pids), with what each one runs. */
const groups = new Map<number, string>()

/** Starts `command` as the leader of a new process group, remembered for livingProcesses(). */
export function spawnGroup(command: string, args: string[], options: SpawnOptions): ChildProcess {
  const child = spawn(command, args, { ...options, detached: true })
  if (child.pid !== undefined) groups.set(child.pid, `${command} ${args.join(' ')}`.slice(0, 120))
  return child
}

/** Sends `signal` to every process of `child`'s group (nothing when the group is empty). */
export function signalGroup(child: ChildProcess, signal: NodeJS.Signals): void {
  if (child.pid === undefined) return
  try {
    process.kill(-child.pid, signal)
  } catch {
    // ESRCH: the whole group is gone already.
  }
}

/** SIGKILL to `child`'s group, then waits for `child` itself to be reaped. */
export async function killGroup(child: ChildProcess): Promise<void> {
  const exited = child.exitCode !== null || child.signalCode !== null
  const reaped = exited ? Promise.resolve() : new Promise<void>((resolve) => child.once('exit', () => resolve()))
  signalGroup(child, 'SIGKILL')
  await reaped
}

/**
 * The processes still alive in any group this process started ("pid command" each), read from
 * /proc (Linux: the suites need Debian's packages anyway). A zombie waiting to be reaped counts
 * as gone.
 */
export function livingProcesses(): string[] {
  const living: string[] = []
  for (const name of readdirSync('/proc')) {
    if (!/^\d+$/.test(name)) continue
    let stat: string
    try {
      stat = readFileSync(`/proc/${name}/stat`, 'utf8')
    } catch {
      continue // it ended while we looked
    }
    // pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses, so read after the last ')'.
    const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ')
    const state = fields[0]
    const pgrp = Number(fields[2])
    if (state === 'Z' || !groups.has(pgrp)) continue
    living.push(`${name} ${stat.slice(stat.indexOf('(') + 1, stat.lastIndexOf(')'))} (group of ${groups.get(pgrp)})`)
  }
  return living
}

/** Starts `ortex serve ARGS --port 0` and resolves once it listens. */
export async function startServe(args: string[], env: Record<string, string> = {}): Promise<ServeProcess> {
  const child = spawnGroup(process.execPath, [cli(), 'serve', '--port', '0', ...args], {
    env: { ...process.env, ...env },
    stdio: ['ignore', 'pipe', 'pipe'],
  })
  let output = ''
  child.stdout!.on('data', (chunk: Buffer) => (output += chunk.toString('utf8')))
  child.stderr!.on('data', (chunk: Buffer) => (output += chunk.toString('utf8')))
  const exited = new Promise<number | string>((resolve) => child.once('exit', (code, signal) => resolve(code ?? signal ?? -1)))
  const url = await within(30_000, 'ortex serve to listen', async () => {
    for (;;) {
      const match = /listening on (http:\/\/[^ ]+)/.exec(output)
      if (match !== null) return match[1]!
      if (child.exitCode !== null) throw new Error(`ortex serve exited: ${output}`)
      await sleep(20)
    }
  }).catch(async (error: unknown) => {
    await killGroup(child)
    throw error
  })
  return { child, url, port: Number(new URL(url).port), output: () => output, exited }
}

export function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms))
}

/** `work`, or a rejection naming `what` after `ms`. */
export async function within<T>(ms: number, what: string, work: () => Promise<T>): Promise<T> {
  let timer: NodeJS.Timeout | undefined
  const timeout = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`timed out after ${ms} ms waiting for ${what}`)), ms)
  })
  try {
    return await Promise.race([work(), timeout])
  } finally {
    clearTimeout(timer)
  }
}

export interface StreamOutcome {
  status: number
  /** Content chunks received. */
  chunks: number
  /** The stream ended with [DONE]. */
  done: boolean
  finishReason: string | null
  error: string | null
}

/**
 * A streamed /v1/completions request. `onChunk` is told of each content chunk as it arrives.
 * Never rejects: a transport failure is an outcome with `error`.
 */
export async function streamCompletion(
  base: string,
  body: Record<string, unknown>,
  headers: Record<string, string> = {},
  onChunk: () => void = () => {},
  signal?: AbortSignal,
): Promise<StreamOutcome> {
  const outcome: StreamOutcome = { status: 0, chunks: 0, done: false, finishReason: null, error: null }
  try {
    const response = await fetch(`${base}/v1/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json', ...headers },
      body: JSON.stringify({ ...body, stream: true }),
      signal,
    })
    outcome.status = response.status
    if (response.status !== 200 || response.body === null) {
      outcome.error = (await response.text()).slice(0, 200)
      return outcome
    }
    const decoder = new TextDecoder()
    let pending = ''
    for await (const bytes of response.body) {
      pending += decoder.decode(bytes as Uint8Array, { stream: true })
      let end: number
      while ((end = pending.indexOf('\n\n')) !== -1) {
        const line = pending.slice(0, end).replace(/^data: /, '')
        pending = pending.slice(end + 2)
        if (line === '[DONE]') {
          outcome.done = true
          continue
        }
        const event = JSON.parse(line)
        if (event.error !== undefined) outcome.error = event.error.message
        const choice = event.choices?.[0]
        if (choice === undefined) continue
        if (choice.finish_reason != null) outcome.finishReason = choice.finish_reason
        outcome.chunks++
        onChunk()
      }
    }
  } catch (error) {
    outcome.error = (error as Error).message
  }
  return outcome
}

/** One WebSocket client of the duplex protocol: its events in order, and waits on them. */
export class DuplexClient {
  readonly events: any[] = []
  closeCode: number | null = null
  private waiters: (() => void)[] = []

  private constructor(readonly ws: WebSocket) {
    ws.on('message', (data) => {
      this.events.push(JSON.parse(data.toString()))
      this.wake()
    })
    ws.on('close', (code) => {
      this.closeCode = code
      this.wake()
    })
    ws.on('error', () => {
      // 'close' follows.
    })
  }

  static async connect(url: string): Promise<DuplexClient> {
    const ws = new WebSocket(url, ['ortex'])
    await new Promise<void>((resolve, reject) => {
      ws.once('open', () => resolve())
      ws.once('error', reject)
      ws.once('unexpected-response', (_req, res) => reject(new Error(`upgrade refused: HTTP ${res.statusCode}`)))
    })
    return new DuplexClient(ws)
  }

  send(event: Record<string, unknown>): void {
    this.ws.send(JSON.stringify(event))
  }

  /** The first event after `from` (an index into events) that `match` accepts. */
  async next(match: (event: any) => boolean, from = 0, ms = 20_000): Promise<any> {
    return within(ms, 'a duplex event', async () => {
      for (;;) {
        const found = this.events.slice(from).find(match)
        if (found !== undefined) return found
        if (this.closeCode !== null) throw new Error(`the connection closed (${this.closeCode}) first`)
        await new Promise<void>((resolve) => this.waiters.push(resolve))
      }
    })
  }

  async closed(ms = 20_000): Promise<number> {
    return within(ms, 'the connection to close', async () => {
      while (this.closeCode === null) await new Promise<void>((resolve) => this.waiters.push(resolve))
      return this.closeCode
    })
  }

  close(): void {
    this.ws.close()
  }

  private wake(): void {
    const waiters = this.waiters
    this.waiters = []
    for (const wake of waiters) wake()
  }
}

/** A free TCP port on loopback (the OS picks it; a race with another process is possible but
 *  needs a second program asking for the same ephemeral port in between). */
export async function freePort(): Promise<number> {
  const net = await import('node:net')
  return new Promise((resolve, reject) => {
    const server = net.createServer()
    server.once('error', reject)
    server.listen(0, '127.0.0.1', () => {
      const port = (server.address() as import('node:net').AddressInfo).port
      server.close(() => resolve(port))
    })
  })
}

export interface RedisProcess {
  port: number
  url: string
  child: ChildProcess
  stop(): Promise<void>
}

/**
 * Starts Debian's redis-server on `port` and waits until it answers: a fresh, memory-only one, or
 * with `dir`, one that logs every write to an append-only file there before it answers (so a
 * redis-server killed and started again on the same `dir` has lost nothing it acknowledged).
 */
export async function startRedis(port: number, dir?: string): Promise<RedisProcess> {
  const persistence = dir === undefined ? ['--save', '', '--appendonly', 'no'] : ['--save', '', '--dir', dir, '--appendonly', 'yes', '--appendfsync', 'always']
  const child = spawnGroup('redis-server', ['--port', String(port), '--bind', '127.0.0.1', ...persistence], { stdio: 'ignore' })
  const url = `redis://127.0.0.1:${port}`
  await within(10_000, 'redis-server to answer', async () => {
    for (;;) {
      if (await answersPing(port)) return
      if (child.exitCode !== null) throw new Error('redis-server exited')
      await sleep(20)
    }
  }).catch(async (error: unknown) => {
    await killGroup(child)
    throw error
  })
  // SIGKILL, as a crash: whatever it held only in memory is gone.
  return { port, url, child, stop: () => killGroup(child) }
}

async function answersPing(port: number): Promise<boolean> {
  const net = await import('node:net')
  return new Promise((resolve) => {
    const socket = net.connect(port, '127.0.0.1')
    socket.once('error', () => resolve(false))
    socket.once('connect', () => socket.write('PING\r\n'))
    socket.once('data', (data) => {
      resolve(data.toString().startsWith('+PONG'))
      socket.destroy()
    })
  })
}

/** The token ids of the response deltas `client` received for the response whose fence has
 *  `responseSeq`, from index `from` of its events. */
export function responseTokens(events: any[], from = 0): number[] {
  const tokens: number[] = []
  for (const event of events.slice(from)) {
    if (event.type === 'response.output_text.delta' && event.token !== null) tokens.push(event.token)
    if (event.type === 'response.done') break
  }
  return tokens
}

export interface DelayProxy {
  port: number
  /** Stops listening and drops every connection. */
  close(): Promise<void>
}

/**
 * A TCP proxy on loopback to `targetPort` that holds everything it forwards, each way, for
 * `delayMs` (in order). Between `ortex serve` and redis-server, it stands for a store some way
 * off, and widens the moments between a commit and its write enough for a kill to land there.
 * When either side closes, the other is closed after what is still held went through.
 */
export async function startDelayProxy(targetPort: number, delayMs: number): Promise<DelayProxy> {
  const net = await import('node:net')
  const sockets = new Set<import('node:net').Socket>()
  const pipe = (from: import('node:net').Socket, to: import('node:net').Socket): void => {
    from.on('data', (chunk) => setTimeout(() => to.destroyed || to.write(chunk), delayMs))
    from.on('close', () => setTimeout(() => to.destroy(), delayMs))
  }
  const server = net.createServer((client) => {
    const upstream = net.connect(targetPort, '127.0.0.1')
    for (const socket of [client, upstream]) {
      sockets.add(socket)
      socket.on('error', () => socket.destroy())
      socket.on('close', () => sockets.delete(socket))
    }
    pipe(client, upstream)
    pipe(upstream, client)
  })
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject)
    server.listen(0, '127.0.0.1', () => resolve())
  })
  return {
    port: (server.address() as import('node:net').AddressInfo).port,
    close: () =>
      new Promise<void>((resolve) => {
        for (const socket of sockets) socket.destroy()
        server.close(() => resolve())
      }),
  }
}
