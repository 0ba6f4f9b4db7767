// What the model-folder benchmark scripts (huge-pages.mjs, kv-mapping.mjs, load-memory.mjs,
// step-overhead.mjs) share: their command line (a model folder, then `--name value` options with
// defaults), the prompt they generate from, the median and MiB they report, and where their JSON
// reports go.
import { mkdirSync, writeFileSync } from 'node:fs'
import { parseArgs } from 'node:util'

export const PROMPT = 'The river starts as a thin line of water high in the hills. In the morning the air is cold and'

/**
 * `node bench/SCRIPT MODEL_DIR [--name value ...]`: the folder and the option values (strings,
 * `defaults` where absent). Without a folder, prints the usage (a numeric default reads as N) and
 * exits with status 2.
 */
export function parseModelArgs(script, defaults) {
  const options = Object.fromEntries(Object.entries(defaults).map(([name, value]) => [name, { type: 'string', default: value }]))
  const { values, positionals } = parseArgs({ allowPositionals: true, options })
  const dir = positionals[0]
  if (!dir) {
    const flags = Object.entries(defaults).map(([name, value]) => `[--${name} ${/^\d+$/.test(value) ? 'N' : value}]`)
    console.error(`usage: node bench/${script} MODEL_DIR ${flags.join(' ')}`)
    process.exit(2)
  }
  return { dir, values }
}

/** `bytes` in whole MiB, as text. */
export function mib(bytes) {
  return (bytes / 2 ** 20).toFixed(0)
}

/** Writes `report` as JSON to bench/out/`file` (beside this script, whatever the working directory). */
export function writeReport(file, report) {
  const out = new URL('./out/', import.meta.url)
  mkdirSync(out, { recursive: true })
  writeFileSync(new URL(file, out), `${JSON.stringify(report, null, 2)}\n`)
}

/** The median; the mean of the middle two for an even count. */
export function median(xs) {
  const s = [...xs].sort((a, b) => a - b)
  return s.length % 2 ? s[s.length >> 1] : (s[s.length / 2 - 1] + s[s.length / 2]) / 2
}
