// ts/modelkit/gguf/dequantize.ts against ggml's definitions: the values gguf-py's numpy
// dequantizers (a mirror of ggml-quants.c's dequantize_row_*) give for random blocks of every type
// the importer reads, committed in test/fixtures/gguf/dequantize.json by the script beside it.
// Bit for bit, NaN and infinities included.

import { readFileSync } from 'node:fs'
import { dirname, join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { describe, expect, it } from 'vitest'
import { canDequantize, dequantize } from '../../ts/modelkit/gguf/dequantize'
import { GGML_TYPES, GgmlTypeId } from '../../ts/modelkit/gguf/ggml-types'

interface Case {
  type: number
  elements: number
  blocks: string
  values: string
}

const fixture = JSON.parse(readFileSync(join(dirname(fileURLToPath(import.meta.url)), '..', 'fixtures', 'gguf', 'dequantize.json'), 'utf8')) as {
  types: Record<string, Case>
}

describe('dequantize (against gguf-py 0.19.0)', () => {
  it('the fixture covers every type the importer reads', () => {
    expect(Object.keys(fixture.types).sort()).toEqual(Object.keys(GgmlTypeId).sort())
    for (const name of Object.keys(GgmlTypeId)) expect(canDequantize(GgmlTypeId[name as keyof typeof GgmlTypeId])).toBe(true)
  })

  for (const [name, c] of Object.entries(fixture.types)) {
    it(`${name}: ${c.elements} values, bit for bit`, () => {
      const raw = new Uint8Array(Buffer.from(c.blocks, 'base64'))
      const expected = new Uint32Array(new Uint8Array(Buffer.from(c.values, 'base64')).buffer)
      const out = new Float32Array(c.elements)
      dequantize(c.type, raw, c.elements, out)
      const got = new Uint32Array(out.buffer)
      const wrong: string[] = []
      for (let i = 0; i < c.elements && wrong.length < 5; i++) {
        const bothNaN = Number.isNaN(out[i]) && Number.isNaN(new Float32Array(expected.buffer)[i])
        if (got[i] !== expected[i] && !bothNaN) wrong.push(`#${i}: ${out[i]} != ${new Float32Array(expected.buffer)[i]}`)
      }
      expect(wrong).toEqual([])
      // The fixture is not trivial: most values differ from zero and from each other.
      expect(new Set(got).size).toBeGreaterThan(Math.min(60, c.elements / 2))
    })
  }

  it('writes at an offset and refuses partial blocks', () => {
    const c = fixture.types.Q4_K!
    const raw = new Uint8Array(Buffer.from(c.blocks, 'base64'))
    const whole = new Float32Array(c.elements)
    dequantize(c.type, raw, c.elements, whole)
    const shifted = new Float32Array(c.elements + 3)
    dequantize(c.type, raw, c.elements, shifted, 3)
    expect(Array.from(shifted.subarray(3))).toEqual(Array.from(whole))
    expect(() => dequantize(c.type, raw, 100, whole)).toThrow(/not whole Q4_K blocks/)
    expect(() => dequantize(c.type, raw.subarray(0, 10), 256, whole)).toThrow(/fewer than 1 blocks/)
    expect(() => dequantize(10 /* Q2_K */, raw, 256, whole)).toThrow(/cannot dequantize Q2_K/)
    expect(GGML_TYPES.get(GgmlTypeId.Q6_K)).toEqual({ name: 'Q6_K', blockSize: 256, typeSize: 210 })
  })
})
