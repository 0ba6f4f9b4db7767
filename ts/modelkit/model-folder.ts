// Writing a model folder (docs/model-format.md): what `ortex make-model` and `ortex import` share.
// genai_config.json is written last and atomically, so a folder without it is an unfinished one.

import { rename, stat, writeFile } from 'node:fs/promises'
import { join } from 'node:path'
import type { GraphBuilder } from './onnx-builder'

export const MODEL_FILE = 'model.onnx'
export const DATA_FILE = 'model.onnx.data'
export const CONFIG_FILE = 'genai_config.json'

/** Serializes the graph to model.onnx (IR 10, opsets ai.onnx 21 and com.microsoft 1). */
export async function writeModelFile(
  outDir: string,
  graph: GraphBuilder,
  producer: { name: string; version: string },
  metadata: Record<string, string>,
): Promise<void> {
  const model = graph.encode({
    irVersion: 10,
    opsets: { '': 21, 'com.microsoft': 1 },
    producerName: producer.name,
    producerVersion: producer.version,
    metadata,
  })
  await writeFile(join(outDir, MODEL_FILE), model)
}

/** Writes genai_config.json through a temporary file and a rename. */
export async function writeConfigLast(outDir: string, config: object): Promise<void> {
  const tmp = join(outDir, `${CONFIG_FILE}.tmp`)
  await writeFile(tmp, JSON.stringify(config, null, 4) + '\n')
  await rename(tmp, join(outDir, CONFIG_FILE))
}

export interface FileSize {
  name: string
  bytes: number
}

export async function fileSizes(outDir: string, names: readonly string[]): Promise<{ files: FileSize[]; totalBytes: number }> {
  const files = await Promise.all(names.map(async (name) => ({ name, bytes: (await stat(join(outDir, name))).size })))
  return { files, totalBytes: files.reduce((n, f) => n + f.bytes, 0) }
}
