// A chat turn's output read the way its template's model writes it: the reasoning apart
// (reasoning.ts), then tool calls in the content (parse.ts). One parser gives a stream's deltas
// (the OpenAI server's) and the finished turn's result, so the pieces a stream sends add up to
// the result.

import type { Turn } from '../request'
import type { ToolCall, TurnResult } from '../types'
import type { ToolPlan } from './format'
import { toolCallParser } from './options'
import type { ToolCallDelta, ToolCallParser } from './parse'
import { type ReasoningPlan, ReasoningParser } from './reasoning'

/** How a chat turn's output is read; a turn with neither is plain text. */
export interface OutputPlan {
  tools: ToolPlan | null
  reasoning: ReasoningPlan | null
}

export interface OutputPiece {
  reasoning: string
  content: string
  calls: ToolCallDelta[]
}

export interface ParsedTurn {
  /** The thinking, trimmed; null when the output had no block (or the template has none). */
  reasoning: string | null
  /** The answer without the block and the calls' markup; null when there is none (a turn of only
   *  calls, or only reasoning). */
  content: string | null
  toolCalls: ToolCall[]
}

export class OutputParser {
  private readonly reasoning: ReasoningParser | null
  private readonly tools: ToolCallParser | null
  private content = ''

  constructor(plan: OutputPlan) {
    this.reasoning = plan.reasoning === null ? null : new ReasoningParser(plan.reasoning)
    this.tools = plan.tools === null ? null : toolCallParser(plan.tools)
  }

  push(text: string): OutputPiece {
    const split = this.reasoning === null ? { reasoning: '', content: text } : this.reasoning.push(text)
    return this.contentPiece(split.reasoning, split.content, false)
  }

  finish(): OutputPiece {
    const split = this.reasoning === null ? { reasoning: '', content: '' } : this.reasoning.finish()
    return this.contentPiece(split.reasoning, split.content, true)
  }

  /** What the whole output parsed into (after finish()). */
  result(): ParsedTurn {
    const reasoning = this.reasoning === null ? null : this.reasoning.result().reasoning
    if (this.tools !== null) return { reasoning, ...this.tools.result() }
    const content = reasoning !== null && this.content.length === 0 ? null : this.content
    return { reasoning, content, toolCalls: [] }
  }

  private contentPiece(reasoning: string, text: string, ending: boolean): OutputPiece {
    if (this.tools === null) {
      this.content += text
      return { reasoning, content: text, calls: [] }
    }
    const piece = this.tools.push(text)
    if (!ending) return { reasoning, ...piece }
    const last = this.tools.finish()
    return { reasoning, content: piece.content + last.content, calls: [...piece.calls, ...last.calls] }
  }
}

/** `result` with what its text parses into under `plan`. */
export function parsedResult(plan: OutputPlan, result: TurnResult): TurnResult {
  const parser = new OutputParser(plan)
  parser.push(result.text)
  parser.finish()
  const { reasoning, content, toolCalls } = parser.result()
  const parsed: TurnResult = { ...result, content }
  if (plan.tools !== null) parsed.toolCalls = toolCalls
  if (plan.reasoning !== null) parsed.reasoning = reasoning
  return parsed
}

/** Each chat turn with an output plan: the server streams its parts with it. */
const plans = new WeakMap<Turn, OutputPlan>()

/** A chat turn begun with `plan` (tools, reasoning, or both): its result will carry the parts.
 *  `done` becomes the parsed result (a view over the turn's own, whenever it finished), so
 *  nothing of the turn's machinery knows about them. */
export function attachOutputPlan(turn: Turn, plan: OutputPlan): void {
  if (plan.tools === null && plan.reasoning === null) return
  plans.set(turn, plan)
  const done = turn.done.then((result) => {
    try {
      return parsedResult(plan, result)
    } catch {
      // A turn's end never rejects: text the parser could not read is all content.
      const fallback: TurnResult = { ...result, content: result.text }
      if (plan.tools !== null) fallback.toolCalls = []
      if (plan.reasoning !== null) fallback.reasoning = null
      return fallback
    }
  })
  Object.defineProperty(turn, 'done', { value: done, enumerable: true })
}

/** The output plan `turn` was begun with; null for a plain turn. */
export function outputPlanOf(turn: Turn): OutputPlan | null {
  return plans.get(turn) ?? null
}
