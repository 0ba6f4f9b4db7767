// The public option, configuration and result shapes (docs/api.md). Every option is optional, and
// an option set to `undefined` counts as absent. Option objects are checked strictly: an unknown
// key (a misspelling such as `maxTokens`) throws INVALID_ARGUMENT naming it, because a silently
// ignored option is a trap; see validate.ts.
//
// The shapes the core answers with are generated from the Rust side (ts/generated/boundary.ts);
// ts/boundary-check.ts makes the build fail when one of these drifts from its generated twin.

import type { EVENT_ERROR_CODES, FINISH_REASONS, REQUEST_STATES, STOP_KINDS } from './generated/boundary'

export type Batching = 'dynamic' | 'static'
export type BackendKind = 'native' | 'wasm'

export interface EngineOptions {
  /** Default 'dynamic' (continuous batching). */
  batching?: Batching
  /** Tokens per KV block; default 16. */
  blockSize?: number
  /** KV pool size in blocks; default maxBatchSize * ceil(maxLength / blockSize), fewer where
   *  kvCacheBytes holds fewer. Not given together with kvCacheBytes. */
  numBlocks?: number
  /** Addition: most bytes the default KV pool may reserve (engine.config.kvCacheBytes says what
   *  it does); default for a model, a quarter of the machine's memory (os.totalmem() / 4). The
   *  simulated model keeps no KV bytes: there it bounds nothing. */
  kvCacheBytes?: number
  /** Rows per step; default 16. */
  maxBatchSize?: number
  /** Token budget per step (chunked prefill falls out of it); default 512. */
  maxScheduledTokens?: number
  /** Most prompt tokens one request may prefill in one step; default: the step budget. */
  prefillChunkSize?: number
  /** Addition: steps a waiting prefill may go without progress before it is scheduled ahead of
   *  decodes; default 4. */
  maxPrefillWaitSteps?: number
  /** Addition: most requests alive at once; default 65536. */
  maxRequests?: number
  /** Reuse the KV blocks of prompt prefixes other requests (or earlier turns) already computed;
   *  default true. false computes every prompt token, as before prefix caching existed. */
  prefixCaching?: boolean
  executionProvider?: 'cpu' | 'cuda'
  intraOpThreads?: number
  /** Addition: let the session's intra-op threads spin between operators, and for a short while
   *  after a run before they block (ONNX Runtime's own default, and onnxruntime-genai's). Faster
   *  steps where the cores are the engine's; default false (threads block at once, leaving the
   *  cores to the JavaScript thread and other work). */
  intraOpSpinning?: boolean
}

/** `Engine.load`'s options: the engine's, and how a GGUF file is imported. */
export interface LoadOptions extends EngineOptions {
  /** Only for a GGUF file (a model folder with it is INVALID_ARGUMENT): how it is imported. */
  gguf?: GgufLoadOptions
}

/**
 * How `Engine.load` imports a GGUF file into the cache on first use (docs/model-format.md,
 * "Importing GGUF files"; the import's options, as `ortex import` takes them). The options that
 * shape the folder are part of the cache's key: another value makes another import.
 */
export interface GgufLoadOptions {
  /** Default 'int4' (linear layers as 4-bit MatMulNBits blocks); 'fp32' dequantizes every weight. */
  weights?: 'int4' | 'fp32'
  /** The KV cache's element type; default fp16 with int4 weights, fp32 with fp32 weights. */
  kv?: 'fp16' | 'fp32'
  /** int4 only: MatMulNBits' accuracy_level, 4 (default: int8 activations) or 0 (float32). */
  accuracyLevel?: 0 | 4
  /** 'fp32' (default) or 'fp16': float weights, arithmetic, KV and logits (the CUDA folders). */
  dtype?: 'fp32' | 'fp16'
  /** 'gqa' (default) or 'paged'. */
  attention?: 'gqa' | 'paged'
  /** paged only: 'cuda' (default, needs dtype fp16) or 'reference'. */
  pagedKernel?: 'cuda' | 'reference'
  /** paged only: positions a KV block; default 256. */
  blockSize?: number
  /** The folder's context (rotary tables, maxLength): at most the file's context_length, the
   *  default; picks Phi's LongRoPE factors as llama.cpp's context size does. */
  contextLength?: number
  /** Threads that dequantize and requantize; default one per core. Not part of the key: the
   *  folder is the same byte for byte. */
  workers?: number
  /** Told what the load does with the file; Engine.load prints nothing by itself. */
  onProgress?: (event: GgufLoadEvent) => void
}

