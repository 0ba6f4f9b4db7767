// The HTTP side of chat-server.mjs, in its own process so that parsing the streams does not run
// on the server's JavaScript thread: on each `go` message from the parent it opens `streams`
// streaming chat completions at once and reports the tokens they generated and the wall time.
process.on('message', async ({ url, model, prompts, maxTokens }) => {
  const start = performance.now()
  const results = await Promise.all(prompts.map((content) => stream(url, model, content, maxTokens)))
  const seconds = (performance.now() - start) / 1000
  process.send({ seconds, tokens: results.reduce((sum, r) => sum + r.tokens, 0), ttftMs: results.map((r) => r.ttftMs) })
})

async function stream(url, model, content, maxTokens) {
  const start = performance.now()
  const response = await fetch(`${url}/v1/chat/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({
      model,
      messages: [{ role: 'user', content }],
      max_tokens: maxTokens,
      stream: true,
      stream_options: { include_usage: true },
    }),
  })
  if (response.status !== 200) throw new Error(`HTTP ${response.status}: ${await response.text()}`)
  const decoder = new TextDecoder()
  let buffered = ''
  let tokens = 0
  let ttftMs = null
  for await (const bytes of response.body) {
    if (ttftMs === null) ttftMs = performance.now() - start
    buffered += decoder.decode(bytes, { stream: true })
    let end
    while ((end = buffered.indexOf('\n\n')) >= 0) {
      const event = buffered.slice(0, end)
      buffered = buffered.slice(end + 2)
      if (!event.startsWith('data: ') || event === 'data: [DONE]') continue
      const chunk = JSON.parse(event.slice(6))
      if (chunk.usage) tokens = chunk.usage.completion_tokens
    }
  }
  return { tokens, ttftMs }
}
