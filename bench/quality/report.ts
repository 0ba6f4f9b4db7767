// The quality benchmark's markdown: the table (as docs/model-format.md records it) and the answers.

import type { QualityReport } from './main'

export function formatTable(r: QualityReport): string {
  const reference = r.rows[0]!
  const lines = [
    `SmolLM2-135M-Instruct, ${r.text.file} (${r.text.tokens} tokens, ${r.text.scoredPositions} positions scored, chunks of ${r.chunk}), ` +
      `against ${reference.id}; ${r.threads} threads, ${r.cpu}, ${r.date.slice(0, 10)}, \`${r.command}\``,
    '',
    '| system | mean KL (nats) | p99 KL | max KL | top-1 agreement | perplexity | same answers as the reference |',
    '|--------|---------------:|-------:|-------:|----------------:|-----------:|------------------------------:|',
  ]
  for (const row of r.rows) {
    const s = row.summary
    const sameAnswers = row.answers.filter((a, i) => sameTokens(a.tokens, reference.answers[i]!.tokens)).length
    lines.push(
      `| ${row.label} | ${kl(s.meanKl)} | ${kl(s.p99Kl)} | ${kl(s.maxKl)} | ${(100 * s.top1Agreement).toFixed(2)}% | ${s.perplexity.toFixed(3)} | ${sameAnswers} of ${row.answers.length} |`,
    )
  }
  return lines.join('\n')
}

/** Three significant digits; below 0.001 in exponent form (float32 rounding is ~1e-6). */
export const kl = (x: number) => (x === 0 ? '0' : x < 1e-3 ? x.toExponential(1) : x.toPrecision(3))

const sameTokens = (a: number[], b: number[]) => a.length === b.length && a.every((t, i) => t === b[i])

export function formatAnswers(r: QualityReport): string {
  const lines: string[] = []
  r.rows[0]!.answers.forEach((_, i) => {
    lines.push(`**${r.rows[0]!.answers[i]!.question}**`, '')
    for (const row of r.rows) lines.push(`- ${row.id}: ${JSON.stringify(row.answers[i]!.text)}`)
    lines.push('')
  })
  return lines.join('\n').trimEnd()
}
