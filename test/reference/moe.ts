// llama.cpp's mixture-of-experts feed-forward (build_moe_ffn with softmax gating, SiLU-gated
// experts, no shared expert), in float64 over the weights as the GGUF file lays them out:
//
//   router  E rows of H              logits[e] = router[e] . x
//   gate    E x F rows of H          expert e's rows e F .. e F + F - 1 (up alike)
//   down    E x H rows of F          expert e's rows e H .. e H + H - 1
//
// probs = softmax(logits); the k largest (ggml_argsort_top_k); weights = those probabilities,
// divided by their sum (clamped below at 2^-14) where the architecture renormalizes;
// y = sum of weight * down(silu(gate x) * up x).

export interface MoeReferenceWeights {
  router: Float64Array
  gate: Float64Array
  up: Float64Array
  down: Float64Array
}

export interface MoeReferenceDims {
  hiddenSize: number
  numExperts: number
  numExpertsPerToken: number
  expertIntermediateSize: number
}

/** A token's routing: its experts, best first, and their weights. */
export interface Routing {
  experts: number[]
  weights: number[]
  /** The gap between the k-th probability and the next, over the k-th (Infinity when k = E). */
  margin: number
}

export function routeToken(x: Float64Array, w: MoeReferenceWeights, d: MoeReferenceDims, renormalize: boolean): Routing {
  const { hiddenSize: H, numExperts: E, numExpertsPerToken: k } = d
  const logits = Array.from({ length: E }, (_, e) => dot(w.router, e * H, x, H))
  const max = Math.max(...logits)
  const exps = logits.map((l) => Math.exp(l - max))
  const total = exps.reduce((a, b) => a + b, 0)
  const probs = exps.map((v) => v / total)
  const order = probs.map((_, e) => e).sort((a, b) => probs[b]! - probs[a]!)
  const experts = order.slice(0, k)
  let weights = experts.map((e) => probs[e]!)
  if (renormalize) {
    const sum = Math.max(weights.reduce((a, b) => a + b, 0), 6.103515625e-5)
    weights = weights.map((v) => v / sum)
  }
  const kth = probs[order[k - 1]!]!
  const margin = k === E ? Infinity : (kth - probs[order[k]!]!) / kth
  return { experts, weights, margin }
}

/** x: N rows of H -> y: N rows of H. */
export function moeReference(x: Float64Array, w: MoeReferenceWeights, d: MoeReferenceDims, renormalize: boolean): Float64Array {
  const { hiddenSize: H, expertIntermediateSize: F } = d
  const N = x.length / H
  const y = new Float64Array(N * H)
  for (let t = 0; t < N; t++) {
    const row = x.subarray(t * H, (t + 1) * H)
    const { experts, weights } = routeToken(row, w, d, renormalize)
    experts.forEach((e, slot) => {
      const act = new Float64Array(F)
      for (let f = 0; f < F; f++) {
        const g = dot(w.gate, (e * F + f) * H, row, H)
        act[f] = (g / (1 + Math.exp(-g))) * dot(w.up, (e * F + f) * H, row, H)
      }
      for (let h = 0; h < H; h++) y[t * H + h] += weights[slot]! * dot(w.down, (e * H + h) * F, act, F)
    })
  }
  return y
}

function dot(m: Float64Array, at: number, x: Float64Array, n: number): number {
  let sum = 0
  for (let i = 0; i < n; i++) sum += m[at + i]! * x[i]!
  return sum
}
