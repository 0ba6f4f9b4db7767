// The ggml tensor types a GGUF file may store, with their block geometry (ggml-common.h; the
// numbers are gguf-py 0.19's GGML_QUANT_SIZES). A row of `n` elements takes n / blockSize blocks
// of typeSize bytes. The importer reads the types with a dequantizer in dequantize.ts; the others
// are listed so that the reader can check every tensor's extent and a refusal can name the type.

export const QK_K = 256

export interface GgmlType {
  name: string
  /** Elements per block. */
  blockSize: number
  /** Bytes per block. */
  typeSize: number
}

/** Type id (the number stored in the file) -> geometry. */
export const GGML_TYPES: ReadonlyMap<number, GgmlType> = new Map(
  (
    [
      [0, 'F32', 1, 4],
      [1, 'F16', 1, 2],
      [2, 'Q4_0', 32, 18],
      [3, 'Q4_1', 32, 20],
      [6, 'Q5_0', 32, 22],
      [7, 'Q5_1', 32, 24],
      [8, 'Q8_0', 32, 34],
      [9, 'Q8_1', 32, 40],
      [10, 'Q2_K', 256, 84],
      [11, 'Q3_K', 256, 110],
      [12, 'Q4_K', 256, 144],
      [13, 'Q5_K', 256, 176],
      [14, 'Q6_K', 256, 210],
      [15, 'Q8_K', 256, 292],
      [16, 'IQ2_XXS', 256, 66],
      [17, 'IQ2_XS', 256, 74],
      [18, 'IQ3_XXS', 256, 98],
      [19, 'IQ1_S', 256, 50],
      [20, 'IQ4_NL', 32, 18],
      [21, 'IQ3_S', 256, 110],
      [22, 'IQ2_S', 256, 82],
      [23, 'IQ4_XS', 256, 136],
      [24, 'I8', 1, 1],
      [25, 'I16', 1, 2],
      [26, 'I32', 1, 4],
      [27, 'I64', 1, 8],
      [28, 'F64', 1, 8],
      [29, 'IQ1_M', 256, 56],
      [30, 'BF16', 1, 2],
      [34, 'TQ1_0', 256, 54],
      [35, 'TQ2_0', 256, 66],
      [39, 'MXFP4', 32, 17],
      [40, 'NVFP4', 64, 36],
      [41, 'Q1_0', 128, 18],
    ] as const
  ).map(([id, name, blockSize, typeSize]) => [id, { name, blockSize, typeSize }]),
)

/** The ids of the types by name, for the types the importer handles. */
export const GgmlTypeId = {
  F32: 0,
  F16: 1,
  Q4_0: 2,
  Q4_1: 3,
  Q5_0: 6,
  Q5_1: 7,
  Q8_0: 8,
  Q4_K: 12,
  Q5_K: 13,
  Q6_K: 14,
  BF16: 30,
} as const
export type GgmlTypeName = keyof typeof GgmlTypeId

export function ggmlTypeName(id: number): string {
  return GGML_TYPES.get(id)?.name ?? `type ${id}`
}

/** Bytes of a row of `elements` elements of type `id` (elements must be a multiple of the block). */
export function rowBytes(id: number, elements: number): number {
  const t = GGML_TYPES.get(id)
  if (!t) throw new Error(`unknown ggml type ${id}`)
  return (elements / t.blockSize) * t.typeSize
}
