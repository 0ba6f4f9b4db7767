// The prefix-cache benchmark's chart: one bar per goal, its measured ratio against the goal's mark.

interface ChartGoal {
  name: string
  value: number | null
  goal: number
  kind: 'min' | 'max'
}

const ROW_PX = 34
const LABEL_PX = 430
const BAR_PX = 360

export function svgChart(goals: ChartGoal[]): string {
  const top = Math.max(4, ...goals.map((g) => Math.max(g.value ?? 0, g.goal))) * 1.1
  const x = (v: number) => LABEL_PX + (v / top) * BAR_PX
  const height = 40 + goals.length * ROW_PX + 20
  const rows = goals.map((g, i) => {
    const y = 40 + i * ROW_PX
    const met = g.value !== null && (g.kind === 'min' ? g.value >= g.goal : g.value <= g.goal)
    const bar =
      g.value === null
        ? `<text x="${LABEL_PX + 4}" y="${y + 16}" font-size="12">no value</text>`
        : `<rect x="${LABEL_PX}" y="${y + 4}" width="${(x(g.value) - LABEL_PX).toFixed(1)}" height="18" fill="${met ? '#3a7d44' : '#b33c3c'}"/>` +
          `<text x="${(x(g.value) + 4).toFixed(1)}" y="${y + 18}" font-size="12">${g.value.toFixed(2)}</text>`
    const mark = `<line x1="${x(g.goal).toFixed(1)}" x2="${x(g.goal).toFixed(1)}" y1="${y}" y2="${y + 26}" stroke="#000" stroke-dasharray="3,2"/>`
    const label = `<text x="${LABEL_PX - 8}" y="${y + 18}" font-size="12" text-anchor="end">${escape(g.name)} (${g.kind === 'min' ? '>=' : '<='} ${g.goal})</text>`
    return `${label}${bar}${mark}`
  })
  return [
    `<svg xmlns="http://www.w3.org/2000/svg" width="${LABEL_PX + BAR_PX + 80}" height="${height}" font-family="sans-serif">`,
    `<rect width="100%" height="100%" fill="#fff"/>`,
    `<text x="10" y="22" font-size="14" font-weight="bold">Prefix caching: measured ratios (bars) against the goals (dashed)</text>`,
    ...rows,
    '</svg>',
    '',
  ].join('\n')
}

function escape(text: string): string {
  return text.replaceAll('&', '&amp;').replaceAll('<', '&lt;').replaceAll('>', '&gt;')
}
