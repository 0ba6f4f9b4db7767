// llama.cpp's tokenization (llama-vocab.cpp) straight from a GGUF file's vocabulary, with
// parse_special = true and add_special = false: the oracle the imported tokenizer.json (Hugging
// Face tokenizers) is compared with. Byte-level BPE (llm_tokenizer_bpe_session::tokenize):
//
//   1. CONTROL and USER_DEFINED tokens are cut out of the text, longest first
//      (tokenizer_st_partition); the text between them is tokenized on its own.
//   2. The text is split by llama.cpp's regex list for tokenizer.ggml.pre, one regex after the
//      other: each regex splits every piece into its matches and the text between them
//      (unicode_regex_split). These are llama.cpp's own forms of the patterns, not the ones the
//      importer writes.
//   3. Each piece's UTF-8 bytes map to GPT-2's byte characters; the pair with the lowest merge
//      rank merges first (leftmost on ties) until no pair has a rank. ignore_merges (Llama 3): a
//      piece that is a whole token is that token.

import { BYTE_TO_CHAR } from '../../ts/modelkit/tokenizer'

const GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
const LLAMA3 =
  "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
const QWEN2 =
  "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
const TEKKEN =
  '[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+'

/** llama.cpp's regex lists by tokenizer.ggml.pre (llm_tokenizer_bpe's constructor). */
export const LLAMA_CPP_REGEXES: Readonly<Record<string, string[]>> = {
  'gpt-2': [GPT2],
  smollm: ['\\p{N}', GPT2],
  starcoder: ['\\p{N}', GPT2],
  'llama-bpe': [LLAMA3],
  llama3: [LLAMA3],
  'llama-v3': [LLAMA3],
  qwen2: [QWEN2],
  'deepseek-r1-qwen': [QWEN2],
  tekken: [TEKKEN],
}

const IGNORE_MERGES = new Set(['llama-bpe', 'llama3', 'llama-v3'])

export class LlamaCppBpe {
  private readonly ids = new Map<string, number>()
  private readonly ranks = new Map<string, number>()
  private readonly specials: string[]
  private readonly regexes: RegExp[]
  private readonly ignoreMerges: boolean

  constructor(vocab: { tokens: string[]; types: number[]; merges: string[]; pre: string }) {
    vocab.tokens.forEach((t, id) => {
      if (!this.ids.has(t)) this.ids.set(t, id)
    })
    vocab.merges.forEach((m, rank) => this.ranks.set(m, rank))
    this.specials = vocab.tokens.filter((_, id) => vocab.types[id] === 3 || vocab.types[id] === 4).sort((a, b) => b.length - a.length)
    const list = LLAMA_CPP_REGEXES[vocab.pre]
    if (!list) throw new Error(`no llama.cpp regexes for ${vocab.pre}`)
    this.regexes = list.map((r) => new RegExp(r, 'gu'))
    this.ignoreMerges = IGNORE_MERGES.has(vocab.pre)
  }

  encode(text: string): number[] {
    const out: number[] = []
    for (const fragment of partition(text, this.specials)) {
      if (fragment.special) out.push(this.ids.get(fragment.text)!)
      else for (const piece of this.split(fragment.text)) out.push(...this.bpe(piece))
    }
    return out
  }

  /** The pieces the regexes cut `text` into (step 2). */
  split(text: string): string[] {
    let pieces = [text]
    for (const regex of this.regexes) {
      const next: string[] = []
      for (const piece of pieces) {
        let last = 0
        for (const m of piece.matchAll(regex)) {
          if (m[0].length === 0) continue
          if (m.index! > last) next.push(piece.slice(last, m.index))
          next.push(m[0])
          last = m.index! + m[0].length
        }
        if (last < piece.length) next.push(piece.slice(last))
      }
      pieces = next
    }
    return pieces
  }

