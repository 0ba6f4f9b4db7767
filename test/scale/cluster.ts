// A cluster on loopback for the scale suite: redis-server, three `ortex serve` processes with the
// session store, and nginx with the configuration of docs/scaling.md, read from that file with
// only its four addresses changed. Every process runs in a group of its own (processes.ts): a
// stop ends nginx as it is meant to end (SIGQUIT to its master, which lets its workers finish),
// and kills the other groups whole.
import { mkdirSync, readFileSync, writeFileSync } from 'node:fs'
import path from 'node:path'
import { type ChildProcess, spawnSync } from 'node:child_process'
import {
  type DelayProxy,
  type RedisProcess,
  type ServeProcess,
  freePort,
  killGroup,
  sleep,
  spawnGroup,
  startDelayProxy,
  startRedis,
  startServe,
  within,
} from './processes'

const DOCUMENTED_BACKENDS = ['127.0.0.1:8787', '127.0.0.1:8788', '127.0.0.1:8789']
const DOCUMENTED_LISTEN = '127.0.0.1:8080'

/** The nginx block of docs/scaling.md, between its markers. */
export function documentedNginxConfig(): string {
  const doc = readFileSync(path.resolve(__dirname, '../../docs/scaling.md'), 'utf8')
  const match = /<!-- nginx-config: begin -->\s*```nginx\n([\s\S]*?)```\s*<!-- nginx-config: end -->/.exec(doc)
  if (match === null) throw new Error('docs/scaling.md has no nginx-config block')
  return match[1]!
}

/** Fails with what to run when redis-server or nginx is missing. */
export function requireTools(): void {
  for (const tool of ['redis-server', 'nginx']) {
    if (spawnSync('sh', ['-c', `command -v ${tool}`]).status !== 0) {
      throw new Error(`${tool} is missing: run \`npm run test:scale\` (scripts/test-scale.sh installs it) or apt-get install nginx-light redis-server`)
    }
  }
}

export interface ClusterOptions {
  /** Start nginx in front (default true). */
  nginx?: boolean
  /** Keep Redis's data in an append-only file, so that a restart loses nothing (default: memory only). */
  durableRedis?: boolean
  /** The processes reach Redis through a proxy that holds each way this long (default: directly). */
  storeDelayMs?: number
}

export class Cluster {
  readonly backends: (ServeProcess | null)[]
  private nginx: ChildProcess | null = null
  private proxy: DelayProxy | null = null
  redis: RedisProcess | null = null

  private constructor(
    readonly dir: string,
    readonly ports: number[],
    readonly nginxPort: number,
    private readonly serveArgs: string[],
    private readonly options: ClusterOptions,
  ) {
    this.backends = ports.map(() => null)
  }

  /** Starts redis-server, three `ortex serve ARGS --session-store ...` and nginx. What started
   *  is stopped again when a later part fails. */
  static async start(dir: string, serveArgs: string[], options: ClusterOptions = {}): Promise<Cluster> {
    requireTools()
    mkdirSync(dir, { recursive: true })
    const ports = [await freePort(), await freePort(), await freePort()]
    const cluster = new Cluster(dir, ports, await freePort(), serveArgs, options)
    try {
      cluster.redis = await startRedis(await freePort(), cluster.redisDir)
      if (options.storeDelayMs !== undefined) cluster.proxy = await startDelayProxy(cluster.redis.port, options.storeDelayMs)
      await Promise.all(ports.map((_, i) => cluster.startBackend(i)))
      if (options.nginx !== false) await cluster.startNginx()
    } catch (error) {
      await cluster.stop()
      throw error
    }
    return cluster
  }

  private get redisDir(): string | undefined {
    return this.options.durableRedis === true ? this.dir : undefined
  }

  /** The store's URL as the processes are given it (through the proxy, when there is one). */
  get storeUrl(): string {
    return this.proxy === null ? this.redis!.url : `redis://127.0.0.1:${this.proxy.port}`
  }

  get url(): string {
    return `http://127.0.0.1:${this.nginxPort}`
  }

