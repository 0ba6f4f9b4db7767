// The GPU folders of `ortex make-model` held against what onnxruntime-genai 0.18's builder itself
// writes for a random Hugging Face Llama of the tiny model's sizes, `-p fp16 -e cuda` with and
// without `use_paged_attention=true prune_lm_head=true paged_block_size=16`: the same
// genai_config.json, the paged graph's inputs and outputs (names, types, shapes, order), each
// layer's PagedAttention inputs (q/k/v packed into one MatMul of the same name), its attributes
// and domain, the rotary tables, and the same operators as often. What differs: ours concatenates
// the q/k/v weights in the graph (ONNX Runtime folds the Concat at load) where the builder stores
// them packed. Needs the builder's Python
// environment (bench/model_coverage.py makes it: ~/.cache/ortex/venv-builder); skipped, with a line
// saying why, without it. No GPU needed: the builder writes CUDA folders on any machine. The
// builder's folders are made once (about 30 s) and kept in the cache beside the environment.

import { spawnSync } from 'node:child_process'
import { existsSync, mkdtempSync, readFileSync, renameSync, rmSync } from 'node:fs'
import { tmpdir } from 'node:os'
import { dirname, join, resolve } from 'node:path'
import { fileURLToPath } from 'node:url'
import onnxProto from 'onnx-proto'
import { Engine, OrtexError } from 'ortex'
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { makeModel } from '../../ts/modelkit/make-model'
import { cacheRoot } from '../../ts/modelkit/real-model'

const { onnx } = onnxProto
const repo = resolve(dirname(fileURLToPath(import.meta.url)), '..', '..')
const python = join(cacheRoot(), 'venv-builder', 'bin', 'python')
const available = existsSync(python)
if (!available) console.warn(`[paged-builder] skipped: no builder environment at ${python} (python3 bench/model_coverage.py makes it)`)

/** A random HF Llama with make-model's tiny sizes (bench/model_coverage.py's maker), then the builder. */
const BUILD = `
import sys, subprocess
from pathlib import Path
sys.path.insert(0, sys.argv[1] + '/bench')
import model_coverage as mc
mc.COMMON.update(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)
root = Path(sys.argv[2])
mc.make_hf_model('llama', root / 'hf')
for out, extra in [('paged', ['--extra_options', 'use_paged_attention=true', 'prune_lm_head=true', 'paged_block_size=16']), ('gqa', [])]:
    subprocess.run([sys.executable, '-m', 'onnxruntime_genai.models.builder', '-i', str(root / 'hf'), '-o', str(root / out),
                    '-p', 'fp16', '-e', 'cuda', '-c', str(root / 'cache'), *extra], check=True, capture_output=True)
`

/** The builder's two folders, made once into the cache (a private name renamed into place). */
function builderFolders(): string {
  const dir = join(cacheRoot(), 'builder-gpu-folders-0.18.0-v1')
  if (existsSync(join(dir, 'gqa', 'genai_config.json'))) return dir
  const tmp = `${dir}.tmp-${process.pid}`
  const run = spawnSync(python, ['-c', BUILD, repo, tmp], { encoding: 'utf8', timeout: 300_000 })
  if (run.status !== 0) throw new Error(`the builder failed: ${(run.stderr || run.stdout).trim().split('\n').slice(-3).join(' ')}`)
  try {
    renameSync(tmp, dir)
  } catch (error) {
    if (!existsSync(join(dir, 'gqa', 'genai_config.json'))) throw error // else another run made it first
  } finally {
    rmSync(tmp, { recursive: true, force: true })
  }
  return dir
}

let root = ''
const dirs = { builderPaged: '', builderGqa: '', paged: '', gqa: '' }
const model = (dir: string) => onnx.ModelProto.decode(readFileSync(join(dir, 'model.onnx'))).graph!
const config = (dir: string) => JSON.parse(readFileSync(join(dir, 'genai_config.json'), 'utf8'))

