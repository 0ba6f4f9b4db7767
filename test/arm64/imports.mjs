// ESM: `ortex` (the native addon) and `ortex/wasm`, a simulated generation on each.
import { createRequire } from 'node:module'
import * as native from 'ortex'
import * as wasm from 'ortex/wasm'

const { simulated } = createRequire(import.meta.url)('./report.cjs')
console.log(JSON.stringify(await simulated([['native', native], ['wasm', wasm]])))
