// genai_config.json: onnxruntime-genai's model configuration, with exactly the fields (and key
// order) that onnxruntime-genai's model builder writes for a CPU decoder-only model. onnxruntime-
// genai rejects unknown fields, so nothing ortex-specific goes here (that lives in model.onnx's
// metadata_props, see docs/model-format.md).

import { readFileSync } from 'node:fs'
import { join } from 'node:path'
import type { AttentionForm, LlamaDims } from './llama'

export interface GenaiConfigOptions {
  dims: LlamaDims
  attention: AttentionForm
  filename: string
  bosTokenId: number
  /** One id or several (onnxruntime-genai accepts both). */
  eosTokenId: number | number[]
  padTokenId: number
  /** model.type; default "llama". */
  modelType?: string
  /** model.decoder.sliding_window, as the builder writes it: the window and its layers (none
   *  listed: every layer). */
  slidingWindow?: { windowSize: number; layers: number[] }
}

export function genaiConfig(o: GenaiConfigOptions): object {
  const d = o.dims
  const inputs: Record<string, string> = { input_ids: 'input_ids', attention_mask: 'attention_mask' }
  if (o.attention === 'mha') inputs.position_ids = 'position_ids'
  inputs.past_key_names = 'past_key_values.%d.key'
  inputs.past_value_names = 'past_key_values.%d.value'
  return {
    model: {
      bos_token_id: o.bosTokenId,
      context_length: d.contextLength,
      decoder: {
        session_options: { log_id: 'onnxruntime-genai', provider_options: [] },
        filename: o.filename,
        head_size: d.headSize,
        hidden_size: d.hiddenSize,
        inputs,
        outputs: {
          logits: 'logits',
          present_key_names: 'present.%d.key',
          present_value_names: 'present.%d.value',
        },
        num_attention_heads: d.numHeads,
        num_hidden_layers: d.numLayers,
        num_key_value_heads: d.numKvHeads,
        ...(o.slidingWindow
          ? {
              sliding_window: {
                window_size: o.slidingWindow.windowSize,
                slide_key_value_cache: false,
                slide_inputs: false,
                layers: o.slidingWindow.layers,
                cache_slack: 0,
              },
            }
          : {}),
      },
      eos_token_id: o.eosTokenId,
      pad_token_id: o.padTokenId,
      type: o.modelType ?? 'llama',
      vocab_size: d.vocabSize,
    },
    search: {
      diversity_penalty: 0.0,
      do_sample: false,
      early_stopping: true,
      length_penalty: 1.0,
      max_length: d.contextLength,
      min_length: 0,
      no_repeat_ngram_size: 0,
      num_beams: 1,
      num_return_sequences: 1,
      // The builder sets this for GroupQueryAttention models (onnxruntime-genai then gives past and
      // present one max_length buffer); a plain-operator model concatenates, so it cannot share.
      past_present_share_buffer: o.attention === 'gqa',
      repetition_penalty: 1.0,
      temperature: 1.0,
      top_k: 50,
      top_p: 1.0,
    },
  }
}

/** What a reader (the reference loop, tests) needs from a model folder's genai_config.json. */
export interface ModelConfig {
  dir: string
  filename: string
  vocabSize: number
  contextLength: number
  bosTokenId: number
  eosTokenIds: number[]
  padTokenId: number
  hiddenSize: number
  headSize: number
  numHeads: number
  numKvHeads: number
  numLayers: number
  inputIds: string
  attentionMask: string
  /** Absent when the model takes no position_ids (GroupQueryAttention with internal rotary). */
  positionIds?: string
  pastKeyNames: string
  pastValueNames: string
  logits: string
  presentKeyNames: string
  presentValueNames: string
  maxLength: number
  pastPresentShareBuffer: boolean
  /** model.decoder.sliding_window: the window and its layers (empty: every layer). */
  slidingWindow?: { windowSize: number; layers: number[] }
}

export function readModelConfig(dir: string): ModelConfig {
  const file = join(dir, 'genai_config.json')
  let j: any
  try {
    j = JSON.parse(readFileSync(file, 'utf8'))
  } catch (e) {
    throw new Error(`${file}: ${(e as Error).message}`)
  }
  const m = j?.model
  const dec = m?.decoder
  const need = (v: unknown, what: string): any => {
    if (v === undefined || v === null) throw new Error(`${file}: missing ${what}`)
    return v
  }
  const int = (v: unknown, what: string): number => {
    need(v, what)
    if (!Number.isInteger(v) || (v as number) < 0) throw new Error(`${file}: ${what} must be a non-negative integer`)
    return v as number
  }
  const eos = need(m?.eos_token_id, 'model.eos_token_id')
  const inputs = need(dec?.inputs, 'model.decoder.inputs')
  const outputs = need(dec?.outputs, 'model.decoder.outputs')
  return {
    dir,
    filename: need(dec?.filename, 'model.decoder.filename'),
    vocabSize: int(m?.vocab_size, 'model.vocab_size'),
    contextLength: int(m?.context_length, 'model.context_length'),
    bosTokenId: int(m?.bos_token_id, 'model.bos_token_id'),
    eosTokenIds: Array.isArray(eos) ? eos : [eos],
    padTokenId: int(m?.pad_token_id, 'model.pad_token_id'),
    hiddenSize: int(dec?.hidden_size, 'model.decoder.hidden_size'),
    headSize: int(dec?.head_size, 'model.decoder.head_size'),
    numHeads: int(dec?.num_attention_heads, 'model.decoder.num_attention_heads'),
    numKvHeads: int(dec?.num_key_value_heads, 'model.decoder.num_key_value_heads'),
    numLayers: int(dec?.num_hidden_layers, 'model.decoder.num_hidden_layers'),
    inputIds: inputs.input_ids ?? 'input_ids',
    attentionMask: inputs.attention_mask ?? 'attention_mask',
    ...(inputs.position_ids ? { positionIds: inputs.position_ids as string } : {}),
    pastKeyNames: inputs.past_key_names ?? 'past_key_values.%d.key',
    pastValueNames: inputs.past_value_names ?? 'past_key_values.%d.value',
    logits: outputs.logits ?? 'logits',
    presentKeyNames: outputs.present_key_names ?? 'present.%d.key',
    presentValueNames: outputs.present_value_names ?? 'present.%d.value',
    maxLength: j?.search?.max_length ?? m.context_length,
    pastPresentShareBuffer: j?.search?.past_present_share_buffer === true,
    ...(dec?.sliding_window
      ? {
          slidingWindow: {
            windowSize: int(dec.sliding_window.window_size, 'model.decoder.sliding_window.window_size'),
            layers: (dec.sliding_window.layers ?? []) as number[],
          },
        }
      : {}),
  }
}

/** Expands a "%d" name template for layer `l`. */
export function layerName(template: string, l: number): string {
  return template.replace('%d', String(l))
}
