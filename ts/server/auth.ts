// The API key of startServer / startDuplexServer: one check for the HTTP API's requests and the
// WebSocket upgrades, so that a key set on a server covers everything it serves but the probes.
//
// A key arrives as `Authorization: Bearer KEY`, or, on a WebSocket upgrade (a browser's WebSocket
// cannot set headers), as a subprotocol the client offers beside `ortex`:
//
//   Sec-WebSocket-Protocol: ortex, ortex-api-key.KEY      (client)
//   Sec-WebSocket-Protocol: ortex                         (server: never the key entry)
//
// as the OpenAI Realtime API takes `openai-insecure-api-key.KEY`. Both sides are hashed to 32
// bytes and compared in constant time, so neither the key nor its length leaks through timing.

import { createHash, timingSafeEqual } from 'node:crypto'
import type { IncomingMessage } from 'node:http'

import * as v from '../validate'

/** The subprotocol a duplex client offers (and the server selects). */
export const DUPLEX_SUBPROTOCOL = 'ortex'
/** `ortex-api-key.KEY`: the key as a subprotocol entry, for clients that cannot set headers. */
export const API_KEY_SUBPROTOCOL_PREFIX = 'ortex-api-key.'

function digest(text: string): Buffer {
  return createHash('sha256').update(text, 'utf8').digest()
}

/** A server's key, kept only as its SHA-256. */
export class ApiKey {
  private constructor(private readonly expected: Buffer) {}

  /** options.apiKey checked: absent is null (no key needed); an empty key is INVALID_ARGUMENT,
   *  since it would read as "authentication on" while letting anyone in who sends nothing. */
  static fromOption(name: string, present: Map<string, unknown>): ApiKey | null {
    if (!present.has('apiKey')) return null
    const key = v.string(name, present.get('apiKey'))
    if (key.length === 0) throw v.invalidArgumentFor(name, 'must not be empty')
    return new ApiKey(digest(key))
  }

  private matches(candidate: string): boolean {
    return timingSafeEqual(digest(candidate), this.expected)
  }

  /** `Authorization: Bearer KEY` with this key. */
  inHeader(req: IncomingMessage): boolean {
    const header = req.headers.authorization
    return typeof header === 'string' && header.startsWith('Bearer ') && this.matches(header.slice('Bearer '.length))
  }

  /** A WebSocket upgrade carrying this key, in the header or as an offered subprotocol. Every
   *  offered key entry is compared, so that which one matched does not show in the time taken. */
  inUpgrade(req: IncomingMessage): boolean {
    let found = this.inHeader(req)
    for (const protocol of offeredSubprotocols(req)) {
      if (protocol.startsWith(API_KEY_SUBPROTOCOL_PREFIX) && this.matches(protocol.slice(API_KEY_SUBPROTOCOL_PREFIX.length))) {
        found = true
      }
    }
    return found
  }
}

/** Whether `key` (null: none set) lets `req` into the HTTP API. */
export function authorizedRequest(key: ApiKey | null, req: IncomingMessage): boolean {
  return key === null || key.inHeader(req)
}

function offeredSubprotocols(req: IncomingMessage): string[] {
  const header = req.headers['sec-websocket-protocol']
  if (typeof header !== 'string') return []
  return header.split(',').map((p) => p.trim())
}

/** The subprotocol the server answers with: `ortex` when offered, else the first offered entry
 *  that is not a key; never a key entry, which would echo the key back (into logs, proxies).
 *  false: none (a client that offered only a key entry then fails its own handshake). */
export function selectSubprotocol(offered: Set<string>): string | false {
  if (offered.has(DUPLEX_SUBPROTOCOL)) return DUPLEX_SUBPROTOCOL
  for (const protocol of offered) {
    if (!protocol.startsWith(API_KEY_SUBPROTOCOL_PREFIX)) return protocol
  }
  return false
}
