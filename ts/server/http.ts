// `startServer(engine, options)` and `ortex serve`: one HTTP server on one port for
//   POST /v1/chat/completions, POST /v1/completions, GET /v1/models   the OpenAI-compatible API
//   GET /health, GET /metrics                                           probes and Prometheus
//   WebSocket upgrades                                                  full-duplex sessions (duplex/websocket.ts)
//
// Every request is checked before it reaches the engine: method, path, bearer key (when one is
// set; compared in constant time, auth.ts; WebSocket upgrades need it too), content type, body
// size (bounded while it is read), JSON, and each field (openai/parse.ts). Whatever goes wrong is answered in OpenAI's error shape with a
// 4xx/5xx status; the process never sees it.

import { type IncomingMessage, type Server, type ServerResponse, createServer } from 'node:http'
import type { AddressInfo } from 'node:net'
import path from 'node:path'

import type { Engine } from '../engine'
import * as v from '../validate'
import { ApiKey, authorizedRequest } from './auth'
import { type FlowLimits, flowLimits } from './flow'
import { ServerMetrics } from './metrics'
import { complete } from './openai/complete'
import { ApiError } from './openai/errors'
import { type CompletionJob, checkedTurnOptions, parseChatRequest, parseCompletionRequest } from './openai/parse'
import { DEFAULT_PORT, type DuplexServerOptions, startDuplexServer } from './duplex/start'
import type { DuplexServer } from './duplex/websocket'

export interface ServerOptions {
  /** Default 8787; 0 picks a free port. */
  port?: number
  /** Default '127.0.0.1' (this machine only). */
  host?: string
  /** Requests to /v1/* need `Authorization: Bearer <apiKey>`, and WebSocket upgrades need it too
   *  (as that header or the `ortex-api-key.<apiKey>` subprotocol); default: none needed. */
  apiKey?: string
  /** The model's name in /v1/models and the `model` requests must name; default: the model
   *  folder's name (a GGUF file's, without .gguf), or 'ortex-simulated'. */
  modelName?: string
  /** Largest request body, in bytes (default 1 MiB); a larger one gets 413. */
  maxBodyBytes?: number
  /** Tokens a chat completion generates when it sets no max_tokens (default: until the session
   *  limit). /v1/completions defaults to 16, as OpenAI's. */
  defaultMaxTokens?: number
  /** Most bytes a streamed response may have waiting to be sent (default 1 MiB); above it the
   *  server stops writing the stream until the client has read what waits. */
  maxBufferedBytes?: number
  /** A streamed response whose client stays above maxBufferedBytes this long is dropped and its
   *  turn cancelled (default 30000 ms). */
  sendStallMs?: number
  /** The WebSocket sessions on the same port (docs/duplex-protocol.md); port, host and apiKey are
   *  this server's. */
  duplex?: Omit<DuplexServerOptions, 'port' | 'host'>
}

const DEFAULT_MAX_BODY_BYTES = 1 << 20

interface Settings {
  modelName: string
  apiKey: ApiKey | null
  maxBodyBytes: number
  defaultMaxTokens: number | undefined
  flow: FlowLimits
}

/** A started server: the HTTP API, /metrics and the WebSocket sessions on one port. */
export class OrtexServer {
  readonly host: string
  readonly port: number
  readonly modelName: string
  readonly metrics: ServerMetrics
  private closing: Promise<void> | null = null
  /** close() during a drain: stop waiting for what runs. */
  private stopNow = false

  /** @internal */
  constructor(
    private readonly http: Server,
    private readonly handler: ApiHandler,
    readonly duplex: DuplexServer,
    metrics: ServerMetrics,
    modelName: string,
  ) {
    const address = http.address() as AddressInfo
    this.host = address.address
    this.port = address.port
    this.metrics = metrics
    this.modelName = modelName
  }

  /** http://host:port, the base of the API (`${url}/v1`). */
  get url(): string {
    const host = this.host.includes(':') ? `[${this.host}]` : this.host
    return `http://${host}:${this.port}`
  }

  /** Whether drain() has begun. */
  get draining(): boolean {
    return this.handler.draining
  }

