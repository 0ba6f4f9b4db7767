// Starting the duplex server: its options (DuplexServerOptions) checked with their defaults, the
// session manager made, the WebSocket layer's handshake (the API key before the upgrade, 503
// while draining), the session store opened, and the engine started. What the started server
// does is websocket.ts.

import type { ServerOptions as WsServerOptions, VerifyClientCallbackAsync, WebSocketServer } from 'ws'

import type { Engine } from '../../engine'
import { OrtexError } from '../../errors'
import { DuplexSessionManager } from '../../duplex/manager'
import { checkConfig } from '../../duplex/session'
import type { TurnOptions } from '../../types'
import * as v from '../../validate'
import { RedisSessionStore } from '../../store/redis'
import type { SessionStore } from '../../store/session-store'
import { ApiKey, selectSubprotocol } from '../auth'
import { flowLimits } from '../flow'
import { DuplexServer, type ServerSettings, type StoreSettings } from './websocket'

export interface DuplexServerOptions {
  /** Default 8787; 0 picks a free port. */
  port?: number
  /** Default '127.0.0.1'. */
  host?: string
  /** Upgrades need this key, as `Authorization: Bearer <apiKey>` or as the subprotocol
   *  `ortex-api-key.<apiKey>` offered beside `ortex` (docs/duplex-protocol.md); without it the
   *  upgrade is refused with HTTP 401. Default: none needed. startServer sets it to its own. */
  apiKey?: string
  /** Sessions at once; default unlimited. Beyond it a session creation gets CAPACITY_EXHAUSTED. */
  maxSessions?: number
  idleTtlMs?: number | null
  disconnectGraceMs?: number
  completedAppendLimit?: number
  /** Largest message accepted, in bytes (default 65536); a larger one gets an error event. Frames
   *  above max(1 MiB, 4 x this) are refused by the WebSocket layer (close code 1009). */
  maxMessageBytes?: number
  /** How often expired sessions are collected (default 1000 ms; 0: never, call collectExpired). */
  sweepIntervalMs?: number
  /** Most bytes one connection may have waiting to be sent (default 1 MiB). Above it the server
   *  stops reading that connection and its session's events wait in the session. */
  maxBufferedBytes?: number
  /** A connection that stays above maxBufferedBytes this long is closed with code 1008
   *  (default 30000 ms). */
  sendStallMs?: number
  /** How often the server pings each connection; one that has not answered the previous ping is
   *  dropped, so a half-open connection detaches its session (default 30000 ms; 0 disables). */
  pingIntervalMs?: number
  /** Turn options of every response (session.update and response.create may override them);
   *  default {maxGeneratedTokens: 256}. */
  turn?: TurnOptions
  /** The sessions' clock (default Date.now); tests pass a fake one. */
  now?: () => number
  /** Where sessions outlive this process (docs/scaling.md): a `redis://HOST:PORT` URL (needs the
   *  ioredis package; the server connects at start and disconnects at close) or a SessionStore.
   *  Each session's record is written at its commit points, and a `session.resume` for a session
   *  this process does not hold takes it over from the store. Default: none. */
  sessionStore?: string | SessionStore
}

export const DEFAULT_PORT = 8787
const DEFAULT_MAX_MESSAGE_BYTES = 65_536
const DEFAULT_SWEEP_INTERVAL_MS = 1000
const DEFAULT_TURN: TurnOptions = { maxGeneratedTokens: 256 }
const DEFAULT_PING_INTERVAL_MS = 30_000

/** The WebSocket layer's handshake: the key checked before the upgrade (a refused client gets
 *  HTTP 401 and never an open WebSocket), and a subprotocol chosen that never echoes the key. */
function upgradeOptions(apiKey: ApiKey | null, maxPayload: number, admission: { open: boolean }): WsServerOptions {
  const verify: VerifyClientCallbackAsync = (info, callback) => {
    if (!admission.open) callback(false, 503, 'Service Unavailable', { 'Retry-After': '1' })
    else if (apiKey === null || apiKey.inUpgrade(info.req)) callback(true)
    else callback(false, 401, 'Unauthorized', { 'WWW-Authenticate': 'Bearer' })
  }
  return { maxPayload, handleProtocols: selectSubprotocol, verifyClient: verify }
}

/** Starts a server over `engine` (driven: the server calls engine.start()). `httpServer`: an
 *  HTTP server already listening whose upgrade requests the sessions take (startServer's, which
 *  serves the HTTP API on the same port); absent, the WebSocket layer listens on its own. */
