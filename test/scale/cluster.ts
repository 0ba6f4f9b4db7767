// A cluster on loopback for the scale suite: redis-server, three `ortex serve` processes with the
// session store, and nginx with the configuration of docs/scaling.md, read from that file with
// only its four addresses changed.
import { mkdirSync, readFileSync, writeFileSync } from 'node:fs'
import path from 'node:path'
import { type ChildProcess, spawn, spawnSync } from 'node:child_process'
import { type RedisProcess, type ServeProcess, freePort, sleep, startRedis, startServe, within } from './processes'

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

export class Cluster {
  readonly backends: (ServeProcess | null)[]
  private nginx: ChildProcess | null = null

  private constructor(
    readonly dir: string,
    public redis: RedisProcess,
    readonly ports: number[],
    readonly nginxPort: number,
    private readonly serveArgs: string[],
  ) {
    this.backends = ports.map(() => null)
  }

  /** Starts redis-server, three `ortex serve ARGS --session-store ...` and nginx. */
  static async start(dir: string, serveArgs: string[]): Promise<Cluster> {
    requireTools()
    mkdirSync(dir, { recursive: true })
    const redis = await startRedis(await freePort())
    const ports = [await freePort(), await freePort(), await freePort()]
    const cluster = new Cluster(dir, redis, ports, await freePort(), serveArgs)
    await Promise.all(ports.map((_, i) => cluster.startBackend(i)))
    await cluster.startNginx()
    return cluster
  }

  get url(): string {
    return `http://127.0.0.1:${this.nginxPort}`
  }

  get wsUrl(): string {
    return `ws://127.0.0.1:${this.nginxPort}`
  }

  async startBackend(i: number): Promise<ServeProcess> {
    const args = [...this.serveArgs, '--port', String(this.ports[i]), '--session-store', this.redis.url]
    const backend = await startServe(args)
    this.backends[i] = backend
    return backend
  }

  /** SIGKILL: the process is gone at once, with whatever it held. */
  async kill(i: number): Promise<void> {
    const backend = this.backends[i]!
    backend.child.kill('SIGKILL')
    await backend.exited
    this.backends[i] = null
  }

  async restartRedis(): Promise<void> {
    this.redis = await startRedis(this.redis.port)
  }

  async stop(): Promise<void> {
    for (const backend of this.backends) if (backend !== null && backend.child.exitCode === null) backend.child.kill('SIGKILL')
    if (this.nginx !== null && this.nginx.exitCode === null) this.nginx.kill('SIGKILL')
    await this.redis.stop()
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
    const nginx = spawn('nginx', ['-p', this.dir, '-c', conf], { stdio: ['ignore', 'ignore', 'pipe'] })
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
