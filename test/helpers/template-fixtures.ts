// Real chat templates (crates/ortex-chat/tests/fixtures: each model's template and special tokens,
// with cases rendered by transformers) and tiny model folders that speak them: the tiny ONNX model
// with a fixture's template and special tokens in place of its own.

import { cpSync, readFileSync, rmSync, writeFileSync } from 'node:fs'
import path from 'node:path'
import { afterAll } from 'vitest'
import type { TinyModels } from './tiny-models'

const FIXTURES = path.resolve(__dirname, '../../crates/ortex-chat/tests/fixtures')

export interface TemplateFixture {
  template: string
  bos_token: string | null
  eos_token: string | null
  other_special_tokens: Record<string, string>
  cases: { name: string; expected?: string }[]
}

export function templateFixture(name: string): TemplateFixture {
  return JSON.parse(readFileSync(path.join(FIXTURES, `${name}.json`), 'utf8'))
}

/**
 * Folders made from `models`' plain folder (removed after the suite): `fixture(name)` with fixture
 * `name`'s template and special tokens, `template(label, jinja)` with a template of the test's own.
 */
export function useTemplateFolders(models: TinyModels<'plain'>): { fixture: (name: string) => string; template: (label: string, jinja: string) => string } {
  const folders: string[] = []
  afterAll(() => {
    for (const dir of folders) rmSync(dir, { recursive: true, force: true })
  })
  const folder = (label: string, jinja: string, tokens?: Pick<TemplateFixture, 'bos_token' | 'eos_token' | 'other_special_tokens'>) => {
    const dir = path.join(models.root(), `with-${label}`)
    cpSync(models.dirs.plain, dir, { recursive: true })
    writeFileSync(path.join(dir, 'chat_template.jinja'), jinja)
    if (tokens) {
      const config = JSON.parse(readFileSync(path.join(dir, 'tokenizer_config.json'), 'utf8')) as Record<string, unknown>
      Object.assign(config, { bos_token: tokens.bos_token, eos_token: tokens.eos_token, ...tokens.other_special_tokens })
      delete config.added_tokens_decoder
      writeFileSync(path.join(dir, 'tokenizer_config.json'), JSON.stringify(config))
    }
    folders.push(dir)
    return dir
  }
  return {
    fixture: (name) => {
      const f = templateFixture(name)
      return folder(name, f.template, f)
    },
    template: (label, jinja) => folder(label, jinja),
  }
}