  /**
   * A graceful stop (SIGTERM in `ortex serve`): from now on /health answers 503 "draining", new
   * /v1 requests and WebSocket upgrades are refused with 503, and the port stops accepting
   * connections. Requests and duplex responses in flight run to their end, for at most
   * `deadlineMs` (the port keeps answering meanwhile, so that probes see "draining"); then every duplex session is detached with a resumable close (WebSocket close
   * code 1012, "service restart": its client resumes through the balancer, on another process
   * when a session store holds the session) and close() runs, which cancels whatever still runs.
   */
  drain(deadlineMs = DEFAULT_DRAIN_DEADLINE_MS): Promise<void> {
    if (this.closing !== null) return this.closing
    v.integer('deadlineMs', deadlineMs, 0, Number.MAX_SAFE_INTEGER)
    this.handler.draining = true
    // The port stays open until the end: probes and a balancer's retries must see the 503s.
    this.duplex.stopAccepting()
    this.closing = (async () => {
      const until = Date.now() + deadlineMs
      while (!this.stopNow && Date.now() < until && (this.handler.inFlight > 0 || this.duplex.responding())) {
        await new Promise((resolve) => setTimeout(resolve, DRAIN_POLL_MS))
      }
      await this.duplex.detachAll()
      await this.shutDown()
    })()
    return this.closing
  }

  /** Stops accepting, closes every session and connection; turns in progress are cancelled. The
   *  engine stays the caller's. During a drain, it ends the drain's wait at once. */
  close(): Promise<void> {
    this.stopNow = true
    if (this.closing !== null) return this.closing
    this.closing = this.shutDown()
    return this.closing
  }

  private async shutDown(): Promise<void> {
    await this.duplex.close()
    await new Promise<void>((resolve) => {
      this.http.close(() => resolve())
      this.http.closeAllConnections()
    })
  }
}

/** How long drain() lets requests and responses in flight run by default. */
export const DEFAULT_DRAIN_DEADLINE_MS = 30_000
/** How often drain() looks whether what was in flight has ended. */
const DRAIN_POLL_MS = 20

function sendJson(res: ServerResponse, status: number, body: unknown, headers: Record<string, string> = {}): void {
  const text = JSON.stringify(body)
  res.writeHead(status, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(text), ...headers })
  res.end(text)
}

/** The body as text, refusing more than `maxBytes` as it arrives (413) and ending early. */
function readBody(req: IncomingMessage, maxBytes: number): Promise<string> {
  return new Promise<string>((resolve, reject) => {
    const declared = Number(req.headers['content-length'])
    if (Number.isFinite(declared) && declared > maxBytes) {
      reject(new ApiError(413, `the request body is larger than ${maxBytes} bytes`, 'invalid_request_error', null, 'body_too_large'))
      req.resume()
      return
    }
    const chunks: Buffer[] = []
    let size = 0
    req.on('data', (chunk: Buffer) => {
      size += chunk.length
      if (size > maxBytes) {
        reject(new ApiError(413, `the request body is larger than ${maxBytes} bytes`, 'invalid_request_error', null, 'body_too_large'))
        req.removeAllListeners('data')
        req.resume()
        return
      }
      chunks.push(chunk)
    })
    let ended = false
    req.on('end', () => {
      ended = true
      resolve(Buffer.concat(chunks).toString('utf8'))
    })
    req.on('error', reject)
    // A client that goes away mid-body: nothing more will come.
    req.on('close', () => {
      if (!ended) reject(new ApiError(400, 'the client closed the connection before the body ended', 'invalid_request_error', null, 'incomplete_body'))
    })
  })
}

function parseJson(text: string): unknown {
  try {
    return JSON.parse(text)
  } catch (error) {
    throw new ApiError(400, `the request body is not valid JSON: ${(error as Error).message}`, 'invalid_request_error', null, 'invalid_json')
  }
}

function isJson(req: IncomingMessage): boolean {
  const type = req.headers['content-type']
  return typeof type === 'string' && type.split(';')[0]!.trim().toLowerCase() === 'application/json'
}

