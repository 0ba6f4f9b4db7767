// What the importer supports, rendered from its own tables (architecture.ts's ARCHITECTURES,
// ARCHITECTURE_NOTES and SUPPORTED_TYPES, int4.ts's exact mappings) for `ortex import --help`, so
// that the help can never list an architecture or a tensor type the importer does not read.

import { ARCHITECTURES, ARCHITECTURE_NOTES, SUPPORTED_TYPES } from './architecture'
import { GgmlTypeId, type GgmlTypeName } from './ggml-types'
import { mapsExactly } from './int4'

/** What `--weights int4` makes of a linear weight's blocks, by how faithful it is (the order the
 *  help lists them in). */
const INT4_TREATMENTS = ['kept exactly', 'requantized; an lm_head kept exactly as 8-bit blocks', 'requantized to 4 bits'] as const

export function int4Treatment(type: string): (typeof INT4_TREATMENTS)[number] {
  const id = GgmlTypeId[type as GgmlTypeName]
  if (mapsExactly(id)) return INT4_TREATMENTS[0]
  if (id === GgmlTypeId.Q8_0) return INT4_TREATMENTS[1]
  return INT4_TREATMENTS[2]
}

/** The help's section: one line per architecture (with its note), then the tensor types grouped
 *  by what an int4 import makes of them. */
export function describeSupport(): string {
  const rows = (pairs: Array<[string, string | undefined]>) => {
    const width = Math.max(...pairs.map(([name]) => name.length))
    return pairs.map(([name, note]) => (note === undefined ? `  ${name}` : `  ${name.padEnd(width)}  ${note}`))
  }
  const types = INT4_TREATMENTS.map((treatment): [string, string] => [SUPPORTED_TYPES.filter((t) => int4Treatment(t) === treatment).join(', '), treatment])
  return [
    'Architectures (general.architecture):',
    ...rows(ARCHITECTURES.map((a) => [a, ARCHITECTURE_NOTES[a]])),
    'Tensor types (--weights fp32: each dequantized to float32; --weights int4: a linear layer):',
    ...rows(types.filter(([names]) => names !== '')),
    '',
  ].join('\n')
}
