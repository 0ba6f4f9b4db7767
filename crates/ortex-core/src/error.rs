//! Typed errors of the core's public boundary. Every variant has a stable code string; the
//! TypeScript `OrtexError.code` carries exactly that string.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    InvalidArgument,
    RequestClosed,
    TurnActive,
    EventsPending,
    WrongEngine,
    EngineClosed,
    EngineUnhealthy,
    EngineDriven,
    ModelLoad,
    Unsupported,
    CapacityExhausted,
    SessionExists,
    SessionClosed,
    FenceMismatch,
    StaleReservation,
    LeaseGenerationMismatch,
    OperationReused,
    /// A second `run` was started while a transaction is still executing off-thread.
    RunInProgress,
    /// Chat templates (crates/ortex-chat's codes, carried as they are): the model folder has no
    /// template (or not the one named), the template does not parse, the template rejected the
    /// conversation (`raise_exception`), rendering failed otherwise, the template needs the time
    /// and none was given, or the chat files are malformed JSON.
    ChatTemplateMissing,
    ChatTemplateInvalid,
    ChatTemplateRaised,
    ChatTemplateFailed,
    ChatTimeMissing,
    ChatConfigInvalid,
}

impl ErrorCode {
    /// Every code, in the order the TypeScript side lists them.
    pub const ALL: [ErrorCode; 24] = [
        ErrorCode::InvalidArgument,
        ErrorCode::RequestClosed,
        ErrorCode::TurnActive,
        ErrorCode::EventsPending,
        ErrorCode::WrongEngine,
        ErrorCode::EngineClosed,
        ErrorCode::EngineUnhealthy,
        ErrorCode::EngineDriven,
        ErrorCode::ModelLoad,
        ErrorCode::Unsupported,
        ErrorCode::CapacityExhausted,
        ErrorCode::SessionExists,
        ErrorCode::SessionClosed,
        ErrorCode::FenceMismatch,
        ErrorCode::StaleReservation,
        ErrorCode::LeaseGenerationMismatch,
        ErrorCode::OperationReused,
        ErrorCode::RunInProgress,
        ErrorCode::ChatTemplateMissing,
        ErrorCode::ChatTemplateInvalid,
        ErrorCode::ChatTemplateRaised,
        ErrorCode::ChatTemplateFailed,
        ErrorCode::ChatTimeMissing,
        ErrorCode::ChatConfigInvalid,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidArgument => "INVALID_ARGUMENT",
            ErrorCode::RequestClosed => "REQUEST_CLOSED",
            ErrorCode::TurnActive => "TURN_ACTIVE",
            ErrorCode::EventsPending => "EVENTS_PENDING",
            ErrorCode::WrongEngine => "WRONG_ENGINE",
            ErrorCode::EngineClosed => "ENGINE_CLOSED",
            ErrorCode::EngineUnhealthy => "ENGINE_UNHEALTHY",
            ErrorCode::EngineDriven => "ENGINE_DRIVEN",
            ErrorCode::ModelLoad => "MODEL_LOAD",
            ErrorCode::Unsupported => "UNSUPPORTED",
            ErrorCode::CapacityExhausted => "CAPACITY_EXHAUSTED",
            ErrorCode::SessionExists => "SESSION_EXISTS",
            ErrorCode::SessionClosed => "SESSION_CLOSED",
            ErrorCode::FenceMismatch => "FENCE_MISMATCH",
            ErrorCode::StaleReservation => "STALE_RESERVATION",
            ErrorCode::LeaseGenerationMismatch => "LEASE_GENERATION_MISMATCH",
            ErrorCode::OperationReused => "OPERATION_REUSED",
            ErrorCode::RunInProgress => "RUN_IN_PROGRESS",
            ErrorCode::ChatTemplateMissing => "CHAT_TEMPLATE_MISSING",
            ErrorCode::ChatTemplateInvalid => "CHAT_TEMPLATE_INVALID",
            ErrorCode::ChatTemplateRaised => "CHAT_TEMPLATE_RAISED",
            ErrorCode::ChatTemplateFailed => "CHAT_TEMPLATE_FAILED",
            ErrorCode::ChatTimeMissing => "CHAT_TIME_MISSING",
            ErrorCode::ChatConfigInvalid => "CHAT_CONFIG_INVALID",
        }
    }

    /// Retryable errors describe a temporary condition: the same call may succeed later.
    pub const fn retryable(self) -> bool {
        matches!(self, ErrorCode::CapacityExhausted | ErrorCode::RunInProgress)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrtexError {
    pub code: ErrorCode,
    pub message: String,
}

impl OrtexError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        OrtexError { code, message: message.into() }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        OrtexError::new(ErrorCode::InvalidArgument, message)
    }
}

impl fmt::Display for OrtexError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code.as_str(), self.message)
    }
}

impl std::error::Error for OrtexError {}

pub type Result<T, E = OrtexError> = std::result::Result<T, E>;
