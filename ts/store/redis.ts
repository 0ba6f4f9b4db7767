// A SessionStore in Redis, through ioredis (an optional peer dependency: only a server given a
// store loads it). One hash per session, `<prefix><session id>`, with a TTL renewed at each
// write. The compare-and-sets are Lua scripts, which Redis runs atomically: of any number of
// claims racing on any processes, one sees the expected generation and moves it.
//
// ioredis is set to fail fast while Redis is away (no offline queue, one try per command, a
// command timeout), so that a resume during an outage gets a retryable error at once, and the
// sessions on their owners keep working: a failed commit is written again, whole, at the next one.

import type { Fence } from '../duplex/events'
import { OrtexError } from '../errors'
import { type ClaimOutcome, type SessionStore, SessionStoreUnavailable, type StoredResponse, type StoredSession } from './session-store'

/** What this module uses of an ioredis client. */
interface RedisClient {
  connect(): Promise<void>
  quit(): Promise<unknown>
  disconnect(): void
  on(event: 'error', listener: (error: Error) => void): unknown
  on(event: 'ready', listener: () => void): unknown
  evalsha(sha: string, numKeys: number, ...args: (string | number)[]): Promise<unknown>
  script(command: 'LOAD', script: string): Promise<unknown>
  pexpire(key: string, ms: number): Promise<unknown>
}

export interface RedisSessionStoreOptions {
  /** Key prefix (default 'ortex:session:'). */
  keyPrefix?: string
  /** Longest wait for one command (default 2000 ms). */
  commandTimeoutMs?: number
}

// KEYS[1] the record; ARGV: owner, incarnation, generation, token digest, config, tokens, pending,
// ttl, continuation, ended.
const COMMIT = `
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'closed' then return 'closed' end
if state then
  local held = redis.call('HMGET', KEYS[1], 'owner', 'incarnation')
  if held[1] ~= ARGV[1] or held[2] ~= ARGV[2] then return 'fenced' end
  redis.call('HSET', KEYS[1], 'config', ARGV[5], 'tokens', ARGV[6], 'pending', ARGV[7], 'continuation', ARGV[9],
    'ended', ARGV[10])
else
  redis.call('HSET', KEYS[1], 'state', 'open', 'owner', ARGV[1], 'incarnation', ARGV[2], 'generation', ARGV[3],
    'token', ARGV[4], 'config', ARGV[5], 'tokens', ARGV[6], 'pending', ARGV[7], 'continuation', ARGV[9],
    'ended', ARGV[10])
end
redis.call('PEXPIRE', KEYS[1], ARGV[8])
return 'written'
`

// KEYS[1]; ARGV: token digest, expected generation, claimer, claimer's incarnation ('' if none), ttl.
const CLAIM = `
local r = redis.call('HMGET', KEYS[1], 'state', 'token', 'generation', 'owner', 'incarnation')
if not r[1] then return {'missing'} end
if r[1] == 'closed' then return {'closed'} end
if r[2] ~= ARGV[1] then return {'bad-token'} end
if r[3] ~= ARGV[2] then return {'generation-mismatch', r[3]} end
local generation = tonumber(r[3]) + 1
local incarnation = tonumber(r[5])
local kept = r[4] == ARGV[3] and r[5] == ARGV[4]
if not kept then incarnation = incarnation + 1 end
redis.call('HSET', KEYS[1], 'generation', generation, 'incarnation', incarnation, 'owner', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
if kept then return {'kept', tostring(generation), tostring(incarnation)} end
local rest = redis.call('HMGET', KEYS[1], 'config', 'tokens', 'pending', 'continuation', 'ended')
return {'moved', tostring(generation), tostring(incarnation), rest[1], rest[2], rest[3], rest[4], rest[5]}
`

// KEYS[1]; ARGV: owner, incarnation, ttl.
const END = `
local held = redis.call('HMGET', KEYS[1], 'owner', 'incarnation')
if held[1] ~= ARGV[1] or held[2] ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'state', 'closed')
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
`

/** A script run by its SHA-1 (loaded at first use, and again when a restarted Redis lost it). */
class Script {
  private sha: string | null = null
  constructor(private readonly source: string) {}

  async run(client: RedisClient, keys: string[], args: (string | number)[]): Promise<unknown> {
    this.sha ??= String(await client.script('LOAD', this.source))
    try {
      return await client.evalsha(this.sha, keys.length, ...keys, ...args)
    } catch (error) {
      if (!String((error as Error).message).includes('NOSCRIPT')) throw error
    }
    // A restarted Redis forgot the script: load it again.
    this.sha = String(await client.script('LOAD', this.source))
    return await client.evalsha(this.sha, keys.length, ...keys, ...args)
  }
}

export class RedisSessionStore implements SessionStore {
  private readonly commitScript = new Script(COMMIT)
  private readonly claimScript = new Script(CLAIM)
  private readonly endScript = new Script(END)

  private readonly reconnectListeners: (() => void)[] = []

  private constructor(
    private readonly client: RedisClient,
    private readonly keyPrefix: string,
  ) {
    // 'ready' after the first: ioredis reconnected (to a Redis that may have restarted empty).
    client.on('ready', () => {
      for (const listener of this.reconnectListeners) listener()
    })
  }

  onReconnect(listener: () => void): void {
    this.reconnectListeners.push(listener)
  }

