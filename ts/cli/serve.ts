// `ortex serve`: the OpenAI-compatible HTTP API, /metrics and the WebSocket sessions of
// docs/duplex-protocol.md, on one port, over a model folder or the simulated model, until
// SIGINT / SIGTERM, which drain it (see drain() in ../server/http.ts).

import { parseArgs } from 'node:util'

import { DEFAULT_DRAIN_DEADLINE_MS, startServer } from '../server/http'
import { DEFAULT_PORT } from '../server/duplex/start'
import { ENGINE_FLAGS, ggufFlagsHelp, UsageError, engineChoice, integerFlag, openEngine } from './args'

export const SERVE_HELP = `Usage: ortex serve (--model DIR|FILE.gguf | --simulated) [options]

Serves, on one port: the OpenAI-compatible API (POST /v1/chat/completions, POST /v1/completions,
GET /v1/models), GET /health, GET /metrics (Prometheus), and full-duplex sessions over WebSocket
(protocol: docs/duplex-protocol.md).

Options:
  --model DIR|FILE.gguf    an ONNX model folder (genai_config.json, model.onnx, tokenizer.json),
                           or a GGUF file: imported into the cache on its first use (progress
                           on stderr) and that import reused after
  --simulated              the deterministic simulated model
  --port N                 TCP port (default ${DEFAULT_PORT}; 0 picks a free one)
  --host ADDR              address to listen on (default 127.0.0.1)
  --max-sessions N         sessions at once (default unlimited)
  --disconnect-grace-ms N  how long a dropped session waits for a resume (default 30000)
  --idle-ttl-ms N          idle sessions expire after this (default 300000; 0 disables)
  --max-output-tokens N    tokens per response unless a client asks otherwise (default 256)
  --api-key KEY            /v1 requests and WebSocket sessions need the key (default: none):
                           'Authorization: Bearer KEY' (sessions may offer the subprotocol
                           'ortex-api-key.KEY' instead); also read from ORTEX_API_KEY.
                           An empty key is refused
  --model-name NAME        the model's name in /v1/models (default: the folder's name, a GGUF
                           file's without .gguf, or 'ortex-simulated')
  --seed N                 the simulated model's seed (default 0)
  --backend NAME           'native' (default) or 'wasm' (simulated model only)
  --kv-cache-bytes N       most bytes the model's KV pool may reserve (default: a quarter of the
                           machine's memory); the load line on stderr says what it reserves
${ggufFlagsHelp(27)}  --session-store URL      keep each session's state in Redis (redis://HOST:PORT), so that a
                           session.resume reaching another process takes the session over when
                           this one is gone (docs/scaling.md); needs the ioredis package
  --drain-timeout-ms N     on SIGTERM / SIGINT, how long requests and responses in flight may
                           run before the server stops (default ${DEFAULT_DRAIN_DEADLINE_MS}); a second signal
                           stops it at once
  -h, --help               show this help

SIGTERM (or SIGINT) drains the server: /health answers 503 "draining", new requests and sessions
are refused with 503, what runs finishes (up to --drain-timeout-ms), each session's connection is
closed with code 1012 so that its client resumes elsewhere, and the process exits with status 0.
`

/** Resolves on the first SIGINT or SIGTERM; a second one calls `again`. */
function untilSignal(again: () => void): Promise<void> {
  return new Promise<void>((resolve) => {
    const first = (): void => {
      process.off('SIGINT', first)
      process.off('SIGTERM', first)
      process.on('SIGINT', again)
      process.on('SIGTERM', again)
      resolve()
    }
    process.on('SIGINT', first)
    process.on('SIGTERM', first)
  })
}

/** --api-key, else ORTEX_API_KEY, else none. An empty one is a usage error: it would read as
 *  "authentication on" while the server let everyone in. */
function apiKeyOf(flag: string | undefined, env: string | undefined): string | undefined {
  if (flag !== undefined) {
    if (flag.length === 0) throw new UsageError('--api-key must not be empty')
    return flag
  }
  if (env !== undefined && env.length === 0) throw new UsageError('ORTEX_API_KEY is set but empty; unset it or give a key')
  return env
}

/** `ortex serve ...`: runs until SIGINT / SIGTERM. */
export async function runServeCommand(argv: string[]): Promise<void> {
  const { values } = parseArgs({
    args: argv,
    strict: true,
    allowPositionals: false,
    options: {
      ...ENGINE_FLAGS,
      port: { type: 'string' },
      host: { type: 'string' },
      'max-sessions': { type: 'string' },
      'disconnect-grace-ms': { type: 'string' },
      'idle-ttl-ms': { type: 'string' },
      'max-output-tokens': { type: 'string' },
      'api-key': { type: 'string' },
      'model-name': { type: 'string' },
      'drain-timeout-ms': { type: 'string' },
      'session-store': { type: 'string' },
      help: { type: 'boolean', short: 'h' },
    },
  })
  if (values.help) {
    process.stdout.write(SERVE_HELP)
    return
  }
  const choice = engineChoice(values)
  const port = integerFlag('port', values.port, DEFAULT_PORT, 0, 65_535)
  const maxSessions = integerFlag('max-sessions', values['max-sessions'], undefined, 1, 1 << 20)
  const disconnectGraceMs = integerFlag('disconnect-grace-ms', values['disconnect-grace-ms'], undefined, 1, Number.MAX_SAFE_INTEGER)
  const idleTtl = integerFlag('idle-ttl-ms', values['idle-ttl-ms'], undefined, 0, Number.MAX_SAFE_INTEGER)
  const maxOutputTokens = integerFlag('max-output-tokens', values['max-output-tokens'], 256, 1, 1 << 24)
  const drainTimeoutMs = integerFlag('drain-timeout-ms', values['drain-timeout-ms'], DEFAULT_DRAIN_DEADLINE_MS, 0, Number.MAX_SAFE_INTEGER)
  const apiKey = apiKeyOf(values['api-key'], process.env.ORTEX_API_KEY)
  const engine = await openEngine(choice, {}, { eosProbability: 0.02, maxBatchSize: 64 })
  const server = await startServer(engine, {
    port,
    host: values.host ?? '127.0.0.1',
    apiKey,
    modelName: values['model-name'],
    defaultMaxTokens: maxOutputTokens,
    duplex: {
      maxSessions,
      disconnectGraceMs,
      idleTtlMs: idleTtl === undefined ? undefined : idleTtl === 0 ? null : idleTtl,
      turn: { maxGeneratedTokens: maxOutputTokens },
      ...(values['session-store'] === undefined ? {} : { sessionStore: values['session-store'] }),
    },
  }).catch(async (error: unknown) => {
    await engine.close()
    throw error
  })
  const model = choice.model === undefined ? `simulated model, ${engine.backend}` : choice.model
  const ws = server.url.replace('http://', 'ws://')
  process.stdout.write(`ortex serve: listening on ${server.url} (${model}): OpenAI API at ${server.url}/v1, sessions at ${ws}\n`)
  await untilSignal(() => {
    process.stdout.write('ortex serve: stopping now\n')
    void server.close()
  })
  process.stdout.write(`ortex serve: draining (at most ${drainTimeoutMs} ms)\n`)
  await server.drain(drainTimeoutMs)
  process.stdout.write('ortex serve: shutting down\n')
  await engine.close()
}
