// A chat turn with a tool plan: the template's family (told once per template), and the prompt
// and turn options the plan gives it.

import type { ChatHost } from '../chat'
import { invalidArgument } from '../errors'
import type { ChatMessage, ChatTemplateOptions, Constraint } from '../types'
import { type ToolFamily, type ToolPlan, detectFamily, promptMessages, templateTools, toolConstraint } from './format'

const families = new WeakMap<object, ToolFamily>()

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

/**
 * The messages to render for a turn with `plan`; sets the template's tools and the turn's
 * constraint. A caller's own constraint is the generic format's reply schema; other families
 * refuse it beside tools (their replies are free text around the calls).
 */
export function applyToolPlan(plan: ToolPlan, host: ChatHost, messages: ChatMessage[], templateOptions: ChatTemplateOptions, present: Map<string, unknown>): ChatMessage[] {
  const own = present.get('constraint') as Constraint | undefined
  if (own !== undefined && (plan.family !== 'generic' || (own.type !== 'json' && own.type !== 'json_schema'))) {
    throw invalidArgument(
      `options.constraint cannot be combined with tools on this model (its template's tool format is ${plan.family}); ` +
        "only a json or json_schema constraint on a template without tool support (the generic format) can be, or set toolChoice: 'none'",
    )
  }
  templateOptions.tools = templateTools(plan)
  present.set('constraint', toolConstraint(plan, own, (text) => singleToken(host, text)))
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