  private bpe(piece: string): number[] {
    let symbols = Array.from(Buffer.from(piece, 'utf8'), (b) => BYTE_TO_CHAR[b]!)
    const whole = symbols.join('')
    if (this.ignoreMerges && this.ids.has(whole)) return [this.ids.get(whole)!]
    for (;;) {
      let best = -1
      let bestRank = Infinity
      for (let i = 0; i + 1 < symbols.length; i++) {
        const rank = this.ranks.get(`${symbols[i]} ${symbols[i + 1]}`)
        if (rank !== undefined && rank < bestRank) {
          bestRank = rank
          best = i
        }
      }
      if (best < 0) break
      symbols = [...symbols.slice(0, best), symbols[best]! + symbols[best + 1]!, ...symbols.slice(best + 2)]
    }
    return symbols.map((s) => {
      const id = this.ids.get(s)
      if (id === undefined) throw new Error(`no token for ${JSON.stringify(s)}`)
      return id
    })
  }
}

/**
 * llama.cpp's SentencePiece tokenization (llm_tokenizer_spm_session, add_space_prefix, parse_special):
 * special tokens cut out first; each other fragment gets a leading space when it starts the text
 * or follows a special token, spaces become "▁"; then the adjacent pair whose concatenation is the
 * highest-scoring token merges first (leftmost on ties) until none is a token; a symbol that is no
 * token falls back to its UTF-8 bytes as <0xXX> tokens.
 */
export class LlamaCppSpm {
  private readonly ids = new Map<string, number>()
  private readonly specials: string[]

  constructor(private readonly vocab: { tokens: string[]; types: number[]; scores: number[]; addSpacePrefix: boolean }) {
    vocab.tokens.forEach((t, id) => {
      if (!this.ids.has(t)) this.ids.set(t, id)
    })
    this.specials = vocab.tokens.filter((_, id) => vocab.types[id] === 3 || vocab.types[id] === 4).sort((a, b) => b.length - a.length)
  }

  encode(text: string): number[] {
    const out: number[] = []
    let previousSpecial = true
    for (const fragment of partition(text, this.specials)) {
      if (fragment.special) {
        out.push(this.ids.get(fragment.text)!)
        previousSpecial = true
        continue
      }
      const prefixed = (this.vocab.addSpacePrefix && previousSpecial ? ' ' : '') + fragment.text
      out.push(...this.pieces(prefixed.replace(/ /g, '▁')))
      previousSpecial = false
    }
    return out
  }

  private pieces(text: string): number[] {
    let symbols = Array.from(text)
    for (;;) {
      let best = -1
      let bestScore = -Infinity
      for (let i = 0; i + 1 < symbols.length; i++) {
        const id = this.ids.get(symbols[i]! + symbols[i + 1]!)
        if (id !== undefined && this.vocab.scores[id]! > bestScore) {
          bestScore = this.vocab.scores[id]!
          best = i
        }
      }
      if (best < 0) break
      symbols = [...symbols.slice(0, best), symbols[best]! + symbols[best + 1]!, ...symbols.slice(best + 2)]
    }
    return symbols.flatMap((s) => {
      const id = this.ids.get(s)
      if (id !== undefined) return [id]
      return Array.from(Buffer.from(s, 'utf8'), (b) => this.ids.get(`<0x${b.toString(16).toUpperCase().padStart(2, '0')}>`)!)
    })
  }
}

/** Cuts the special tokens (longest first) out of the text, as tokenizer_st_partition does. */
function partition(text: string, specials: string[]): Array<{ text: string; special: boolean }> {
  let fragments: Array<{ text: string; special: boolean }> = [{ text, special: false }]
  for (const special of specials) {
    fragments = fragments.flatMap((f) => {
      if (f.special) return [f]
      const out: Array<{ text: string; special: boolean }> = []
      f.text.split(special).forEach((p, i) => {
        if (i > 0) out.push({ text: special, special: true })
        if (p) out.push({ text: p, special: false })
      })
      return out
    })
  }
  return fragments
}
