// The GGUF vocabulary -> a Hugging Face tokenizer.json (what the `tokenizers` crate loads),
// tokenizer_config.json and chat_template.jinja.
//
// tokenizer.ggml.model "gpt2" is a byte-level BPE: the tokens are already in GPT-2's byte-to-
// unicode alphabet, the merges are "left right" strings in rank order. Tokens of type CONTROL
// become special added tokens and USER_DEFINED ones plain added tokens: both are matched in the
// text before BPE, as llama.cpp's tokenizer_st_partition does. The pre-tokenizer is the one
// `tokenizer.ggml.pre` names, written as the Hugging Face pre-tokenizer that llama.cpp's regexes
// (llama-vocab.cpp) were taken from; an unknown name is refused rather than guessed.
//
// tokenizer.ggml.model "llama" (SentencePiece, as TinyLlama, Llama 2 and Mistral 7B files have) is
// converted the way transformers' LlamaConverter does: merges derived from the piece scores,
// byte fallback, "▁" for spaces with a prefix space when add_space_prefix.

import { OrtexError } from '../../errors'
import { GGUF_LIMITS, type GgufFile, Metadata } from './reader'

/** llama.cpp's token types (llama_token_type). */
export const TokenType = { NORMAL: 1, UNKNOWN: 2, CONTROL: 3, USER_DEFINED: 4, UNUSED: 5, BYTE: 6 } as const

export interface TokenizerConversion {
  tokenizerJson: string
  tokenizerConfigJson: string
  specialTokensMapJson: string
  /** tokenizer.chat_template, verbatim, when the file has one. */
  chatTemplate: string | undefined
  /** Tokens in the vocabulary (added tokens included). */
  size: number
  bosTokenId: number | undefined
  /** EOS, end-of-turn and end-of-message ids, deduplicated. */
  eosTokenIds: number[]
  padTokenId: number
  /** tokenizer.ggml.pre (or "sentencepiece"), for the summary. */
  preTokenizer: string
}

const LLAMA3_SPLIT =
  "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
const QWEN2_SPLIT =
  "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
const TEKKEN_SPLIT =
  '[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+'

const byteLevel = (useRegex: boolean) => ({ type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: useRegex })
const split = (regex: string) => ({ type: 'Split', pattern: { Regex: regex }, behavior: 'Isolated', invert: false })

interface PreTokenizer {
  pre_tokenizer: object
  /** Whole words found in the vocabulary skip the merges (llama.cpp's ignore_merges, Llama 3). */
  ignoreMerges: boolean
}

/** tokenizer.ggml.pre -> the Hugging Face pre-tokenizer its llama.cpp regexes come from. */
const PRE_TOKENIZERS: Readonly<Record<string, PreTokenizer>> = (() => {
  const gpt2: PreTokenizer = { pre_tokenizer: byteLevel(true), ignoreMerges: false }
  const digitsThenGpt2: PreTokenizer = {
    pre_tokenizer: { type: 'Sequence', pretokenizers: [{ type: 'Digits', individual_digits: true }, byteLevel(true)] },
    ignoreMerges: false,
  }
  const llama3: PreTokenizer = { pre_tokenizer: { type: 'Sequence', pretokenizers: [split(LLAMA3_SPLIT), byteLevel(false)] }, ignoreMerges: true }
  const qwen2: PreTokenizer = { pre_tokenizer: { type: 'Sequence', pretokenizers: [split(QWEN2_SPLIT), byteLevel(false)] }, ignoreMerges: false }
  const tekken: PreTokenizer = { pre_tokenizer: { type: 'Sequence', pretokenizers: [split(TEKKEN_SPLIT), byteLevel(false)] }, ignoreMerges: false }
  return {
    'gpt-2': gpt2,
    smollm: digitsThenGpt2,
    starcoder: digitsThenGpt2,
    'llama-bpe': llama3,
    llama3: llama3,
    'llama-v3': llama3,
    qwen2: qwen2,
    'deepseek-r1-qwen': qwen2,
    tekken: tekken,
  }
})()

export const SUPPORTED_PRE_TOKENIZERS: readonly string[] = Object.keys(PRE_TOKENIZERS)

function refuse(file: GgufFile, reason: string): never {
  throw new OrtexError('MODEL_LOAD', `${file.path}: ${reason}`)
}

interface Vocabulary {
  tokens: string[]
  /** Token string -> id (the strings are unique: readVocabulary refuses a duplicate). */
  ids: Map<string, number>
  types: number[]
  bos: number | undefined
  eos: number[]
  pad: number
  unk: number | undefined
  addBos: boolean
  addEos: boolean
}

