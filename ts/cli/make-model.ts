// `ortex make-model`: writes a deterministic random-weight model folder (ts/modelkit/make-model.ts,
// docs/model-format.md) with a progress bar on stderr. The generator is imported only when the
// command runs, so the other commands never load it.

import { parseArgs } from 'node:util'

import { UsageError, choiceFlag, integerFlag, progressBar } from './args'

export const MAKE_MODEL_HELP = `Usage: ortex make-model --out DIR [--size tiny|bench] [--attention mha|gqa|paged] [--seed N]
                        [--kv fp32|fp16] [--window N [--window-form cache|config|graph]]
                        [--paged-kernel cuda|reference] [--block-size N] [--dtype fp32|fp16]

Writes a deterministic random-weight Llama-style model folder (genai_config.json, model.onnx,
model.onnx.data, tokenizer.json) that ortex and onnxruntime-genai load. The same size, attention
and seed always give the same bytes.

Options:
  --out DIR            the folder to write (created if missing; our files in it are overwritten)
  --size NAME          'tiny' (default: 0.16M parameters, under 1 MB, for tests) or 'bench'
                       (62M parameters, 250 MB, for benchmarks)
  --attention NAME     'gqa' (default: com.microsoft.GroupQueryAttention, as onnxruntime-genai's
                       builder emits for CPU), 'mha' (plain ONNX operators) or 'paged' (packed
                       rows over a block-paged KV cache, the builder's use_paged_attention form)
  --seed N             the weights' seed, an integer in [0, 4294967295] (default 0)
  --kv TYPE            past, present and logits in 'fp32' (default) or 'fp16' (weights stay float32)
  --dtype TYPE         weights, arithmetic, KV and logits in 'fp32' (default) or 'fp16' (gqa and
                       paged; as onnxruntime-genai's builder writes -p fp16 -e cuda folders)
  --window N           a sliding window of N positions (gqa only)
  --window-form FORM   'cache' (default: the even layers' GroupQueryAttention has a windowed
                       cache, as the builder makes Gemma-2), 'config' (only genai_config.json has
                       the window, as the builder makes Mistral) or 'graph' (every layer's
                       GroupQueryAttention has it over a plain cache)
  --paged-kernel NAME  paged only: 'cuda' (default: com.microsoft.PagedAttention, CUDA float16
                       only) or 'reference' (standard operators that run on the CPU, for tests)
  --block-size N       paged only: positions a KV cache block (default 16 tiny, 256 bench)
  -h, --help           show this help
`

export async function runMakeModelCommand(argv: string[]): Promise<void> {
  const { values } = parseArgs({
    args: argv,
    strict: true,
    allowPositionals: false,
    options: {
      out: { type: 'string' },
      size: { type: 'string' },
      attention: { type: 'string' },
      seed: { type: 'string' },
      kv: { type: 'string' },
      dtype: { type: 'string' },
      window: { type: 'string' },
      'window-form': { type: 'string' },
      'paged-kernel': { type: 'string' },
      'block-size': { type: 'string' },
      help: { type: 'boolean', short: 'h' },
    },
  })
  if (values.help) {
    process.stdout.write(MAKE_MODEL_HELP)
    return
  }
  if (values.out === undefined || values.out === '') throw new UsageError('give --out DIR')
  const size = choiceFlag('size', values.size, ['tiny', 'bench'] as const)
  const attention = choiceFlag('attention', values.attention, ['mha', 'gqa', 'paged'] as const)
  const seed = integerFlag('seed', values.seed, undefined, 0, 0xffffffff)
  const kv = choiceFlag('kv', values.kv, ['fp32', 'fp16'] as const)
  const dtype = choiceFlag('dtype', values.dtype, ['fp32', 'fp16'] as const)
  const windowForm = choiceFlag('window-form', values['window-form'], ['cache', 'config', 'graph'] as const)
  if (values['window-form'] !== undefined && values.window === undefined) throw new UsageError('--window-form needs --window N')
  const windowSize = integerFlag('window', values.window, undefined, 1, 1 << 20)
  const window = windowSize === undefined ? undefined : { size: windowSize, form: windowForm ?? 'cache' }
  const pagedKernel = choiceFlag('paged-kernel', values['paged-kernel'], ['cuda', 'reference'] as const)
  const blockSize = integerFlag('block-size', values['block-size'], undefined, 1, 1 << 20)
  const { makeModel } = await import('../modelkit/make-model')
  const bar = progressBar('weights')
  let summary
  try {
    summary = await makeModel({
      outDir: values.out,
      size,
      attention,
      seed,
      ...(kv ? { kv } : {}),
      ...(dtype ? { dtype } : {}),
      ...(window ? { window } : {}),
      ...(pagedKernel ? { pagedKernel } : {}),
      ...(blockSize !== undefined ? { blockSize } : {}),
      onProgress: (done, total) => bar.update(done, total),
    })
  } finally {
    bar.end()
  }
  process.stdout.write(
    `${summary.outDir}: ${summary.size} ${summary.attention} seed ${summary.seed}` +
      `${summary.dtype === 'fp32' ? '' : ` dtype ${summary.dtype}`}${summary.kv === summary.dtype ? '' : ` kv ${summary.kv}`}${summary.window ? ` window ${summary.window.form} ${summary.window.size}` : ''}` +
      `${summary.paged ? ` ${summary.paged.kernel} kernel block ${summary.paged.blockSize}` : ''}, ` +
      `${summary.parameters.toLocaleString('en-US')} parameters, ${(summary.totalBytes / 1e6).toFixed(2)} MB ` +
      `in ${(summary.elapsedMs / 1000).toFixed(1)} s\n`,
  )
}
