// Everything both entry points export besides their Engine class. Both import it from here, so a
// build shares one copy (one OrtexError class, one Request class) between `ortex` and
// `ortex/wasm`.

export { EventBuffer, EventFlags } from './events'
export type { EngineEvent } from './events'
export { ERROR_CODES, OrtexError } from './errors'
export type { ErrorCode } from './errors'
export { Request, Turn } from './request'
export { Chat } from './chat'
export type {
  BackendKind,
  Batching,
  ChatMessage,
  ChatOptions,
  ChatTemplateOptions,
  CreateChatOptions,
  EngineConfig,
  Constraint,
  EngineOptions,
  EngineStats,
  EventErrorCode,
  ExecutorStats,
  NodePlacement,
  FinishReason,
  FunctionTool,
  GenerateOptions,
  GgufLoadEvent,
  GgufLoadOptions,
  LoadOptions,
  RequestOptions,
  RequestState,
  SimulatedFaults,
  SimulatedOptions,
  ToolCall,
  ToolChoice,
  ToolOptions,
  TurnChunk,
  TurnOptions,
  TurnResult,
  StopMatch,
  TokenLogprob,
  TurnUsage,
} from './types'
export { DuplexSessionManager } from './duplex/manager'
export type { DuplexSessionManagerOptions, SessionExpiry } from './duplex/manager'
export { DuplexSession } from './duplex/session'
export type {
  DuplexAppendOptions,
  DuplexAppendResult,
  DuplexSessionConfig,
  DuplexSessionOptions,
  DuplexTruncateOptions,
  RespondMode,
} from './duplex/session'
export type {
  Fence,
  ResponseCreatedEvent,
  ResponseDeltaEvent,
  ResponseDoneEvent,
  ResponseStatus,
  SessionClosedEvent,
  SessionEvent,
  SessionExpiredEvent,
  SessionState,
} from './duplex/events'
export { startDuplexServer } from './server/duplex/start'
export { DuplexServer } from './server/duplex/websocket'
export { OrtexServer, startServer } from './server/http'
export type { ServerOptions } from './server/http'
export type { DuplexServerOptions } from './server/duplex/start'
export type { DuplexServerStats } from './server/duplex/websocket'
export { RedisSessionStore } from './store/redis'
export type { RedisSessionStoreOptions } from './store/redis'
export { SessionStoreUnavailable } from './store/session-store'
export type { ClaimOutcome, SessionStore, StoredSession } from './store/session-store'