/**
 * A GGUF load's progress, in this order: `hashing` (reading the file for the sha256 that keys
 * the cache; skipped while the file is unchanged since its last hash), then `reused` (its import
 * is in the cache) or `importing` ... `imported` (the first load). `folder` is the import's
 * folder in the cache (what `engine.modelDir` then says).
 */
export type GgufLoadEvent =
  | { kind: 'hashing'; file: string; doneBytes: number; totalBytes: number }
  | { kind: 'reused'; file: string; folder: string }
  | { kind: 'importing'; file: string; folder: string; doneBytes: number; totalBytes: number }
  /** `summary`: the line `ortex import` prints. */
  | { kind: 'imported'; file: string; folder: string; summary: string; elapsedMs: number }

/** Injected failures of the simulated model, for simulation tests. Step numbers count every
 *  executed transaction from 0. */
export interface SimulatedFaults {
  /** Transactions that fail retryably (an engine-level Retryable event; nothing is lost). */
  retryableSteps?: number[]
  /** Transactions that fail fatally (an engine-level Failed event; the engine becomes unhealthy). */
  fatalSteps?: number[]
  /** Transactions that report execution capacity exceeded (engine-level CapacityBlocked). */
  capacitySteps?: number[]
  /** Chance per transaction of each failure kind, decided by a hash of (faults.seed, step). */
  retryableRate?: number
  capacityRate?: number
  fatalRate?: number
  seed?: number
}

export interface SimulatedOptions extends EngineOptions {
  /** Default 0; drives the simulated logits and EOS decisions. */
  seed?: number
  /** Default 32000. */
  vocabSize?: number
  /** Default 2. */
  eosTokenId?: number
  /** Default 2048. */
  maxLength?: number
  /** Chance per generated token of ending naturally; default 0. */
  eosProbability?: number
  faults?: SimulatedFaults
  /** Addition: virtual cost of one step and of one token, summed in `stats().virtualTimeUs`
   *  (nothing sleeps). */
  stepCostUs?: number
  tokenCostUs?: number
}

export interface RequestOptions {
  /** 0 / absent = the model's maxLength; above maxLength throws INVALID_ARGUMENT. */
  maxSessionTokens?: number
}

export interface TurnOptions {
  /** 0 / absent = until the session limit. */
  maxGeneratedTokens?: number
  /** Absent (or 0) = greedy. */
  temperature?: number
  topK?: number
  topP?: number
  /** Addition: in [0, 1]; drops tokens less likely than minP times the most likely one. 0 = off. */
  minP?: number
  /** Addition: in (0, 100]; a token anywhere in the request's context has its logit divided by
   *  this (multiplied when negative). 1 = off. Applies to greedy decoding too. */
  repetitionPenalty?: number
  /** Addition: in [-2, 2]; subtracted from the logit of every token this turn generated. */
  presencePenalty?: number
  /** Addition: in [-2, 2]; subtracted once per time this turn generated the token. */
  frequencyPenalty?: number
  /** Sampler seed; unseeded sampled turns derive one from (engine seed, request id, turn id). */
  seed?: number
  /** Keep generating past EOS. */
  ignoreEos?: boolean
  /** Token sequences that end the turn with finishReason 'stop' (matched by the core). */
  stopTokenIds?: number[][]
  /** Addition: tokens that end the turn with finishReason 'eos' besides the model's own (a chat
   *  template's end-of-turn token; engine.chat passes them itself). ignoreEos ignores them too. */
  eosTokenIds?: number[]
  /** Addition: record each generated token's log-probability and this many of the most likely
   *  alternatives (0..20): chunks carry `logprob`, the result `logprobs`. Absent: none (free). */
  logprobs?: number
  /** Addition: what the output must match (structured output), compiled with llguidance when
   *  the turn begins (a malformed or unsupported one throws INVALID_ARGUMENT naming what). Each
   *  step samples only tokens the grammar allows; the turn finishes 'eos' once it is complete.
   *  Not with ignoreEos. See docs/api.md, "Constraints". */
  constraint?: Constraint
  /** Strings that end the turn with finishReason 'stop' (matched by the facade in the streamed
   *  text; the text is cut before the stop string). */
  stop?: string[]
  /** Aborting cancels the turn. */
  signal?: AbortSignal
}

/** `TurnOptions.constraint`: any JSON object, a JSON Schema, a regular expression the whole
 *  output matches, or a Lark grammar in llguidance's dialect. */
export type Constraint =
  | { type: 'json' }
  | { type: 'json_schema'; schema: Record<string, unknown> | boolean }
  | { type: 'regex'; pattern: string }
  | { type: 'lark'; grammar: string }

export type GenerateOptions = TurnOptions & RequestOptions

/** A chat message as Hugging Face's `apply_chat_template` takes it: `role` and `content` (a
 *  string or a list of parts such as `{ type: 'text', text }`), and whatever else the model's
 *  template reads (`tool_calls`, `tool_call_id`, `reasoning_content`, ...). */
