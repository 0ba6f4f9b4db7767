// Reasoning apart from the answer, for templates whose models think before they answer (Qwen 3,
// QwQ, DeepSeek-R1 and their distillations): which tags a template's model thinks between, told
// from what the template renders, and the parser that splits a turn's text into reasoning and
// content as it streams, as vLLM's reasoning parsers and llama.cpp's `--reasoning-format
// deepseek` do.
//
//   output    [whitespace] <think> reasoning </think> [whitespace] content
//   forced    reasoning </think> [whitespace] content       (the prompt already opened <think>)
//
// The reasoning is the text between the tags, its surrounding whitespace trimmed; the content is
// what follows the closing tag, its leading whitespace trimmed. Output that does not open the
// block (after leading whitespace) is all content; a block never closed is all reasoning. A tool
// call written inside the block is reasoning (as in vLLM and llama.cpp: the tool-call parser reads
// the content only).

import type { ChatMessage } from '../types'

/** The tags a template's model thinks between. */
export interface ReasoningFormat {
  start: string
  end: string
}

/** Where a turn's generation prompt leaves the block: `open` (it ends with the opening tag, as
 *  some templates write it for the model: the output begins inside the block), `closed` (it ends
 *  with an empty block: thinking is switched off, as Qwen 3's `enable_thinking: false` writes it),
 *  or `none` (the model may open one). */
export type PromptBlock = 'open' | 'closed' | 'none'

/** How one chat turn's text splits: the format, and where the prompt left the block. */
export interface ReasoningPlan {
  format: ReasoningFormat
  prompt: PromptBlock
}

const PROBE_THOUGHT = 'ortex probe thought'
const PROBE_ANSWER = 'ortex probe answer'
const PROBE_QUESTION = 'ortex probe question'
const THINK: ReasoningFormat = { start: '<think>', end: '</think>' }

/** A tag such as `<think>` or `<|begin_of_thought|>` at the end or start of a text. */
const TAG_AT_END = /<[^<>\s]{1,40}>$/
const TAG_AT_START = /^<[^<>\s]{1,40}>/

/**
 * The reasoning format of a template, told from what it renders (as tool families are told,
 * format.ts): a reply given `reasoning_content` that the template prints between two tags
 * (Qwen 3's); else an earlier reply whose content holds a `<think>` block that the template
 * removes (the templates of QwQ and DeepSeek-R1's distillations, which print no
 * `reasoning_content` but strip earlier thinking). Null for a template that does neither, or raises.
 */
export function detectReasoning(render: (messages: ChatMessage[]) => string): ReasoningFormat | null {
  const question: ChatMessage = { role: 'user', content: PROBE_QUESTION }
  const rendered = (messages: ChatMessage[]): string | null => {
    try {
      return render(messages)
    } catch {
      return null
    }
  }
  const printed = rendered([question, { role: 'assistant', content: PROBE_ANSWER, reasoning_content: PROBE_THOUGHT }])
  const at = printed?.indexOf(PROBE_THOUGHT) ?? -1
  if (printed != null && at >= 0) {
    const start = TAG_AT_END.exec(printed.slice(0, at).trimEnd())?.[0]
    const end = TAG_AT_START.exec(printed.slice(at + PROBE_THOUGHT.length).trimStart())?.[0]
    if (start !== undefined && end !== undefined) return { start, end }
  }
  // Such templates strip the thinking of replies before the last message only.
  const reply: ChatMessage = { role: 'assistant', content: `${THINK.start}\n${PROBE_THOUGHT}\n${THINK.end}\n\n${PROBE_ANSWER}` }
  const stripped = rendered([question, reply, { role: 'user', content: PROBE_QUESTION }])
  if (stripped != null && stripped.includes(PROBE_ANSWER) && !stripped.includes(PROBE_THOUGHT)) return THINK
  return null
}

/** Where a generation prompt leaves the block (whitespace after its last tag aside). */
export function promptBlock(format: ReasoningFormat, generationPrompt: string): PromptBlock {
  const prompt = generationPrompt.trimEnd()
  if (prompt.endsWith(format.start)) return 'open'
  return prompt.endsWith(format.end) ? 'closed' : 'none'
}

