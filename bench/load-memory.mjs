// What loading a model folder leaves resident: one engine in this process, then the process's
// resident memory (VmRSS), its peak (VmHWM), and how much of the model went on huge pages and into
// weight chunks (crates/ortex-ort/src/huge_pages.rs, weight_chunks.rs). Run it once per setting,
// e.g. with ORTEX_WEIGHT_CHUNKS=0 for the comparison. See docs/performance.md.
//
//   node bench/load-memory.mjs .cache/models/bench-gqa [--threads 2]
import { readFileSync } from 'node:fs'
import { Engine } from '../dist/index.mjs'
import { mib, parseModelArgs } from './model-bench.mjs'

const { dir, values } = parseModelArgs('load-memory.mjs', { threads: '2' })

/** VmRSS and VmHWM in MB. */
function residentMb() {
  const status = readFileSync('/proc/self/status', 'utf8')
  const kb = (name) => Number(new RegExp(`^${name}:\\s+(\\d+) kB`, 'm').exec(status)[1])
  return { rss: Math.round(kb('VmRSS') / 1024), peak: Math.round(kb('VmHWM') / 1024) }
}

const before = residentMb()
const engine = await Engine.load(dir, { intraOpThreads: Number(values.threads) })
const after = residentMb()
const stats = engine.executorStats()
console.log(
  `resident ${before.rss} -> ${after.rss} MB (peak ${after.peak} MB); huge pages ${mib(stats.hugePageBytes)} MiB, ` +
    `weight chunks ${mib(stats.weightChunkBytes)} MiB` +
    (process.env.ORTEX_WEIGHT_CHUNKS === '0' ? ' (ORTEX_WEIGHT_CHUNKS=0)' : ''),
)
await engine.close()
