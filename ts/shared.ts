// Everything both entry points export besides their Engine class. Both import it from here, so a
// build shares one copy (one OrtexError class, one Request class) between `ortex` and
// `ortex/wasm`.

export { EventBuffer, EventFlags } from './events'
export type { EngineEvent } from './events'
export { ERROR_CODES, OrtexError } from './errors'
export type { ErrorCode } from './errors'
export { Request } from './request'
export { Turn } from './turn'
export type {
  BackendKind,
  Batching,
  EngineConfig,
  EngineOptions,
  EngineStats,
  EventErrorCode,
  FinishReason,
  GenerateOptions,
  RequestOptions,
  RequestState,
  SimulatedFaults,
  SimulatedOptions,
  TurnChunk,
  TurnOptions,
  TurnResult,
  TurnUsage,
} from './types'