function readVocabulary(file: GgufFile, m: Metadata): Vocabulary {
  const tokens = m.strings('tokenizer.ggml.tokens') ?? refuse(file, 'metadata "tokenizer.ggml.tokens" is missing (no vocabulary)')
  const types = m.numbers('tokenizer.ggml.token_type') ?? tokens.map(() => TokenType.NORMAL)
  if (types.length !== tokens.length) refuse(file, `tokenizer.ggml.token_type has ${types.length} entries for ${tokens.length} tokens`)
  const ids = tokenIds(file, tokens)
  const id = (key: string): number | undefined => {
    const v = m.count(key, undefined)
    if (v !== undefined && v >= tokens.length) refuse(file, `${key} ${v} is outside the vocabulary of ${tokens.length}`)
    return v
  }
  const bos = id('tokenizer.ggml.bos_token_id')
  const eosIds = ['tokenizer.ggml.eos_token_id', 'tokenizer.ggml.eot_token_id', 'tokenizer.ggml.eom_token_id'].map(id)
  const eos = [...new Set(eosIds.filter((x): x is number => x !== undefined))]
  if (eos.length === 0) refuse(file, 'metadata "tokenizer.ggml.eos_token_id" is missing')
  return {
    tokens,
    ids,
    types,
    bos,
    eos,
    pad: id('tokenizer.ggml.padding_token_id') ?? eos[0]!,
    unk: id('tokenizer.ggml.unknown_token_id'),
    addBos: m.boolean('tokenizer.ggml.add_bos_token', false),
    addEos: m.boolean('tokenizer.ggml.add_eos_token', false),
  }
}

/**
 * Each token's id. Two ids with one text are refused, as llama.cpp refuses them (its
 * llama_vocab::load asserts that every text has one id): one of the two could never be produced
 * by tokenizing, and a text keyed twice in tokenizer.json's vocabulary loses the other id.
 */
function tokenIds(file: GgufFile, tokens: string[]): Map<string, number> {
  const ids = new Map<string, number>()
  tokens.forEach((token, id) => {
    const first = ids.get(token)
    if (first !== undefined) refuse(file, `tokenizer.ggml.tokens holds ${JSON.stringify(token)} twice, as tokens ${first} and ${id} (a corrupt vocabulary)`)
    ids.set(token, id)
  })
  return ids
}

function addedToken(id: number, content: string, special: boolean) {
  return { id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special }
}

/** CONTROL and USER_DEFINED tokens, matched in the text before the model's own splitting. */
function addedTokens(v: Vocabulary) {
  const out: ReturnType<typeof addedToken>[] = []
  v.types.forEach((type, id) => {
    if (type === TokenType.CONTROL || type === TokenType.USER_DEFINED) out.push(addedToken(id, v.tokens[id]!, type === TokenType.CONTROL))
  })
  return out
}

/** BOS/EOS added around a single sequence when the file says so (the engine asks for none). */
function postProcessor(v: Vocabulary): object | null {
  if (!(v.addBos && v.bos !== undefined) && !(v.addEos && v.eos.length > 0)) return null
  const bos = v.addBos && v.bos !== undefined ? v.tokens[v.bos]! : undefined
  const eos = v.addEos ? v.tokens[v.eos[0]!]! : undefined
  const piece = (id: string) => ({ SpecialToken: { id, type_id: 0 } })
  const sequence = (type: string) => ({ Sequence: { id: type, type_id: 0 } })
  const single = [...(bos ? [piece(bos)] : []), sequence('A'), ...(eos ? [piece(eos)] : [])]
  const pair = [...single, ...(bos ? [piece(bos)] : []), sequence('B'), ...(eos ? [piece(eos)] : [])]
  const special: Record<string, object> = {}
  for (const [token, id] of [
    [bos, v.bos],
    [eos, v.eos[0]],
  ] as const) {
    if (token !== undefined && id !== undefined) special[token] = { id: token, ids: [id], tokens: [token] }
  }
  return { type: 'TemplateProcessing', single, pair, special_tokens: special }
}

function vocabObject(v: Vocabulary): Record<string, number> {
  return Object.fromEntries(v.ids)
}

/**
 * Each merge is "left right", and left, right and the merged left + right are tokens: the
 * tokenizers crate refuses to load a BPE whose merges name anything else ("Token `x` out of
 * vocabulary"), so the folder would not load.
 */