/**
 * A 429 (the engine holds its most requests) says when to retry: in 1 s. A slot frees as soon as
 * any running turn ends, which the server cannot predict; 1 s is the smallest whole-second hint,
 * and OpenAI's clients honour it (then back off on their own if the retry is refused again).
 */
const RETRY_AFTER_S = 1

function errorHeaders(error: ApiError): Record<string, string> {
  if (error.status === 401) return { 'www-authenticate': 'Bearer' }
  if (error.status === 429 || error.status === 503) return { 'retry-after': String(RETRY_AFTER_S) }
  return {}
}

const ROUTES: Record<string, { method: 'GET' | 'POST'; v1: boolean }> = {
  '/v1/chat/completions': { method: 'POST', v1: true },
  '/v1/completions': { method: 'POST', v1: true },
  '/v1/models': { method: 'GET', v1: true },
  '/health': { method: 'GET', v1: false },
  '/metrics': { method: 'GET', v1: false },
}

class ApiHandler {
  /** drain() began: health says so and new /v1 requests are refused. */
  draining = false
  /** Requests being answered (a drain waits for them). */
  inFlight = 0

  constructor(
    private readonly engine: Engine,
    private readonly settings: Settings,
    private readonly metrics: ServerMetrics,
  ) {}

  handle(req: IncomingMessage, res: ServerResponse): void {
    const receivedAtMs = Date.now()
    const pathname = (req.url ?? '/').split('?')[0]!
    const route = ROUTES[pathname]
    const label = route === undefined ? 'unknown' : pathname
    this.inFlight++
    this.route(req, res, pathname, receivedAtMs).then(
      (status) => {
        this.inFlight--
        this.metrics.requests.inc({ route: label, status: String(status) })
      },
      (error: unknown) => {
        this.inFlight--
        const apiError = error instanceof ApiError ? error : new ApiError(500, 'internal error', 'server_error')
        this.metrics.requests.inc({ route: label, status: String(apiError.status) })
        if (res.headersSent) {
          res.destroy()
          return
        }
        sendJson(res, apiError.status, apiError.body(), errorHeaders(apiError))
      },
    )
  }

  private async route(req: IncomingMessage, res: ServerResponse, pathname: string, receivedAtMs: number): Promise<number> {
    const route = ROUTES[pathname]
    if (route === undefined) throw new ApiError(404, `no route ${pathname}`, 'not_found_error', null, 'unknown_url')
    if (req.method !== route.method) {
      res.setHeader('allow', route.method)
      throw new ApiError(405, `${pathname} takes ${route.method}, not ${req.method}`, 'invalid_request_error', null, 'method_not_allowed')
    }
    if (route.v1 && !authorizedRequest(this.settings.apiKey, req)) {
      throw new ApiError(401, 'a valid API key is needed: Authorization: Bearer <key>', 'authentication_error', null, 'invalid_api_key')
    }
    if (route.v1 && this.draining) {
      // The connection closes after the answer: a balancer sends the retry to another process.
      res.setHeader('connection', 'close')
      req.resume()
      throw new ApiError(503, 'this server is draining; retry on another', 'server_error', null, 'server_draining')
    }
    switch (pathname) {
      case '/health':
        return this.health(res)
      case '/metrics':
        res.writeHead(200, { 'content-type': this.metrics.contentType })
        res.end(await this.metrics.text())
        return 200
      case '/v1/models':
        sendJson(res, 200, { object: 'list', data: [this.model()] })
        return 200
    }
    const job = await this.job(req, pathname)
    const tracker = this.metrics.track(receivedAtMs)
    const { modelName, defaultMaxTokens, flow } = this.settings
    const context = { engine: this.engine, modelName, defaultMaxTokens, flow, tracker }
    return complete(context, job, res)
  }

  private health(res: ServerResponse): number {
    if (this.draining) {
      sendJson(res, 503, { status: 'draining', reason: 'the server is draining: it takes no new work' })
      return 503
    }
    if (this.engine.healthy) {
      sendJson(res, 200, { status: 'ok' })
      return 200
    }
    const failure = this.engine.failureCode
    const reason = failure === null ? 'the engine is closed' : `the engine failed (${failure})`
    sendJson(res, 503, { status: 'unavailable', reason })
    return 503
  }