export interface ChatMessage {
  role: string
  content?: string | unknown[] | null
  [key: string]: unknown
}

/** How a conversation is rendered (the keyword arguments of `apply_chat_template`). */
export interface ChatTemplateOptions {
  /** End with the header of an assistant turn; default true. */
  addGenerationPrompt?: boolean
  /** Tool definitions (JSON schemas) for templates that take them. */
  tools?: unknown[]
  /** Documents for retrieval-augmented templates. */
  documents?: unknown[]
  /** A template by name when the folder has several (`tool_use`); default `default`. */
  templateName?: string
  /** Further template variables (`enable_thinking`, `date_string`). */
  variables?: Record<string, unknown>
}

/** How a chat's rendered prompt is tokenized. */
export interface ChatPromptOptions {
  /** Default false: text that came from messages, tools, documents and variables tokenizes as
   *  plain text, so a message that says `<|im_start|>` cannot open a turn; only what the template
   *  writes becomes control tokens (as OpenAI's API does). true: the rendered prompt's control
   *  strings all become control tokens wherever they came from (Hugging Face's and llama.cpp's
   *  default), for callers whose messages are trusted. */
  parseSpecialTokens?: boolean
}

/** A function the model may call, in OpenAI's shape: `parameters` is the JSON Schema its
 *  arguments validate against (default: any object). */
export interface FunctionTool {
  type: 'function'
  function: { name: string; description?: string; parameters?: Record<string, unknown>; strict?: boolean }
}

/** Whether and which tools a chat turn calls: `auto` (the model decides; the default with
 *  tools), `required` (at least one call), a named function (exactly that one), or `none`. */
export type ToolChoice = 'none' | 'auto' | 'required' | { type: 'function'; function: { name: string } }

/** A call the model made: `arguments` is JSON text that validates against the function's
 *  parameters whenever the call was constrained (required, named, or auto once a call starts). */
export interface ToolCall {
  id: string
  type: 'function'
  function: { name: string; arguments: string }
}

/** Tool calling on a chat (with `tools`, each a FunctionTool). */
export interface ToolOptions {
  /** Default 'auto' when `tools` are given. */
  toolChoice?: ToolChoice
  /** Several calls in one turn; default true. */
  parallelToolCalls?: boolean
}

/** engine.chat: a one-shot chat turn on its own request. */
export type ChatOptions = GenerateOptions & Omit<ChatTemplateOptions, 'addGenerationPrompt'> & ChatPromptOptions & ToolOptions

/** engine.createChat: a conversation on one request. */
export interface CreateChatOptions extends RequestOptions, Omit<ChatTemplateOptions, 'addGenerationPrompt'>, ChatPromptOptions, ToolOptions {
  /** The system message the conversation starts with. */
  system?: string
}

export interface EngineConfig {
  batching: Batching
  blockSize: number
  numBlocks: number
  /** Bytes the KV pool reserves (numBlocks * blockSize * kvPositionBytes; 0 for the simulated model). */
  kvCacheBytes: number
  /** Bytes of KV one token position takes (all layers, keys and values; 0 for the simulated model). */
  kvPositionBytes: number
  maxBatchSize: number
  maxScheduledTokens: number
  prefillChunkSize: number
  maxPrefillWaitSteps: number
  maxRequests: number
  prefixCaching: boolean
  vocabSize: number
  eosTokenIds: number[]
  maxLength: number
}

export interface EngineStats {
  totalBlocks: number
  /** Blocks held only by a prefix cache count as free. */
  freeBlocks: number
  activeRequests: number
  pendingTurns: number
  retainedEvents: number
  steps: number
  promptTokens: number
  generatedTokens: number
  /** Addition: the simulated model's virtual time (0 for real models). */
  virtualTimeUs: number
  /** Full blocks published in the prefix cache (held by a request or evictable). */
  cachedBlocks: number
  /** Blocks looked up in the prefix cache at admissions, and how many of them were found. */
  prefixCacheLookups: number
  prefixCacheHits: number
}

/** Addition: where a real model's steps spend their time, cumulative since load (microseconds).
 *  gatherUs: building the inputs, mostly copying each row's past out of the paged KV cache;
 *  runUs: inside ONNX Runtime; scatterUs: copying logits out and the new keys/values into the
 *  paged cache; executeUs: all of a step's executor time. */
