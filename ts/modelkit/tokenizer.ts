// A byte-level BPE tokenizer in the Hugging Face `tokenizers` format (tokenizer.json), learned
// deterministically from the built-in English text, plus a small JS encoder/decoder for it.
//
// Vocabulary layout (ids):
//   0 <pad>, 1 <s>, 2 </s>                      special tokens (also listed in added_tokens)
//   3 .. 258                                    the 256 byte tokens, in byte order (GPT-2 byte-to-unicode)
//   259 ..                                      one token per merge, in merge (rank) order
// Merges are learned in three phases until the target size is reached:
//   1. classic BPE over the pre-tokenized words of the text (pairs seen at least twice);
//   2. the same with pairs seen once, until every word of the text is a single token;
//   3. word n-grams of the text (n = 2, 3, ...), each the merge of its (n-1)-gram prefix and its
//      last word: valid BPE merges that encoding never produces (the pre-tokenizer splits words),
//      but that a model can emit and that decode to phrases of the text.
// Ties pick the pair whose "left right" string sorts first (UTF-16 order): fully deterministic.

import { CORPUS } from './corpus'

export const PAD_TOKEN = '<pad>'
export const BOS_TOKEN = '<s>'
export const EOS_TOKEN = '</s>'
export const SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN] as const
export const PAD_TOKEN_ID = 0
export const BOS_TOKEN_ID = 1
export const EOS_TOKEN_ID = 2
export const FIRST_BYTE_TOKEN_ID = 3

/** GPT-2's pre-tokenization pattern (what the ByteLevel pre-tokenizer uses with use_regex). */
export const GPT2_PATTERN = /'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+/gu

/** GPT-2's reversible byte -> printable character map. */
export const BYTE_TO_CHAR: readonly string[] = (() => {
  const keep: number[] = []
  for (let b = 0x21; b <= 0x7e; b++) keep.push(b)
  for (let b = 0xa1; b <= 0xac; b++) keep.push(b)
  for (let b = 0xae; b <= 0xff; b++) keep.push(b)
  const map: string[] = new Array(256)
  let extra = 0
  for (let b = 0; b < 256; b++) {
    map[b] = keep.includes(b) ? String.fromCharCode(b) : String.fromCharCode(256 + extra++)
  }
  return map
})()

const CHAR_TO_BYTE: ReadonlyMap<string, number> = new Map(BYTE_TO_CHAR.map((c, b) => [c, b]))

const utf8 = new TextEncoder()

/** Text -> the byte-level string of each pre-token. */
export function preTokenize(text: string): string[] {
  const out: string[] = []
  for (const m of text.matchAll(GPT2_PATTERN)) out.push(toByteLevel(m[0]))
  return out
}

function toByteLevel(s: string): string {
  let r = ''
  for (const b of utf8.encode(s)) r += BYTE_TO_CHAR[b]
  return r
}

export interface BpeModel {
  /** Token strings by id (special tokens included). */
  vocab: string[]
  /** Merges in rank order, each [left, right]. */
  merges: Array<[string, string]>
}

