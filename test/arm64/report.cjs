// Shared by the user-side scripts of scripts/test-arm64.sh (imports.mjs, imports.cjs, greedy.mjs):
// which ortex addon and which ONNX Runtime this process mapped, read from /proc/self/maps (qemu-user
// shows the emulated process's own mappings there).
const { readFileSync } = require('node:fs')

function mapped(test) {
  const files = readFileSync('/proc/self/maps', 'utf8').split('\n').map((line) => line.split(/\s+/).at(-1))
  return files.find(test) ?? null
}

/** One simulated generation per entry point, streamed and awaited, as a JSON-ready record. */
async function simulated(entries) {
  const out = {}
  for (const [label, mod] of entries) {
    const engine = mod.Engine.simulated({ seed: 5 })
    const turn = engine.generate('Hello from a user project', { maxGeneratedTokens: 12 })
    let streamed = ''
    for await (const chunk of turn) streamed += chunk.text
    const result = await turn.done
    await engine.close()
    out[label] = {
      backend: engine.backend,
      finishReason: result.finishReason,
      generated: result.usage.generatedTokens,
      tokens: Array.from(result.tokens),
      same: streamed === result.text,
      sharedError: mod.OrtexError === entries[0][1].OrtexError,
    }
  }
  out.arch = process.arch
  out.addon = mapped((f) => f.endsWith('.node') && f.includes('ortex'))
  return out
}

module.exports = { mapped, simulated }