/** Addition: where ONNX Runtime placed a model's nodes (Engine.nodePlacement()). */
export interface NodePlacement {
  /** The provider the engine asked for. */
  executionProvider: 'cpu' | 'cuda'
  /** Per execution provider ('CUDAExecutionProvider', 'CPUExecutionProvider'), its nodes counted by
   *  op type (`domain:OpType` outside the ONNX domain, e.g. 'com.microsoft:GroupQueryAttention'). */
  providers: Record<string, Record<string, number>>
  /** For 'cuda': the nodes ONNX Runtime runs on the CPU instead, in one sentence ("12 of 340
   *  nodes run on the CPU, not CUDAExecutionProvider: Shape x4, ..."); null when none do, and on
   *  the CPU. Engine.load also emits it as a process warning (code ORTEX_CUDA_CPU_FALLBACK). */
  cpuFallback: string | null
}

export interface ExecutorStats {
  steps: number
  /** Model runs: a step needs one per group of rows the attention form can batch. */
  invocations: number
  rows: number
  tokens: number
  /** Decode runs that took the previous step's KV as their past with no gather. */
  carried: number
  gatherUs: number
  runUs: number
  scatterUs: number
  executeUs: number
  /** Model memory the kernel backs with 2 MiB pages, collapsed at load (0 when none). */
  hugePageBytes: number
  /** What ONNX Runtime allocated while it built the session, packed into 2 MiB-aligned chunks so
   *  that it can go on huge pages (0 when off). */
  weightChunkBytes: number
  /** The paged KV store, all layers, keys and values. */
  kvStoreBytes: number
  /** What one token position takes in the KV store, in the model's KV element type. */
  kvPositionBytes: number
  /** Rounds of steps run one position per model run (a graph that cannot run a prefill chunk
   *  after a past). */
  positionRounds: number
  /** Host inputs sent to the model (ids, masks, positions, block tables, lengths, logits
   *  indices); under CUDA, what crosses to the device besides any KV. */
  hostInputBytes: number
  /** Logits the model returned. */
  logitsBytes: number
  /** KV copied between the host KV store and the model's tensors (0 for a paged-attention
   *  folder, whose KV pool the model reads and writes in place). */
  kvCopiedBytes: number
}

/** 'created' | 'queued' | 'active' | 'turn-complete' | 'closed' */
export type RequestState = (typeof REQUEST_STATES)[number]

/** 'none' | 'eos' | 'stop' | 'max-generated-tokens' | 'max-session-tokens' | 'cancelled' | 'failed' */
export type FinishReason = (typeof FINISH_REASONS)[number]

/** 'none' | 'capacity-deferred' | 'execution-capacity-exceeded' | 'retryable-execution' |
 *  'request-unserviceable' | 'engine-contract-failure' | 'engine-execution-failure' */
export type EventErrorCode = (typeof EVENT_ERROR_CODES)[number]

export interface TurnUsage {
  /** This turn's new input only. */
  promptTokens: number
  generatedTokens: number
  /** Of promptTokens, those whose KV came from the prefix cache instead of being computed
   *  (whole blocks another request or an earlier turn published); 0 with prefixCaching false. */
  cachedPromptTokens: number
}

export interface TurnChunk {
  token: number
  text: string
  /** Present when the turn asked for `logprobs`. */
  logprob?: TokenLogprob
}

/** A generated token's natural-log probability under the model's own distribution (the softmax
 *  of its raw logits, before penalties, temperature and cuts; the simulated model's over its 8
 *  candidates), with the most likely alternatives, best first. */
export interface TokenLogprob {
  token: number
  logprob: number
  /** The token's text, decoded alone (a piece of a character decodes to U+FFFD). */
  text: string
  top: { token: number; logprob: number; text: string }[]
}

/** Which stop sequence ended a turn: `stopTokenIds[index]` ('token-ids', matched by the core) or
 *  `stop[index]` ('string', matched in the text). */
export interface StopMatch {
  kind: Exclude<(typeof STOP_KINDS)[number], 'none'>
  index: number
}

export interface TurnResult {
  finishReason: FinishReason
  errorCode: EventErrorCode
  usage: TurnUsage
  tokens: Int32Array
  text: string
  /** Set when finishReason is 'stop': which stop sequence it was (addition). */
  stop: StopMatch | null
  /** With `logprobs`: one entry per token of `tokens` (addition). */
  logprobs?: TokenLogprob[]
  /** A chat turn with tools: the calls the model made (empty when it answered in text). */
  toolCalls?: ToolCall[]
  /** A chat turn with tools, or whose template thinks between tags: the text for the user,
   *  without the calls' markup and the reasoning block (null when the turn was only calls, or
   *  only reasoning); `text` stays what the model wrote. */
  content?: string | null
  /** A chat turn whose template thinks between tags (Qwen 3's `<think>`): the thinking, trimmed;
   *  null when the turn did not think. */
  reasoning?: string | null
}