/** Learns a vocabulary of exactly `vocabSize` tokens from `text` (see the header for the phases). */
export function trainBpe(vocabSize: number, text: string = CORPUS): BpeModel {
  const base = SPECIAL_TOKENS.length + 256
  if (!Number.isInteger(vocabSize) || vocabSize < base) {
    throw new Error(`vocab size must be an integer >= ${base}, got ${vocabSize}`)
  }
  const vocab: string[] = [...SPECIAL_TOKENS, ...BYTE_TO_CHAR]
  const known = new Set(vocab)
  const merges: Array<[string, string]> = []
  const add = (left: string, right: string): boolean => {
    const token = left + right
    if (known.has(token)) return false
    known.add(token)
    vocab.push(token)
    merges.push([left, right])
    return true
  }

  // Phases 1 and 2: BPE over unique words weighted by frequency.
  const sequence = preTokenize(text)
  const freq = new Map<string, number>()
  for (const w of sequence) freq.set(w, (freq.get(w) ?? 0) + 1)
  const words = [...freq.keys()].sort()
  const symbols = words.map((w) => Array.from(w))
  const counts = words.map((w) => freq.get(w) ?? 0)
  for (const minCount of [2, 1]) {
    while (vocab.length < vocabSize) {
      const pairs = new Map<string, number>()
      for (let i = 0; i < symbols.length; i++) {
        const s = symbols[i]!
        for (let j = 0; j + 1 < s.length; j++) {
          const key = s[j] + ' ' + s[j + 1]
          pairs.set(key, (pairs.get(key) ?? 0) + counts[i]!)
        }
      }
      let best: string | undefined
      let bestCount = 0
      for (const [key, c] of pairs) {
        if (c > bestCount || (c === bestCount && best !== undefined && key < best)) {
          best = key
          bestCount = c
        }
      }
      if (best === undefined || bestCount < minCount) break
      const space = best.indexOf(' ')
      const left = best.slice(0, space)
      const right = best.slice(space + 1)
      add(left, right)
      const merged = left + right
      for (const s of symbols) {
        for (let j = 0; j + 1 < s.length; j++) {
          if (s[j] === left && s[j + 1] === right) s.splice(j, 2, merged)
        }
      }
    }
  }

  // Phase 3: word n-grams of the running text.
  for (let n = 2; vocab.length < vocabSize; n++) {
    let grew = false
    for (let i = 0; i + n <= sequence.length && vocab.length < vocabSize; i++) {
      const prefix = sequence.slice(i, i + n - 1).join('')
      const last = sequence[i + n - 1]!
      if (!known.has(prefix) || !known.has(last)) continue
      if (add(prefix, last)) grew = true
    }
    if (!grew) throw new Error(`the built-in text cannot provide ${vocabSize} tokens (stopped at ${vocab.length})`)
  }
  return { vocab, merges }
}

export interface TokenizerFiles {
  /** tokenizer.json (Hugging Face tokenizers format). */
  tokenizerJson: string
  /** tokenizer_config.json (transformers' tokenizer config, read by onnxruntime-genai). */
  tokenizerConfigJson: string
  /** special_tokens_map.json. */
  specialTokensMapJson: string
}

function addedToken(id: number, content: string) {
  return { id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true }
}

export function tokenizerFiles(model: BpeModel, contextLength: number): TokenizerFiles {
  const vocab: Record<string, number> = {}
  model.vocab.forEach((t, id) => {
    vocab[t] = id
  })
  const tokenizer = {
    version: '1.0',
    truncation: null,
    padding: null,
    added_tokens: SPECIAL_TOKENS.map((t, id) => addedToken(id, t)),
    normalizer: null,
    pre_tokenizer: { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: true },
    post_processor: null,
    decoder: { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true },
    model: {
      type: 'BPE',
      dropout: null,
      unk_token: null,
      continuing_subword_prefix: '',
      end_of_word_suffix: '',
      fuse_unk: false,
      byte_fallback: false,
      ignore_merges: false,
      vocab,
      merges: model.merges.map(([a, b]) => `${a} ${b}`),
    },
  }
  const addedTokensDecoder: Record<string, object> = {}
  SPECIAL_TOKENS.forEach((t, id) => {
    const { id: _id, ...rest } = addedToken(id, t)
    addedTokensDecoder[String(id)] = rest
  })
  const config = {
    add_bos_token: false,
    add_eos_token: false,
    add_prefix_space: false,
    added_tokens_decoder: addedTokensDecoder,
    bos_token: BOS_TOKEN,
    clean_up_tokenization_spaces: false,
    eos_token: EOS_TOKEN,
    model_max_length: contextLength,
    pad_token: PAD_TOKEN,
    tokenizer_class: 'GPT2Tokenizer',
    unk_token: null,
  }
  const specialMap = { bos_token: BOS_TOKEN, eos_token: EOS_TOKEN, pad_token: PAD_TOKEN }
  return {
    tokenizerJson: JSON.stringify(tokenizer, null, 2) + '\n',
    tokenizerConfigJson: JSON.stringify(config, null, 2) + '\n',
    specialTokensMapJson: JSON.stringify(specialMap, null, 2) + '\n',
  }
}

/**
 * Encodes and decodes with a tokenizer.json written by this module (byte-level BPE, no normalizer,
 * special tokens matched literally in the input, no BOS/EOS added).
 */