  /** Connects to `url` (redis://HOST:PORT[/DB]). Rejects when Redis cannot be reached, or with
   *  INVALID_ARGUMENT when ioredis is not installed. */
  static async connect(url: string, options: RedisSessionStoreOptions = {}): Promise<RedisSessionStore> {
    if (!/^rediss?:\/\//.test(url)) throw new OrtexError('INVALID_ARGUMENT', `a session store is a redis:// URL, got ${JSON.stringify(url.slice(0, 200))}`)
    const Redis = await loadIoredis()
    const client = new Redis(url, {
      lazyConnect: true,
      enableOfflineQueue: false,
      maxRetriesPerRequest: 0,
      commandTimeout: options.commandTimeoutMs ?? 2000,
      connectTimeout: 2000,
      // Reconnects for ever, at most a second apart: the sessions outlive an outage.
      retryStrategy: (attempt: number) => Math.min(attempt * 100, 1000),
    }) as RedisClient
    // An error event without a listener would crash the process; each command reports its own.
    // The latest one says why a connection failed (connect() itself only says it closed).
    let lastError: Error | null = null
    client.on('error', (error) => {
      lastError = error
    })
    try {
      await client.connect()
    } catch (error) {
      client.disconnect()
      const why = (lastError ?? (error as Error)).message
      throw new SessionStoreUnavailable(`cannot reach the session store at ${url}: ${why}`, { cause: error })
    }
    return new RedisSessionStore(client, options.keyPrefix ?? 'ortex:session:')
  }

  async commit(record: StoredSession, ttlMs: number): Promise<'written' | 'fenced' | 'closed'> {
    const args = [
      record.owner,
      record.incarnation,
      record.leaseGeneration,
      record.tokenDigest,
      record.config,
      encodeTokens(record.tokens),
      JSON.stringify(record.pendingResponses),
      ttlMs,
      record.continuation ?? '',
      JSON.stringify(record.endedResponses),
    ]
    const result = await this.call(() => this.commitScript.run(this.client, [this.key(record.sessionId)], args))
    return result as 'written' | 'fenced' | 'closed'
  }

  async claim(
    sessionId: string,
    tokenDigest: string,
    expectedGeneration: number,
    claimer: { owner: string; heldIncarnation: number | null },
    ttlMs: number,
  ): Promise<ClaimOutcome> {
    const held = claimer.heldIncarnation === null ? '' : String(claimer.heldIncarnation)
    const args = [tokenDigest, expectedGeneration, claimer.owner, held, ttlMs]
    const reply = (await this.call(() => this.claimScript.run(this.client, [this.key(sessionId)], args))) as (string | null)[]
    switch (reply[0]) {
      case 'kept':
        return { kind: 'kept', leaseGeneration: Number(reply[1]), incarnation: Number(reply[2]) }
      case 'moved':
        return {
          kind: 'moved',
          record: {
            sessionId,
            leaseGeneration: Number(reply[1]),
            incarnation: Number(reply[2]),
            owner: claimer.owner,
            tokenDigest,
            config: reply[3] ?? '{}',
            tokens: decodeTokens(reply[4] ?? ''),
            pendingResponses: JSON.parse(reply[5] ?? '[]') as Fence[],
            // A record an older ortex wrote has neither: the rules start at zero, nothing ended.
            continuation: reply[6] == null || reply[6] === '' ? null : reply[6],
            endedResponses: JSON.parse(reply[7] ?? '[]') as StoredResponse[],
          },
        }
      case 'generation-mismatch':
        return { kind: 'generation-mismatch', current: Number(reply[1]) }
      case 'missing':
      case 'closed':
      case 'bad-token':
        return { kind: reply[0] }
      default:
        throw new SessionStoreUnavailable(`the session store answered a claim with ${JSON.stringify(reply).slice(0, 200)}`)
    }
  }

  async end(sessionId: string, owner: string, incarnation: number, ttlMs: number): Promise<void> {
    await this.call(() => this.endScript.run(this.client, [this.key(sessionId)], [owner, incarnation, ttlMs]))
  }

  async touch(sessionId: string, ttlMs: number): Promise<void> {
    await this.call(() => this.client.pexpire(this.key(sessionId), ttlMs))
  }

  async quit(): Promise<void> {
    try {
      await this.client.quit()
    } catch {
      this.client.disconnect()
    }
  }

  private key(sessionId: string): string {
    return this.keyPrefix + sessionId
  }

  /** Every failure of the store (down, a timeout, a script error) is one retryable kind. */
  private async call<T>(command: () => Promise<T>): Promise<T> {
    try {
      return await command()
    } catch (error) {
      throw new SessionStoreUnavailable(`the session store failed: ${(error as Error).message}`, { cause: error })
    }
  }
}

type RedisConstructor = new (url: string, options: Record<string, unknown>) => unknown

async function loadIoredis(): Promise<RedisConstructor> {
  try {
    const module = (await import('ioredis')) as unknown as { default?: RedisConstructor; Redis?: RedisConstructor }
    const Redis = module.Redis ?? module.default
    if (typeof Redis !== 'function') throw new Error('ioredis exports no Redis class')
    return Redis
  } catch (error) {
    throw new OrtexError('INVALID_ARGUMENT', `a Redis session store needs the ioredis package: npm install ioredis (${(error as Error).message})`)
  }
}

/** Token ids as little-endian int32, base64: 5.3 characters per token. */
function encodeTokens(tokens: Int32Array): string {
  const bytes = Buffer.alloc(tokens.length * 4)
  for (let i = 0; i < tokens.length; i++) bytes.writeInt32LE(tokens[i]!, i * 4)
  return bytes.toString('base64')
}

function decodeTokens(text: string): Int32Array {
  const bytes = Buffer.from(text, 'base64')
  const tokens = new Int32Array(bytes.length >> 2)
  for (let i = 0; i < tokens.length; i++) tokens[i] = bytes.readInt32LE(i * 4)
  return tokens
}