function checkMerges(file: GgufFile, merges: string[], v: Vocabulary): void {
  merges.forEach((merge, rank) => {
    const space = merge.indexOf(' ')
    if (space <= 0 || space === merge.length - 1 || merge.indexOf(' ', space + 1) >= 0) refuse(file, `the merge ${JSON.stringify(merge)} is not "left right"`)
    const left = merge.slice(0, space)
    const right = merge.slice(space + 1)
    for (const part of [left, right, left + right]) {
      if (!v.ids.has(part)) refuse(file, `tokenizer.ggml.merges[${rank}] ${JSON.stringify(merge)} names ${JSON.stringify(part)}, which is not in the vocabulary`)
    }
  })
}

function byteLevelBpe(file: GgufFile, m: Metadata, v: Vocabulary): { tokenizer: object; pre: string } {
  const pre = m.string('tokenizer.ggml.pre', undefined)
  if (pre === undefined) refuse(file, 'metadata "tokenizer.ggml.pre" is missing: the pre-tokenizer is unknown, and it is not guessed')
  const preTokenizer = PRE_TOKENIZERS[pre] ?? refuse(file, `the pre-tokenizer "${pre}" is not supported (supported: ${SUPPORTED_PRE_TOKENIZERS.join(', ')})`)
  const merges = m.strings('tokenizer.ggml.merges') ?? refuse(file, 'metadata "tokenizer.ggml.merges" is missing (a BPE vocabulary needs its merges)')
  checkMerges(file, merges, v)
  const tokenizer = {
    version: '1.0',
    truncation: null,
    padding: null,
    added_tokens: addedTokens(v),
    normalizer: null,
    pre_tokenizer: preTokenizer.pre_tokenizer,
    post_processor: postProcessor(v),
    decoder: byteLevel(true),
    model: {
      type: 'BPE',
      dropout: null,
      unk_token: null,
      continuing_subword_prefix: null,
      end_of_word_suffix: null,
      fuse_unk: false,
      byte_fallback: false,
      ignore_merges: preTokenizer.ignoreMerges,
      vocab: vocabObject(v),
      merges,
    },
  }
  return { tokenizer, pre }
}

/**
 * SentencePiece (tokenizer.ggml.model "llama") as transformers' LlamaConverter writes it: a BPE
 * whose merges are every split of a piece into two pieces, ranked by the merged piece's score
 * (SentencePieceExtractor), with byte fallback to the <0xXX> tokens.
 */
function sentencePiece(file: GgufFile, m: Metadata, v: Vocabulary): { tokenizer: object; pre: string } {
  const scores = m.numbers('tokenizer.ggml.scores') ?? refuse(file, 'metadata "tokenizer.ggml.scores" is missing (a SentencePiece vocabulary needs its scores)')
  if (scores.length !== v.tokens.length) refuse(file, `tokenizer.ggml.scores has ${scores.length} entries for ${v.tokens.length} tokens`)
  const vocab = vocabObject(v)
  const merges = sentencePieceMerges(file, v, scores)
  const addPrefix = m.boolean('tokenizer.ggml.add_space_prefix', true)
  const normalizers: object[] = [{ type: 'Replace', pattern: { String: ' ' }, content: '▁' }]
  if (addPrefix) normalizers.unshift({ type: 'Prepend', prepend: '▁' })
  const decoders: object[] = [
    { type: 'Replace', pattern: { String: '▁' }, content: ' ' },
    { type: 'ByteFallback' },
    { type: 'Fuse' },
  ]
  if (addPrefix) decoders.push({ type: 'Strip', content: ' ', start: 1, stop: 0 })
  const unk = v.unk === undefined ? null : v.tokens[v.unk]!
  const tokenizer = {
    version: '1.0',
    truncation: null,
    padding: null,
    added_tokens: addedTokens(v),
    normalizer: { type: 'Sequence', normalizers },
    pre_tokenizer: null,
    post_processor: postProcessor(v),
    decoder: { type: 'Sequence', decoders },
    model: {
      type: 'BPE',
      dropout: null,
      unk_token: unk,
      continuing_subword_prefix: null,
      end_of_word_suffix: null,
      fuse_unk: true,
      byte_fallback: true,
      ignore_merges: false,
      vocab,
      merges: merges.map((x) => [x.left, x.right]),
    },
  }
  return { tokenizer, pre: 'sentencepiece' }
}

/**
 * Limits on deriving SentencePiece merges: each piece is cut at every character and both halves
 * looked up, which costs the square of its length, and every cut whose halves are pieces is a merge.
 * Llama 2's 32,000 pieces cost about 10^6 and give 61,249 merges.
 */
export const SENTENCE_PIECE_LIMITS = {
  /** The sum over the pieces of their length squared (UTF-16 units). */
  work: 1 << 28,
  /** As many merges as the reader allows a BPE's merges array to hold. */
  merges: GGUF_LIMITS.arrayItems,
} as const

type SentencePieceMerge = { left: string; right: string; score: number; order: [number, number] }