export class ByteLevelBpe {
  readonly vocabSize: number
  private readonly ids: Map<string, number>
  private readonly tokens: string[]
  private readonly ranks: Map<string, number>
  private readonly special: Map<string, number>
  private readonly specialPattern: RegExp | null
  private readonly cache = new Map<string, number[]>()

  constructor(tokenizerJson: string | object) {
    const j = (typeof tokenizerJson === 'string' ? JSON.parse(tokenizerJson) : tokenizerJson) as {
      model: { type: string; vocab: Record<string, number>; merges: Array<string | [string, string]> }
      added_tokens?: Array<{ id: number; content: string }>
    }
    if (j.model?.type !== 'BPE') throw new Error('tokenizer.json: model.type is not BPE')
    this.ids = new Map(Object.entries(j.model.vocab))
    this.tokens = []
    for (const [t, id] of this.ids) this.tokens[id] = t
    this.special = new Map()
    for (const a of j.added_tokens ?? []) {
      this.special.set(a.content, a.id)
      this.tokens[a.id] = a.content
    }
    this.vocabSize = this.tokens.length
    this.ranks = new Map()
    j.model.merges.forEach((m, rank) => {
      const [a, b] = typeof m === 'string' ? splitMerge(m) : m
      this.ranks.set(a + ' ' + b, rank)
    })
    const escaped = [...this.special.keys()].sort((a, b) => b.length - a.length).map(escapeRegExp)
    this.specialPattern = escaped.length ? new RegExp(escaped.join('|'), 'g') : null
  }

  encode(text: string): number[] {
    const out: number[] = []
    let last = 0
    if (this.specialPattern) {
      for (const m of text.matchAll(this.specialPattern)) {
        this.encodeOrdinary(text.slice(last, m.index), out)
        out.push(this.special.get(m[0])!)
        last = m.index! + m[0].length
      }
    }
    this.encodeOrdinary(text.slice(last), out)
    return out
  }

  /** Token ids -> text; special tokens are kept unless `skipSpecial`. Invalid UTF-8 becomes U+FFFD. */
  decode(ids: ArrayLike<number>, options: { skipSpecial?: boolean } = {}): string {
    const bytes: number[] = []
    let text = ''
    const flush = () => {
      text += new TextDecoder().decode(new Uint8Array(bytes))
      bytes.length = 0
    }
    for (let i = 0; i < ids.length; i++) {
      const id = ids[i]!
      const token = this.tokens[id]
      if (token === undefined) throw new Error(`token id ${id} is out of range`)
      if (this.special.has(token) && this.special.get(token) === id) {
        if (!options.skipSpecial) {
          flush()
          text += token
        }
        continue
      }
      for (const ch of token) {
        const b = CHAR_TO_BYTE.get(ch)
        if (b === undefined) throw new Error(`token ${id} has a non-byte-level character`)
        bytes.push(b)
      }
    }
    flush()
    return text
  }

  tokenString(id: number): string | undefined {
    return this.tokens[id]
  }

  private encodeOrdinary(text: string, out: number[]): void {
    if (!text) return
    for (const word of preTokenize(text)) {
      let ids = this.cache.get(word)
      if (!ids) {
        ids = this.bpe(word).map((t) => this.ids.get(t)!)
        if (this.cache.size < 10_000) this.cache.set(word, ids)
      }
      out.push(...ids)
    }
  }

  private bpe(word: string): string[] {
    const parts = Array.from(word)
    for (;;) {
      let bestRank = Infinity
      let best = -1
      for (let j = 0; j + 1 < parts.length; j++) {
        const r = this.ranks.get(parts[j] + ' ' + parts[j + 1])
        if (r !== undefined && r < bestRank) {
          bestRank = r
          best = j
        }
      }
      if (best < 0) return parts
      const left = parts[best]!
      const right = parts[best + 1]!
      for (let j = 0; j + 1 < parts.length; j++) {
        if (parts[j] === left && parts[j + 1] === right) parts.splice(j, 2, left + right)
      }
    }
  }
}

function splitMerge(m: string): [string, string] {
  const i = m.indexOf(' ')
  if (i <= 0) throw new Error(`tokenizer.json: bad merge "${m}"`)
  return [m.slice(0, i), m.slice(i + 1)]
}

function escapeRegExp(s: string): string {
  return s.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')
}