describe.skipIf(!available)("make-model's GPU folders against onnxruntime-genai's builder", () => {
  beforeAll(async () => {
    const built = builderFolders()
    root = mkdtempSync(join(tmpdir(), 'ortex-paged-builder-'))
    Object.assign(dirs, { builderPaged: join(built, 'paged'), builderGqa: join(built, 'gqa'), paged: join(root, 'paged'), gqa: join(root, 'gqa') })
    await makeModel({ outDir: dirs.paged, size: 'tiny', attention: 'paged', dtype: 'fp16' })
    await makeModel({ outDir: dirs.gqa, size: 'tiny', attention: 'gqa', dtype: 'fp16' })
  }, 300_000)
  afterAll(() => {
    if (root) rmSync(root, { recursive: true, force: true })
  })

  it('genai_config.json is the same, paged and not', () => {
    expect(config(dirs.paged)).toEqual(config(dirs.builderPaged))
    expect(config(dirs.gqa)).toEqual(config(dirs.builderGqa))
  })

  it('the paged graph has the same inputs and outputs', () => {
    const io = (list: onnxProto.onnx.IValueInfoProto[]) =>
      list.map((v) => [v.name, v.type!.tensorType!.elemType, v.type!.tensorType!.shape!.dim!.map((d) => d.dimParam || Number(d.dimValue))])
    expect(io(model(dirs.paged).input!)).toEqual(io(model(dirs.builderPaged).input!))
    expect(io(model(dirs.paged).output!)).toEqual(io(model(dirs.builderPaged).output!))
  })

  it("each layer's PagedAttention has the builder's inputs and attributes", () => {
    const attention = (dir: string) => model(dir).node!.filter((n) => n.opType === 'PagedAttention')
    const attrs = (n: onnxProto.onnx.INodeProto) => Object.fromEntries(n.attribute!.map((a) => [a.name, a.type === onnx.AttributeProto.AttributeType.FLOAT ? a.f : Number(a.i)]))
    const ours = attention(dirs.paged)
    const theirs = attention(dirs.builderPaged)
    expect(ours).toHaveLength(theirs.length)
    ours.forEach((node, l) => {
      expect(node.domain).toBe(theirs[l]!.domain)
      expect(node.input).toEqual(theirs[l]!.input)
      expect(node.output).toEqual(theirs[l]!.output)
      expect(attrs(node)).toEqual(attrs(theirs[l]!))
      expect(node.input!.slice(0, 3)).toEqual([`/model/layers.${l}/attn/qkv_proj/MatMul/output_0`, '', ''])
    })
  })

  it('the same operators as often, but for the Concats of the q/k/v weights', () => {
    for (const [ours, theirs] of [[dirs.paged, dirs.builderPaged], [dirs.gqa, dirs.builderGqa]] as const) {
      const count = (dir: string) => {
        const ops: Record<string, number> = {}
        for (const n of model(dir).node!) if (n.opType !== 'Concat') ops[`${n.domain || 'ai.onnx'}.${n.opType}`] = (ops[`${n.domain || 'ai.onnx'}.${n.opType}`] ?? 0) + 1
        return ops
      }
      // The builder's gqa graph has two Constant nodes (its mask subgraph) where ours has initializers.
      const { 'ai.onnx.Constant': _, ...builder } = count(theirs)
      expect(count(ours)).toEqual(builder)
    }
    const table = (dir: string, name: string) => {
      const t = model(dir).initializer!.find((i) => i.name === name)!
      return [t.dataType, t.dims!.map(Number)]
    }
    for (const name of ['cos_cache', 'sin_cache']) expect(table(dirs.paged, name)).toEqual(table(dirs.builderPaged, name))
  })

  // The builder's CUDA folders themselves in ortex (item 2: "onnxruntime-genai's builder folders for
  // CUDA load too"). The gqa one runs on the CPU (float16 weights: ONNX Runtime casts around the
  // nodes without a float16 kernel) and gives transformers' greedy tokens for the Hugging Face model
  // it was built from (float32); the paged one is refused on the CPU, saying where it runs.
  it("runs the builder's fp16 gqa folder with transformers' greedy tokens, and refuses its paged one on the CPU", async () => {
    const prompt = [1, 5, 9, 200, 17]
    const hf = spawnSync(python, ['-c', HF_GREEDY, join(dirname(dirs.builderGqa), 'hf'), JSON.stringify(prompt), '16'], { encoding: 'utf8', timeout: 120_000 })
    expect(hf.status, hf.stderr).toBe(0)
    const expected = (JSON.parse(hf.stdout.trim().split('\n').at(-1)!) as number[]).slice(prompt.length)
    expect(expected).toHaveLength(16)
    const engine = await Engine.load(dirs.builderGqa, { executionProvider: 'cpu' })
    try {
      const turn = engine.generate(prompt, { maxGeneratedTokens: 16, ignoreEos: true })
      const tokens: number[] = []
      for await (const chunk of turn) tokens.push(chunk.token)
      expect(tokens).toEqual(expected)
      expect(engine.executorStats()?.kvPositionBytes).toBe(2 * 2 * 2 * 16 * 2) // layers x K/V x kv heads x head x float16
    } finally {
      await engine.close()
    }
    const refused = await Engine.load(dirs.builderPaged, { executionProvider: 'cpu' }).catch((e: unknown) => e)
    expect(refused).toBeInstanceOf(OrtexError)
    expect(refused).toMatchObject({ code: 'MODEL_LOAD', message: expect.stringContaining('PagedAttention, which ONNX Runtime runs on CUDA only') })
  })
})

/** Greedy tokens of the Hugging Face model in ARGV[1] (float32) after the prompt ARGV[2], ARGV[3] new ones. */
const HF_GREEDY = `
import sys, json, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
with torch.no_grad():
    out = model.generate(torch.tensor([json.loads(sys.argv[2])]), max_new_tokens=int(sys.argv[3]), do_sample=False)
print(json.dumps(out[0].tolist()))
`
