// Errors of the OpenAI-compatible API, in OpenAI's shape:
//   { "error": { "message": "...", "type": "invalid_request_error", "param": "temperature", "code": null } }
// Every failure of a request becomes one of these with a 4xx/5xx status; none reaches the process.

export type ApiErrorType =
  | 'invalid_request_error'
  | 'authentication_error'
  | 'not_found_error'
  | 'server_error'
  | 'engine_overloaded_error'

export class ApiError extends Error {
  constructor(
    readonly status: number,
    message: string,
    readonly type: ApiErrorType = 'invalid_request_error',
    readonly param: string | null = null,
    readonly code: string | null = null,
  ) {
    super(message)
    this.name = 'ApiError'
  }

  body(): { error: { message: string; type: ApiErrorType; param: string | null; code: string | null } } {
    return { error: { message: this.message, type: this.type, param: this.param, code: this.code } }
  }
}

/** 400 for parameter `param`. */
export function invalidParam(param: string, message: string, code: string | null = null): ApiError {
  return new ApiError(400, message, 'invalid_request_error', param, code)
}

/** 400 for a parameter this server does not support (n > 1, tools, response_format, ...). */
export function unsupportedParam(param: string, message: string): ApiError {
  return new ApiError(400, message, 'invalid_request_error', param, 'unsupported_parameter')
}