export async function startDuplexServer(
  engine: Engine,
  options?: DuplexServerOptions,
  httpServer?: import('node:http').Server,
): Promise<DuplexServer> {
  const present = v.options('options', options, [
    'port',
    'host',
    'apiKey',
    'maxSessions',
    'idleTtlMs',
    'disconnectGraceMs',
    'completedAppendLimit',
    'maxMessageBytes',
    'sweepIntervalMs',
    'maxBufferedBytes',
    'sendStallMs',
    'pingIntervalMs',
    'turn',
    'now',
    'sessionStore',
  ])
  const count = (key: string, fallback: number, min: number, max = Number.MAX_SAFE_INTEGER): number =>
    present.has(key) ? v.integer(`options.${key}`, present.get(key), min, max) : fallback
  const port = count('port', DEFAULT_PORT, 0, 65_535)
  const host = present.has('host') ? v.string('options.host', present.get('host')) : '127.0.0.1'
  const apiKey = ApiKey.fromOption('options.apiKey', present)
  const settings: ServerSettings = {
    maxMessageBytes: count('maxMessageBytes', DEFAULT_MAX_MESSAGE_BYTES, 64, 1 << 26),
    turn: (present.get('turn') as TurnOptions | undefined) ?? DEFAULT_TURN,
    sweepIntervalMs: count('sweepIntervalMs', DEFAULT_SWEEP_INTERVAL_MS, 0),
    flow: flowLimits(present),
    pingIntervalMs: count('pingIntervalMs', DEFAULT_PING_INTERVAL_MS, 0),
  }
  const manager = new DuplexSessionManager(engine, {
    maxSessions: present.get('maxSessions') as number | undefined,
    idleTtlMs: present.get('idleTtlMs') as number | null | undefined,
    disconnectGraceMs: present.get('disconnectGraceMs') as number | undefined,
    completedAppendLimit: present.get('completedAppendLimit') as number | undefined,
    now: present.get('now') as (() => number) | undefined,
  })
  // Checks the turn options once, as every session would.
  checkConfig('options', { turn: settings.turn }, engine)
  const ws = await import('ws')
  const admission = { open: true }
  const wss = await new Promise<WebSocketServer>((resolve, reject) => {
    const common = upgradeOptions(apiKey, Math.max(1 << 20, 4 * settings.maxMessageBytes), admission)
    if (httpServer !== undefined) {
      resolve(new ws.WebSocketServer({ ...common, server: httpServer }))
      return
    }
    const server = new ws.WebSocketServer({ ...common, port, host })
    server.once('listening', () => resolve(server))
    server.once('error', reject)
  })
  let storage: StoreSettings | null = null
  try {
    storage = await openStore(present.get('sessionStore'), present.get('disconnectGraceMs'), present.get('idleTtlMs'))
  } catch (error) {
    wss.close()
    throw error
  }
  engine.start()
  return new DuplexServer(wss, manager, settings, admission, storage)
}

/** A record lives as long as its session could still be resumed: the idle TTL (a day without
 *  one) plus the disconnect grace; each write renews it. */
function recordTtlMs(disconnectGraceMs: unknown, idleTtlMs: unknown): number {
  const grace = typeof disconnectGraceMs === 'number' ? disconnectGraceMs : 30_000
  const idle = typeof idleTtlMs === 'number' ? idleTtlMs : idleTtlMs === null ? 86_400_000 : 300_000
  return grace + idle
}

async function openStore(option: unknown, disconnectGraceMs: unknown, idleTtlMs: unknown): Promise<StoreSettings | null> {
  if (option === undefined) return null
  const ttlMs = recordTtlMs(disconnectGraceMs, idleTtlMs)
  if (typeof option === 'string') {
    try {
      return { store: await RedisSessionStore.connect(option), owned: true, ttlMs }
    } catch (error) {
      if (error instanceof OrtexError) throw error
      throw new OrtexError('INVALID_ARGUMENT', `options.sessionStore: ${(error as Error).message}`)
    }
  }
  const store = option as Partial<SessionStore> | null
  for (const method of ['commit', 'claim', 'end', 'touch', 'quit'] as const) {
    if (typeof store?.[method] !== 'function') {
      throw v.invalidArgumentFor('options.sessionStore', `must be a redis:// URL or a SessionStore (no ${method}())`)
    }
  }
  return { store: option as SessionStore, owned: false, ttlMs }
}
