// genai_config.json: onnxruntime-genai's model configuration, with exactly the fields (and key
// order) that onnxruntime-genai's model builder writes for a CPU decoder-only model. onnxruntime-
// genai rejects unknown fields, so nothing ortex-specific goes here (that lives in model.onnx's
// metadata_props, see docs/model-format.md). The tensor names are the folder contract's
// (ts/generated/folder-contract.ts, from ortex-ort's config: what ortex reads them as).

import { readFileSync } from 'node:fs'
import { join } from 'node:path'
import { DECODER_INPUTS, DECODER_OUTPUTS, PAGED_INPUTS } from '../generated/folder-contract'
import type { AttentionForm, DecoderDims } from './decoder'

export interface GenaiConfigOptions {
  dims: DecoderDims
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
  /** The paged form's cache block size (engine.dynamic_batching.block_size). */
  blockSize?: number
  /** session_options.provider_options as the builder's `-e cuda` writes them; default the CPU's (none). */
  provider?: 'cpu' | 'cuda'
}

/**
 * The paged form's defaults as the builder writes them (base.py make_genai_config:
 * max_batch_size 100, gpu_utilization_factor 0.6 when num_blocks is not given).
 */
const PAGED_MAX_BATCH_SIZE = 100
const PAGED_GPU_UTILIZATION_FACTOR = 0.6

export function genaiConfig(o: GenaiConfigOptions): object {
  const d = o.dims
  const paged = o.attention === 'paged'
  if (paged && o.blockSize === undefined) throw new Error('the paged form needs its block size')
  const inputs: Record<string, string> = { input_ids: DECODER_INPUTS.input_ids }
  if (!paged) inputs.attention_mask = DECODER_INPUTS.attention_mask
  if (o.attention === 'mha') inputs.position_ids = DECODER_INPUTS.position_ids
  // base.py make_genai_config: the paged inputs in this order, no attention_mask and (rotary in
  // the kernel) no position_ids.
  if (paged) for (const key of PAGED_INPUTS) inputs[key] = DECODER_INPUTS[key]
  inputs.past_key_names = DECODER_INPUTS.past_key_names
  inputs.past_value_names = DECODER_INPUTS.past_value_names
  // base.py ep_attrs["cuda"]: the builder's `-e cuda` folders name the CUDA provider.
  const providerOptions = o.provider === 'cuda' ? [{ cuda: { enable_cuda_graph: '0' } }] : []
  const config = {
    model: {
      bos_token_id: o.bosTokenId,
      context_length: d.contextLength,
      decoder: {
        session_options: { log_id: 'onnxruntime-genai', provider_options: providerOptions },
        filename: o.filename,
        head_size: d.headSize,
        hidden_size: d.hiddenSize,
        inputs,
        outputs: {
          logits: DECODER_OUTPUTS.logits,
          present_key_names: DECODER_OUTPUTS.present_key_names,
          present_value_names: DECODER_OUTPUTS.present_value_names,
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
        // base.py make_decoder_state_groups: every attention layer in one paged KV group.
        ...(paged ? { state_groups: [{ kind: 'paged_kv', layer_ids: Array.from({ length: d.numLayers }, (_, l) => l) }] } : {}),
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
      // The builder sets this for GroupQueryAttention and PagedAttention models (onnxruntime-genai
      // then gives past and present one buffer); a plain-operator model concatenates, so it cannot share.
      past_present_share_buffer: o.attention !== 'mha',
      repetition_penalty: 1.0,
      temperature: 1.0,
      top_k: 50,
      top_p: 1.0,
    },
  }
  if (!paged) return config
  const dynamic_batching = {
    block_size: o.blockSize,
    max_batch_size: PAGED_MAX_BATCH_SIZE,
    gpu_utilization_factor: PAGED_GPU_UTILIZATION_FACTOR,
  }
  return { ...config, engine: { dynamic_batching } }
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
  /** The paged form (decoder.inputs has block_table): its cache block size. */
  paged?: { blockSize: number }
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
    inputIds: inputs.input_ids ?? DECODER_INPUTS.input_ids,
    attentionMask: inputs.attention_mask ?? DECODER_INPUTS.attention_mask,
    ...(inputs.position_ids ? { positionIds: inputs.position_ids as string } : {}),
    pastKeyNames: inputs.past_key_names ?? DECODER_INPUTS.past_key_names,
    pastValueNames: inputs.past_value_names ?? DECODER_INPUTS.past_value_names,
    logits: outputs.logits ?? DECODER_OUTPUTS.logits,
    presentKeyNames: outputs.present_key_names ?? DECODER_OUTPUTS.present_key_names,
    presentValueNames: outputs.present_value_names ?? DECODER_OUTPUTS.present_value_names,
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
    ...(inputs.block_table ? { paged: { blockSize: int(j?.engine?.dynamic_batching?.block_size, 'engine.dynamic_batching.block_size') } } : {}),
  }
}

/** Expands a "%d" name template for layer `l`. */
export function layerName(template: string, l: number): string {
  return template.replace('%d', String(l))
}