/** Every split of a piece into two pieces, the merged piece's score first (SentencePieceExtractor). */
function sentencePieceMerges(file: GgufFile, v: Vocabulary, scores: number[]): SentencePieceMerge[] {
  const isPiece = (id: number) => v.types[id] === TokenType.NORMAL || v.types[id] === TokenType.USER_DEFINED
  const work = v.tokens.reduce((sum, piece, id) => (isPiece(id) ? sum + piece.length * piece.length : sum), 0)
  if (work > SENTENCE_PIECE_LIMITS.work) {
    refuse(file, `the SentencePiece pieces are too long to derive merges from: their squared lengths sum to ${work}, over the limit of ${SENTENCE_PIECE_LIMITS.work}`)
  }
  const merges: SentencePieceMerge[] = []
  for (let id = 0; id < v.tokens.length; id++) {
    if (!isPiece(id)) continue
    const piece = v.tokens[id]!
    for (let cut = 1; cut < piece.length; cut++) {
      if (isLowSurrogate(piece.charCodeAt(cut))) continue // cut between characters, not inside one
      const left = v.ids.get(piece.slice(0, cut))
      const right = v.ids.get(piece.slice(cut))
      if (left === undefined || right === undefined) continue
      if (merges.length === SENTENCE_PIECE_LIMITS.merges) refuse(file, `the SentencePiece pieces give more than ${SENTENCE_PIECE_LIMITS.merges} merges, the limit`)
      merges.push({ left: v.tokens[left]!, right: v.tokens[right]!, score: scores[id]!, order: [left, right] })
    }
  }
  merges.sort((a, b) => b.score - a.score || a.order[0] - b.order[0] || a.order[1] - b.order[1])
  return merges
}

const isLowSurrogate = (unit: number) => unit >= 0xdc00 && unit <= 0xdfff

const TOKENIZER_CLASS: Readonly<Record<string, string>> = {
  qwen2: 'Qwen2Tokenizer',
  'deepseek-r1-qwen': 'Qwen2Tokenizer',
  sentencepiece: 'LlamaTokenizerFast',
}

function tokenizerConfig(v: Vocabulary, pre: string, contextLength: number, chatTemplate: string | undefined): object {
  const decoder: Record<string, object> = {}
  for (const { id, ...rest } of addedTokens(v)) decoder[String(id)] = rest
  const name = (id: number | undefined) => (id === undefined ? null : v.tokens[id]!)
  return {
    add_bos_token: v.addBos,
    add_eos_token: v.addEos,
    added_tokens_decoder: decoder,
    bos_token: name(v.bos),
    ...(chatTemplate === undefined ? {} : { chat_template: chatTemplate }),
    clean_up_tokenization_spaces: false,
    eos_token: name(v.eos[0]),
    model_max_length: contextLength,
    pad_token: name(v.pad),
    tokenizer_class: TOKENIZER_CLASS[pre] ?? (pre === 'llama-bpe' || pre === 'llama3' || pre === 'llama-v3' ? 'PreTrainedTokenizerFast' : 'GPT2Tokenizer'),
    unk_token: name(v.unk),
  }
}

/** Converts the file's vocabulary; refuses what it cannot convert faithfully. */
export function convertTokenizer(file: GgufFile, contextLength: number): TokenizerConversion {
  const m = new Metadata(file)
  const kind = m.string('tokenizer.ggml.model', undefined)
  const v = readVocabulary(file, m)
  let converted: { tokenizer: object; pre: string }
  if (kind === 'gpt2') converted = byteLevelBpe(file, m, v)
  else if (kind === 'llama') converted = sentencePiece(file, m, v)
  else refuse(file, `the tokenizer model ${JSON.stringify(kind ?? null)} is not supported (gpt2 byte-level BPE and llama SentencePiece are)`)
  const chatTemplate = m.string('tokenizer.chat_template', undefined)
  const name = (id: number | undefined) => (id === undefined ? undefined : v.tokens[id])
  return {
    tokenizerJson: JSON.stringify(converted.tokenizer) + '\n',
    tokenizerConfigJson: JSON.stringify(tokenizerConfig(v, converted.pre, contextLength, chatTemplate), null, 2) + '\n',
    specialTokensMapJson:
      JSON.stringify({ bos_token: name(v.bos), eos_token: name(v.eos[0]), pad_token: name(v.pad), unk_token: name(v.unk) }, null, 2) + '\n',
    chatTemplate,
    size: v.tokens.length,
    bosTokenId: v.bos,
    eosTokenIds: v.eos,
    padTokenId: v.pad,
    preTokenizer: converted.pre,
  }
}
