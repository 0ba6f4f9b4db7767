#!/usr/bin/env node
// The `ortex` command line: one file per command beside this one (generate, serve, import, make-model),
// the flags and engine choice they share in args.ts. Arguments are parsed with node:util's
// parseArgs; every error ends the process with a non-zero status and one line on stderr.

import { readFileSync } from 'node:fs'

import { fromPackageRoot } from '../backend'
import { OrtexError } from '../errors'
import { UsageError } from './args'
import { runGenerateCommand } from './generate'
import { runImportCommand } from './import'
import { runMakeModelCommand } from './make-model'
import { runServeCommand } from './serve'

const USAGE_ERROR = 2
const RUNTIME_ERROR = 1

const MAIN_HELP = `ortex: an LLM inference engine for Node.js

Usage:
  ortex generate (--model DIR|FILE.gguf | --simulated) [--prompt TEXT]... [--max-tokens N] [--concurrency K]
  ortex serve    (--model DIR|FILE.gguf | --simulated) [--port N] [--max-sessions N]
  ortex import <file.gguf> --out DIR [--weights fp32|int4] [--kv fp32|fp16] [--dtype fp32|fp16] [--attention gqa|paged]
  ortex make-model --out DIR [--size tiny|bench] [--attention mha|gqa|paged] [--seed N]
  ortex <command> --help

Commands:
  generate   stream generations from a model (or the simulated model) and report tokens per second
  serve      serve full-duplex sessions over WebSocket (docs/duplex-protocol.md)
  import     convert a GGUF file (llama.cpp's format) into a model folder (docs/model-format.md)
  make-model write a deterministic random-weight model folder (docs/model-format.md)

Options:
  -h, --help     show this help
  -v, --version  show the version
`

const COMMANDS: Readonly<Record<string, (argv: string[]) => Promise<void>>> = {
  generate: runGenerateCommand,
  serve: runServeCommand,
  import: runImportCommand,
  'make-model': runMakeModelCommand,
}

function fail(message: string, status: number): never {
  process.stderr.write(`ortex: ${message.replace(/\s*\n\s*/g, ' ')}\n`)
  process.exit(status)
}

function version(): string {
  try {
    return (JSON.parse(readFileSync(fromPackageRoot('package.json'), 'utf8')) as { version: string }).version
  } catch {
    return 'unknown'
  }
}

/** The command being run, for the hint after an argument error. */
let currentCommand: string | undefined

async function main(argv: string[]): Promise<void> {
  const [command, ...rest] = argv
  currentCommand = command
  if (command === undefined || command === '-h' || command === '--help' || command === 'help') {
    process.stdout.write(MAIN_HELP)
    return
  }
  if (command === '-v' || command === '--version') {
    process.stdout.write(`${version()}\n`)
    return
  }
  const run = Object.hasOwn(COMMANDS, command) ? COMMANDS[command] : undefined
  if (run === undefined) throw new UsageError(`unknown command ${JSON.stringify(command)}; see ortex --help`)
  await run(rest)
}

process.stdout.on('error', (error: NodeJS.ErrnoException) => {
  if (error.code === 'EPIPE') process.exit(0)
})

main(process.argv.slice(2)).then(
  () => {
    process.exitCode = 0
  },
  (error: unknown) => {
    if (error instanceof UsageError) fail(error.message, USAGE_ERROR)
    if ((error as { code?: string })?.code?.startsWith?.('ERR_PARSE_ARGS') === true) {
      const help = currentCommand === undefined ? 'ortex --help' : `ortex ${currentCommand} --help`
      fail(`${(error as Error).message.replace(/\.?\s*$/, '')}; see ${help}`, USAGE_ERROR)
    }
    if (error instanceof OrtexError) fail(`${error.code}: ${error.message}`, RUNTIME_ERROR)
    fail(error instanceof Error ? error.message : String(error), RUNTIME_ERROR)
  },
)
