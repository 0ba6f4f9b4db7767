// Throughput on a real model: ortex against a naive onnxruntime-node loop and onnxruntime-genai,
// at concurrency 1, 4 and 16 with staggered arrivals (throughput.ts; docs/performance.md,
// "Throughput on a real model"), run on the built package (npm run bench runs it).
//
// Build first (npm run build), then from the repository root:
//   npx esbuild bench/throughput/main.ts --bundle --platform=node --format=esm --external:ortex \
//     --external:onnxruntime-node --outfile=bench/out/throughput.mjs \
//     && node bench/out/throughput.mjs [--quick] [--model DIR] [--no-genai] [--no-naive]
// The default model is .cache/models/bench-gqa (made when absent). Prints a table and the goals,
// writes bench/out/throughput.json and the chart: docs/throughput.svg for a full run,
// bench/out/throughput.svg for --quick (or --svg FILE).
import { fileURLToPath } from 'node:url'
import { Engine } from 'ortex'

import { runBenchCommand } from './command'

class UsageError extends Error {}

const argv = process.argv.slice(2)
const root = fileURLToPath(new URL('../../', import.meta.url)) // bench/out/throughput.mjs -> the repository
if (!argv.includes('--out')) argv.push('--out', `${root}bench/out`)
if (!argv.includes('--quick') && !argv.includes('--svg')) argv.push('--svg', `${root}docs/throughput.svg`)

runBenchCommand(argv, { Engine, root, usageError: (message) => new UsageError(message) }).catch((error: unknown) => {
  process.stderr.write(`throughput: ${error instanceof Error ? error.message : String(error)}\n`)
  process.exit(error instanceof UsageError ? 2 : 1)
})
