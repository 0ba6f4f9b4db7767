// The model folder's contract is defined once, in ortex-ort's config (crates/ortex-ort/src/config/
// contract.rs and fields.rs), and reaches the model tooling as ts/generated/folder-contract.ts
// (crates/ortex-typegen; its test fails while the file is stale). Here: every genai_config.json
// the tooling writes, in every form, has only fields ortex reads or accepts (none it refuses), as
// the Rust loader checks them; its tensor names are the contract's.

import { describe, expect, it } from 'vitest'
import { DECODER_INPUTS, DECODER_OUTPUTS, GENAI_CONFIG_FIELDS, PAGED_INPUTS } from '../../ts/generated/folder-contract'
import { genaiConfig, type GenaiConfigOptions } from '../../ts/modelkit/genai-config'
import { INPUT_IDS, LOGITS, pastKeyName, presentValueName } from '../../ts/modelkit/decoder'
import { BLOCK_TABLE, LOGITS_INDICES } from '../../ts/modelkit/paged'

const DIMS = { vocabSize: 384, hiddenSize: 64, intermediateSize: 128, numLayers: 2, numHeads: 4, numKvHeads: 2, headSize: 16, contextLength: 256, ropeTheta: 10000, rmsNormEps: 1e-6 }
const BASE: GenaiConfigOptions = { dims: DIMS, attention: 'gqa', filename: 'model.onnx', bosTokenId: 1, eosTokenId: 2, padTokenId: 0 }

/** The paths of the fields `config` has that the loader's table does not accept, as
 *  check_fields walks them: read and harmless fields end the walk, objects are walked into. */
function unaccepted(config: unknown, prefix = ''): string[] {
  const out: string[] = []
  for (const [key, value] of Object.entries(config as Record<string, unknown>)) {
    const path = prefix === '' ? key : `${prefix}.${key}`
    const kind = (GENAI_CONFIG_FIELDS as Record<string, unknown>)[path]
    if (kind === 'object') out.push(...unaccepted(value, path))
    else if (kind !== 'read' && kind !== 'harmless') out.push(`${path}: ${JSON.stringify(kind)}`)
  }
  return out
}

describe('the folder contract (ts/generated/folder-contract.ts)', () => {
  const forms: Array<[string, GenaiConfigOptions]> = [
    ['gqa', BASE],
    ['mha', { ...BASE, attention: 'mha' }],
    ['paged, cuda', { ...BASE, attention: 'paged', blockSize: 16, provider: 'cuda' }],
    ['a sliding window and several EOS ids', { ...BASE, slidingWindow: { windowSize: 64, layers: [0] }, eosTokenId: [2, 3], modelType: 'qwen2' }],
  ]
  for (const [name, options] of forms) {
    it(`genai_config.json has only fields ortex reads or accepts: ${name}`, () => {
      expect(unaccepted(genaiConfig(options))).toEqual([])
    })
  }

  it("names the graph's tensors as the config's fields say, and writes the paged inputs in the builder's order", () => {
    const gqa = genaiConfig(BASE) as { model: { decoder: { inputs: Record<string, string>; outputs: Record<string, string> } } }
    expect(gqa.model.decoder.inputs).toEqual({
      input_ids: INPUT_IDS,
      attention_mask: DECODER_INPUTS.attention_mask,
      past_key_names: DECODER_INPUTS.past_key_names,
      past_value_names: DECODER_INPUTS.past_value_names,
    })
    expect(gqa.model.decoder.outputs).toEqual({ ...DECODER_OUTPUTS })
    expect([LOGITS, pastKeyName(3), presentValueName(1)]).toEqual(['logits', 'past_key_values.3.key', 'present.1.value'])
    const paged = genaiConfig({ ...BASE, attention: 'paged', blockSize: 16 }) as typeof gqa
    expect(Object.keys(paged.model.decoder.inputs)).toEqual(['input_ids', ...PAGED_INPUTS, 'past_key_names', 'past_value_names'])
    expect([BLOCK_TABLE, LOGITS_INDICES]).toEqual([DECODER_INPUTS.block_table, DECODER_INPUTS.logits_indices])
  })
})