  get wsUrl(): string {
    return `ws://127.0.0.1:${this.nginxPort}`
  }

  async startBackend(i: number): Promise<ServeProcess> {
    const args = [...this.serveArgs, '--port', String(this.ports[i]), '--session-store', this.storeUrl]
    const backend = await startServe(args)
    this.backends[i] = backend
    return backend
  }

  /** SIGKILL: the process is gone at once, with whatever it held. */
  async kill(i: number): Promise<void> {
    const backend = this.backends[i]!
    this.backends[i] = null
    await killGroup(backend.child)
  }

  /** Starts redis-server again on its port (and its data folder, when it has one). */
  async restartRedis(): Promise<void> {
    this.redis = await startRedis(this.redis!.port, this.redisDir)
  }

  /** Stops everything: nginx gracefully (its workers end with it), the rest by SIGKILL to their
   *  groups. Each part is stopped even when another fails to. */
  async stop(): Promise<void> {
    const parts: Promise<void>[] = this.backends.map((backend) => (backend === null ? Promise.resolve() : killGroup(backend.child)))
    this.backends.fill(null)
    if (this.nginx !== null) parts.push(stopNginx(this.nginx))
    if (this.redis !== null) parts.push(this.redis.stop())
    if (this.proxy !== null) parts.push(this.proxy.close())
    const failed = (await Promise.allSettled(parts)).find((outcome) => outcome.status === 'rejected')
    if (failed !== undefined) throw (failed as PromiseRejectedResult).reason
  }

  private async startNginx(): Promise<void> {
    let block = documentedNginxConfig()
    DOCUMENTED_BACKENDS.forEach((address, i) => {
      block = block.replaceAll(address, `127.0.0.1:${this.ports[i]}`)
    })
    block = block.replace(`listen ${DOCUMENTED_LISTEN};`, `listen 127.0.0.1:${this.nginxPort};`)
    const conf = path.join(this.dir, 'nginx.conf')
    const temp = (name: string): string => `${name}_temp_path ${path.join(this.dir, name)};`
    writeFileSync(
      conf,
      [
        'daemon off;',
        'worker_processes 1;',
        `pid ${path.join(this.dir, 'nginx.pid')};`,
        `error_log ${path.join(this.dir, 'error.log')} warn;`,
        'events { worker_connections 1024; }',
        'http {',
        '  access_log off;',
        `  ${temp('client_body')} ${temp('proxy')} ${temp('fastcgi')} ${temp('uwsgi')} ${temp('scgi')}`,
        block,
        '}',
        '',
      ].join('\n'),
    )
    const nginx = spawnGroup('nginx', ['-p', this.dir, '-c', conf], { stdio: ['ignore', 'ignore', 'pipe'] })
    let stderr = ''
    nginx.stderr!.on('data', (chunk: Buffer) => (stderr += chunk.toString()))
    this.nginx = nginx
    await within(10_000, 'nginx to listen', async () => {
      for (;;) {
        if (nginx.exitCode !== null) throw new Error(`nginx exited: ${stderr}`)
        try {
          await fetch(`${this.url}/v1/models`)
          return
        } catch {
          await sleep(20)
        }
      }
    })
  }
}

/** How long nginx's master may take to end after SIGQUIT (its workers finish their connections). */
const NGINX_QUIT_MS = 10_000

/**
 * Stops nginx as it is meant to stop: SIGQUIT to the master, which tells its workers to finish
 * and exits after them; then waits. A master that does not end in time is killed with its whole
 * group, and the stop fails: the suite must not pass while nginx does not stop.
 */
async function stopNginx(nginx: ChildProcess): Promise<void> {
  if (nginx.exitCode !== null || nginx.signalCode !== null) return
  const exited = new Promise<boolean>((resolve) => nginx.once('exit', () => resolve(true)))
  nginx.kill('SIGQUIT')
  if (await Promise.race([exited, sleep(NGINX_QUIT_MS).then(() => false)])) return
  await killGroup(nginx)
  throw new Error(`nginx did not end within ${NGINX_QUIT_MS} ms of SIGQUIT; its group was killed`)
}