  private model(): object {
    return { id: this.settings.modelName, object: 'model', created: 0, owned_by: 'ortex' }
  }

  private async job(req: IncomingMessage, pathname: string): Promise<CompletionJob> {
    if (!isJson(req)) {
      req.resume()
      throw new ApiError(415, 'the request body must be JSON (Content-Type: application/json)', 'invalid_request_error', null, 'unsupported_media_type')
    }
    const body = parseJson(await readBody(req, this.settings.maxBodyBytes))
    const job = pathname === '/v1/chat/completions' ? parseChatRequest(body) : parseCompletionRequest(body)
    if (job.model !== this.settings.modelName) {
      throw new ApiError(404, `The model \`${job.model}\` does not exist; this server serves \`${this.settings.modelName}\``, 'invalid_request_error', 'model', 'model_not_found')
    }
    checkedTurnOptions(job, (options) => this.engine._validateTurnOptions(options))
    return job
  }
}

function defaultModelName(engine: Engine): string {
  return engine.modelPath === null ? 'ortex-simulated' : path.basename(path.resolve(engine.modelPath)).replace(/\.gguf$/i, '')
}

/** The duplex options with the server's key: a WebSocket upgrade is refused without it, as a /v1
 *  request is. Anything but an object passes as it is, for startDuplexServer to refuse. */
function withApiKey(options: DuplexServerOptions | undefined, apiKey: unknown): DuplexServerOptions | undefined {
  if (options !== undefined && (typeof options !== 'object' || options === null)) return options
  return { ...options, apiKey: apiKey as string | undefined }
}

/** Starts the server over `engine` (driven: it calls engine.start()). */
export async function startServer(engine: Engine, options?: ServerOptions): Promise<OrtexServer> {
  const present = v.options('options', options, [
    'port',
    'host',
    'apiKey',
    'modelName',
    'maxBodyBytes',
    'defaultMaxTokens',
    'maxBufferedBytes',
    'sendStallMs',
    'duplex',
  ])
  const port = present.has('port') ? v.integer('options.port', present.get('port'), 0, 65_535) : DEFAULT_PORT
  const host = present.has('host') ? v.string('options.host', present.get('host')) : '127.0.0.1'
  const apiKey = ApiKey.fromOption('options.apiKey', present)
  const settings: Settings = {
    modelName: present.has('modelName') ? v.string('options.modelName', present.get('modelName')) : defaultModelName(engine),
    apiKey,
    maxBodyBytes: present.has('maxBodyBytes') ? v.integer('options.maxBodyBytes', present.get('maxBodyBytes'), 64, 1 << 30) : DEFAULT_MAX_BODY_BYTES,
    defaultMaxTokens: present.has('defaultMaxTokens') ? v.integer('options.defaultMaxTokens', present.get('defaultMaxTokens'), 1) : undefined,
    flow: flowLimits(present),
  }
  if (settings.modelName.length === 0) throw v.invalidArgumentFor('options.modelName', 'must not be empty')
  const duplexOptions = present.get('duplex') as DuplexServerOptions | undefined
  for (const key of ['port', 'host', 'apiKey']) {
    if (duplexOptions !== undefined && (duplexOptions as Record<string, unknown>)[key] !== undefined) {
      throw v.invalidArgumentFor(`options.duplex.${key}`, `is the server's own (options.${key})`)
    }
  }
  const metrics = new ServerMetrics(engine)
  const handler = new ApiHandler(engine, settings, metrics)
  const http = createServer((req, res) => handler.handle(req, res))
  await new Promise<void>((resolve, reject) => {
    http.once('error', reject)
    http.listen(port, host, () => {
      http.off('error', reject)
      resolve()
    })
  })
  try {
    const duplex = await startDuplexServer(engine, withApiKey(duplexOptions, present.get('apiKey')), http)
    return new OrtexServer(http, handler, duplex, metrics, settings.modelName)
  } catch (error) {
    http.close()
    throw error
  }
}
