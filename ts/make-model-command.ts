// `ortex make-model`: writes a deterministic random-weight model folder (ts/model/make-model.ts,
// docs/model-format.md) with a progress bar on stderr. The generator is imported only when the
// command runs, so the other commands never load it.

import { parseArgs } from 'node:util'

export const MAKE_MODEL_HELP = `Usage: ortex make-model --out DIR [--size tiny|bench] [--attention mha|gqa] [--seed N]

Writes a deterministic random-weight Llama-style model folder (genai_config.json, model.onnx,
model.onnx.data, tokenizer.json) that ortex and onnxruntime-genai load. The same size, attention
and seed always give the same bytes.

Options:
  --out DIR            the folder to write (created if missing; our files in it are overwritten)
  --size NAME          'tiny' (default: 0.16M parameters, under 1 MB, for tests) or 'bench'
                       (62M parameters, 250 MB, for benchmarks)
  --attention NAME     'gqa' (default: com.microsoft.GroupQueryAttention, as onnxruntime-genai's
                       builder emits for CPU) or 'mha' (plain ONNX operators)
  --seed N             the weights' seed, an integer in [0, 4294967295] (default 0)
  -h, --help           show this help
`

export interface MakeModelCommandHooks {
  usageError: (message: string) => Error
}

function oneOf<T extends string>(name: string, value: string | undefined, choices: readonly T[], hooks: MakeModelCommandHooks): T | undefined {
  if (value === undefined) return undefined
  if (!(choices as readonly string[]).includes(value)) {
    throw hooks.usageError(`--${name} must be ${choices.map((c) => `'${c}'`).join(' or ')}, got ${JSON.stringify(value)}`)
  }
  return value as T
}

/** A one-line bar redrawn on a terminal; elsewhere nothing until the summary. */
function progressBar(): { update: (done: number, total: number) => void; end: () => void } {
  const live = process.stderr.isTTY === true
  let last = -1
  return {
    update(done, total) {
      if (!live || total <= 0) return
      const fraction = Math.min(1, done / total)
      const percent = Math.floor(fraction * 100)
      if (percent === last) return
      last = percent
      const width = 30
      const filled = Math.round(fraction * width)
      const mb = (n: number) => (n / 1e6).toFixed(1)
      process.stderr.write(
        `\r\x1b[2Kweights [${'#'.repeat(filled)}${' '.repeat(width - filled)}] ${String(percent).padStart(3)}% ` +
          `${mb(done)}/${mb(total)} MB`,
      )
    },
    end() {
      if (live && last >= 0) process.stderr.write('\r\x1b[2K')
    },
  }
}

export async function runMakeModelCommand(argv: string[], hooks: MakeModelCommandHooks): Promise<void> {
  const { values } = parseArgs({
    args: argv,
    strict: true,
    allowPositionals: false,
    options: {
      out: { type: 'string' },
      size: { type: 'string' },
      attention: { type: 'string' },
      seed: { type: 'string' },
      help: { type: 'boolean', short: 'h' },
    },
  })
  if (values.help) {
    process.stdout.write(MAKE_MODEL_HELP)
    return
  }
  if (values.out === undefined || values.out === '') throw hooks.usageError('give --out DIR')
  const size = oneOf('size', values.size, ['tiny', 'bench'] as const, hooks)
  const attention = oneOf('attention', values.attention, ['mha', 'gqa'] as const, hooks)
  let seed: number | undefined
  if (values.seed !== undefined) {
    seed = Number(values.seed)
    if (!/^\d+$/.test(values.seed) || seed > 0xffffffff) {
      throw hooks.usageError(`--seed must be an integer in [0, 4294967295], got ${JSON.stringify(values.seed)}`)
    }
  }
  const { makeModel } = await import('./model/make-model')
  const bar = progressBar()
  let summary
  try {
    summary = await makeModel({ outDir: values.out, size, attention, seed, onProgress: (done, total) => bar.update(done, total) })
  } finally {
    bar.end()
  }
  process.stdout.write(
    `${summary.outDir}: ${summary.size} ${summary.attention} seed ${summary.seed}, ` +
      `${summary.parameters.toLocaleString('en-US')} parameters, ${(summary.totalBytes / 1e6).toFixed(2)} MB ` +
      `in ${(summary.elapsedMs / 1000).toFixed(1)} s\n`,
  )
}
