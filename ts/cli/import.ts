// `ortex import`: a GGUF file -> a model folder (ts/modelkit/gguf/import.ts, docs/model-format.md)
// with a progress bar on stderr and a one-line summary. The importer is imported only when the
// command runs, so the other commands never load it.

import { parseArgs } from 'node:util'

import { UsageError, choiceFlag, integerFlag, progressBar } from './args'

const USAGE = `Usage: ortex import <file.gguf> --out DIR [--weights fp32|int4] [--kv fp32|fp16]
                    [--accuracy-level 0|4] [--dtype fp32|fp16] [--attention gqa|paged]
                    [--paged-kernel cuda|reference] [--block-size N] [--context N] [--workers N]

Converts a GGUF file (llama.cpp's format) into a model folder that ortex and onnxruntime-genai load:
genai_config.json, model.onnx with its weights in model.onnx.data, tokenizer.json,
tokenizer_config.json and chat_template.jinja. What it reads (any other architecture or tensor
type is refused by name):
`

const OPTIONS = `
Options:
  --out DIR            the folder to write (created if missing; our files in it are overwritten)
  --weights FORMAT     'fp32' (default: every weight dequantized to float32) or 'int4' (linear
                       layers as MatMulNBits blocks: the file's own, Q4_0, Q4_1 and Q4_K as 4-bit
                       blocks and Q5_0, Q5_1, Q5_K, Q6_K, Q8_0 as 8-bit ones, exactly; float
                       weights quantized to 4 bits; the summary says which)
  --kv TYPE            the KV cache's element type, 'fp32' or 'fp16' (half the memory a
                       position, as llama.cpp's default f16 cache); the logits stay float32.
                       Default: fp16 with int4 weights, fp32 with fp32 weights
  --accuracy-level N   int4 only: what MatMulNBits computes with, 4 (default: activations
                       quantized to int8 blocks and integer dot products, as onnxruntime-genai's
                       builder sets for CPU and as llama.cpp does for 4-bit types) or 0 (float32
                       activations); docs/model-format.md measures both
  --dtype TYPE         'fp32' (default) or 'fp16': float weights, arithmetic, KV and logits in
                       float16, as onnxruntime-genai's builder writes -p fp16 -e cuda folders
  --attention NAME     'gqa' (default: com.microsoft.GroupQueryAttention) or 'paged' (packed
                       rows over a block-paged KV cache, the builder's use_paged_attention form)
  --paged-kernel NAME  paged only: 'cuda' (default: com.microsoft.PagedAttention, CUDA float16
                       only) or 'reference' (standard operators that run on the CPU, for tests)
  --block-size N       paged only: positions a KV cache block (default 256, the builder's)
  --context N          the folder's context (its rotary tables and the engine's maxLength): at
                       most the file's context_length (the default); for Phi's LongRoPE it picks
                       the short or long factors as llama.cpp's context size does
  --workers N          threads that dequantize and requantize the tensors (default: one per
                       core; 1 converts on the main thread); the folder is the same either way
  -h, --help           show this help
`

/** The help: usage, what the importer supports (from its own tables), the options. */
async function importHelp(): Promise<string> {
  const { describeSupport } = await import('../modelkit/gguf/supported')
  return `${USAGE}\n${describeSupport()}${OPTIONS}`
}

export async function runImportCommand(argv: string[]): Promise<void> {
  const { values, positionals } = parseArgs({
    args: argv,
    strict: true,
    allowPositionals: true,
    options: {
      out: { type: 'string' },
      weights: { type: 'string' },
      kv: { type: 'string' },
      'accuracy-level': { type: 'string' },
      dtype: { type: 'string' },
      attention: { type: 'string' },
      'paged-kernel': { type: 'string' },
      'block-size': { type: 'string' },
      context: { type: 'string' },
      workers: { type: 'string' },
      help: { type: 'boolean', short: 'h' },
    },
  })
  if (values.help) {
    process.stdout.write(await importHelp())
    return
  }
  if (positionals.length !== 1 || positionals[0] === '') throw new UsageError('give one GGUF file: ortex import <file.gguf> --out DIR')
  if (values.out === undefined || values.out === '') throw new UsageError('give --out DIR')
  const weights = choiceFlag('weights', values.weights, ['fp32', 'int4'] as const)
  const kv = choiceFlag('kv', values.kv, ['fp32', 'fp16'] as const)
  const level = choiceFlag('accuracy-level', values['accuracy-level'], ['0', '4'] as const)
  if (level !== undefined && weights !== 'int4') throw new UsageError('--accuracy-level applies to --weights int4 only')
  const dtype = choiceFlag('dtype', values.dtype, ['fp32', 'fp16'] as const)
  const attention = choiceFlag('attention', values.attention, ['gqa', 'paged'] as const)
  const pagedKernel = choiceFlag('paged-kernel', values['paged-kernel'], ['cuda', 'reference'] as const)
  const blockSize = integerFlag('block-size', values['block-size'], undefined, 1, 1 << 16)
  const contextLength = integerFlag('context', values.context, undefined, 1, 1 << 20)
  const { importGguf, describeImport, MAX_IMPORT_WORKERS } = await import('../modelkit/gguf/import')
  const workers = integerFlag('workers', values.workers, undefined, 1, MAX_IMPORT_WORKERS)
  const bar = progressBar('importing')
  let summary
  try {
    summary = await importGguf({
      file: positionals[0]!,
      outDir: values.out,
      weights,
      kv,
      accuracyLevel: level === undefined ? undefined : (Number(level) as 0 | 4),
      dtype,
      attention,
      pagedKernel,
      blockSize,
      contextLength,
      workers,
      onProgress: (done, total) => bar.update(done, total),
    })
  } finally {
    bar.end()
  }
  process.stdout.write(`${describeImport(summary)}\n`)
}
