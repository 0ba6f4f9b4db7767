// A chat turn's plans: the template's tool family and reasoning format (each told once per
// template), and the prompt and turn options a tool plan gives the turn.

import type { ChatHost } from '../chat'
import { invalidArgument } from '../errors'
import type { ChatMessage, ChatTemplateOptions, Constraint } from '../types'
import { type ToolFamily, type ToolPlan, detectFamily, promptMessages, templateTools, toolConstraint } from './format'
import { type PromptBlock, type ReasoningFormat, type ReasoningPlan, detectReasoning, promptBlock } from './reasoning'

const families = new WeakMap<object, ToolFamily>()
const reasoningFormats = new WeakMap<object, ReasoningFormat | null>()

/** The tool-call family of the host's template (a probe render through `render`, once per
 *  template). */
export function toolFamily(host: ChatHost, render: (messages: ChatMessage[], options: ChatTemplateOptions) => string): ToolFamily {
  const template = host.template()
  let family = families.get(template)
  if (family === undefined) {
    family = detectFamily((messages, tools) => render(messages, { tools }))
    families.set(template, family)
  }
  return family
}

/** How a turn's output splits into reasoning and content under the host's template (its format
 *  told by probe renders, once per template); null for a template whose model does not think
 *  between tags. `options` are the turn's template options: whether the generation prompt opens
 *  the block can depend on them (`enable_thinking`). */
export function reasoningPlan(host: ChatHost, render: (messages: ChatMessage[], options: ChatTemplateOptions) => string, options: ChatTemplateOptions): ReasoningPlan | null {
  const template = host.template()
  let format = reasoningFormats.get(template)
  if (format === undefined) {
    format = detectReasoning((messages) => render(messages, { addGenerationPrompt: false }))
    reasoningFormats.set(template, format)
  }
  if (format === null) return null
  let prompt: PromptBlock = 'none'
  try {
    prompt = promptBlock(format, render([{ role: 'user', content: 'ortex probe question' }], { addGenerationPrompt: true, variables: options.variables, templateName: options.templateName }))
  } catch {
    // The turn's own render will say what is wrong with its options.
  }
  return { format, prompt }
}

/**
 * The messages to render for a turn with `plan`; sets the template's tools and the turn's
 * constraint. A caller's own json or json_schema constraint is the generic format's reply schema;
 * a regex or lark one replaces the tool constraint of an `auto` turn; anything else is refused
 * beside tools (the other families' replies are free text around the calls). A reasoning plan
 * lets the constrained output think first.
 */
export function applyToolPlan(
  plan: ToolPlan,
  host: ChatHost,
  messages: ChatMessage[],
  templateOptions: ChatTemplateOptions,
  present: Map<string, unknown>,
  reasoning: ReasoningPlan | null,
): ChatMessage[] {
  const own = present.get('constraint') as Constraint | undefined
  templateOptions.tools = templateTools(plan)
  if (own !== undefined && plan.mode.kind === 'auto' && (own.type === 'regex' || own.type === 'lark')) {
    // The caller spelled the whole output (calls in the family's format included), as a vLLM
    // request with tools and its own structured output does: the output is still parsed.
    return promptMessages(plan, messages)
  }
  if (own !== undefined && (plan.family !== 'generic' || (own.type !== 'json' && own.type !== 'json_schema'))) {
    throw invalidArgument(
      `options.constraint cannot be combined with tools on this model (its template's tool format is ${plan.family}); ` +
        "only a json or json_schema constraint on a template without tool support (the generic format), or a regex or lark " +
        "one with toolChoice 'auto' (the whole output, calls included), can be; or set toolChoice: 'none'",
    )
  }
  present.set('constraint', toolConstraint(plan, own, (text) => singleToken(host, text), reasoning))
  return promptMessages(plan, messages)
}

function singleToken(host: ChatHost, text: string): number | null {
  try {
    const ids = host.tokenize(text)
    return ids.length === 1 ? ids[0]! : null
  } catch {
    return null
  }
}
