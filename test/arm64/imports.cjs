// CommonJS: the same as imports.mjs through require().
const native = require('ortex')
const wasm = require('ortex/wasm')
const { simulated } = require('./report.cjs')

simulated([['native', native], ['wasm', wasm]]).then((out) => console.log(JSON.stringify(out)))
