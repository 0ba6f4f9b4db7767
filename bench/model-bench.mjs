// What the model-folder benchmark scripts (huge-pages.mjs, kv-mapping.mjs, step-overhead.mjs)
// share: their command line (a model folder, then `--name value` options with defaults), the
// prompt they generate from, and the median they report.
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

/** The median; the mean of the middle two for an even count. */
export function median(xs) {
  const s = [...xs].sort((a, b) => a - b)
  return s.length % 2 ? s[s.length >> 1] : (s[s.length / 2 - 1] + s[s.length / 2]) / 2
}