/** What a piece of output gave. */
export interface ReasoningPiece {
  reasoning: string
  content: string
}

type Mode = 'start' | 'reasoning' | 'content'

/**
 * Splits a turn's text into reasoning and content, fed piece by piece: the same parser gives a
 * stream's deltas and a finished turn's result, so the pieces add up to the result. Text that may
 * still be part of a tag, and whitespace that may turn out to be trimmed, wait for the next piece.
 */
export class ReasoningParser {
  private mode: Mode
  private held = ''
  /** Nothing of the section (reasoning, or content after the block) given yet: its leading
   *  whitespace is trimmed. */
  private sectionStart = true
  private seen = false
  private reasoningText = ''
  private contentText = ''
  private piece: ReasoningPiece = { reasoning: '', content: '' }

  constructor(private readonly plan: ReasoningPlan) {
    // A closed prompt still lets the output open a block (a model may think anyway): only an
    // open one decides the start.
    this.mode = plan.prompt === 'open' ? 'reasoning' : 'start'
    this.seen = plan.prompt === 'open'
  }

  push(text: string): ReasoningPiece {
    this.held += text
    this.run(false)
    return this.take()
  }

  /** The end of the output: what was held back is given (a block never closed is reasoning). */
  finish(): ReasoningPiece {
    this.run(true)
    return this.take()
  }

  /** The reasoning (null when the output had no block) and the content, after finish(). */
  result(): { reasoning: string | null; content: string } {
    return { reasoning: this.seen ? this.reasoningText : null, content: this.contentText }
  }

  private take(): ReasoningPiece {
    const out = this.piece
    this.piece = { reasoning: '', content: '' }
    return out
  }

  private run(ending: boolean): void {
    for (;;) {
      const before = this.mode
      if (this.mode === 'start') this.start(ending)
      else if (this.mode === 'reasoning') this.reasoning(ending)
      else this.content()
      if (this.mode === before) return
    }
  }

  /** Leading whitespace waits; the opening tag begins the block, anything else is content. */
  private start(ending: boolean): void {
    const { start } = this.plan.format
    const text = this.held.trimStart()
    if (text.startsWith(start)) {
      this.held = text.slice(start.length)
      this.seen = true
      this.mode = 'reasoning'
      return
    }
    if (!ending && (text.length === 0 || start.startsWith(text))) return
    // Not a block: the text is the content as the model wrote it.
    this.sectionStart = false
    this.mode = 'content'
  }

  private reasoning(ending: boolean): void {
    const { end } = this.plan.format
    if (this.sectionStart) {
      this.held = this.held.trimStart()
      if (this.held.length === 0) return
    }
    const at = this.held.indexOf(end)
    if (at >= 0) {
      this.emitReasoning(this.held.slice(0, at).trimEnd())
      this.held = this.held.slice(at + end.length)
      this.sectionStart = true
      this.mode = 'content'
      return
    }
    if (ending) {
      this.emitReasoning(this.held.trimEnd())
      this.held = ''
      return
    }
    // Keep what may begin the closing tag, and trailing whitespace that may precede it.
    const keep = this.held.length - partialSuffix(this.held, end)
    const safe = this.held.slice(0, keep).trimEnd().length
    this.emitReasoning(this.held.slice(0, safe))
    this.held = this.held.slice(safe)
  }

  private content(): void {
    if (this.sectionStart) {
      this.held = this.held.trimStart()
      if (this.held.length === 0) return
      this.sectionStart = false
    }
    this.emitContent(this.held)
    this.held = ''
  }

  private emitReasoning(text: string): void {
    if (text.length === 0) return
    this.sectionStart = false
    this.reasoningText += text
    this.piece.reasoning += text
  }

  private emitContent(text: string): void {
    if (text.length === 0) return
    this.contentText += text
    this.piece.content += text
  }
}

/** The length of the longest suffix of `text` that is a proper prefix of `word`. */
export function partialSuffix(text: string, word: string): number {
  for (let n = Math.min(word.length - 1, text.length); n > 0; n--) {
    if (text.endsWith(word.slice(0, n))) return n
  }
  return 0
}
