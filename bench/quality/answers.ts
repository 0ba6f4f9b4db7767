// Greedy answers to a few chat questions, through the chat template SmolLM2 ships: from the engine
// (Engine.load from 'ortex', the built package) on each folder, and from llama.cpp on the GGUF file
// with the same prompt ids, so a reader sees what a difference in the numbers does to an answer.

import type { Token } from 'node-llama-cpp'

import { chatPrompt } from '../../ts/modelkit/real-model'

export const QUESTIONS = [
  'What is the capital of France?',
  'What is the largest planet in our solar system?',
  'What is a prime number? Give two examples.',
] as const

export interface Answer {
  question: string
  tokens: number[]
  text: string
}

/** The chat prompts' ids, from a folder's tokenizer (every variant's is the same file's). */
export async function promptIds(folder: string): Promise<number[][]> {
  const { Engine } = await import('ortex')
  const engine = await Engine.load(folder, { intraOpThreads: 1 })
  try {
    return QUESTIONS.map((q) => Array.from(engine.tokenize(chatPrompt(q))))
  } finally {
    await engine.close()
  }
}

/** The engine's greedy answers, one question at a time as llama.cpp's are; the end-of-turn token is not part of them. */
export async function engineAnswers(folder: string, prompts: number[][], maxTokens: number, threads: number): Promise<Answer[]> {
  const { Engine } = await import('ortex')
  const engine = await Engine.load(folder, { intraOpThreads: threads })
  try {
    const answers: Answer[] = []
    for (const [i, prompt] of prompts.entries()) {
      const result = await engine.generate(prompt, { maxGeneratedTokens: maxTokens }).done
      const tokens = Array.from(result.tokens)
      if (result.finishReason === 'eos') tokens.pop()
      answers.push({ question: QUESTIONS[i]!, tokens, text: engine.detokenize(tokens) })
    }
    return answers
  } finally {
    await engine.close()
  }
}

/** llama.cpp's greedy answers to the same ids, one sequence at a time, ending at end of generation. */
export async function llamaCppAnswers(gguf: string, prompts: number[][], maxTokens: number, threads: number): Promise<Answer[]> {
  const { getLlama, LlamaLogLevel } = await import('node-llama-cpp')
  const llama = await getLlama({ gpu: false, build: 'never', logLevel: LlamaLogLevel.warn, maxThreads: 0 })
  try {
    const model = await llama.loadModel({ modelPath: gguf })
    try {
      const context = await model.createContext({ sequences: 1, contextSize: 256, threads })
      try {
        const answers: Answer[] = []
        for (const [i, prompt] of prompts.entries()) {
          const sequence = context.getSequence()
          const tokens: number[] = []
          try {
            for await (const token of sequence.evaluate(prompt as Token[], { temperature: 0 })) {
              if (model.isEogToken(token)) break
              tokens.push(token)
              if (tokens.length >= maxTokens) break
            }
          } finally {
            await sequence.dispose()
          }
          answers.push({ question: QUESTIONS[i]!, tokens, text: model.detokenize(tokens as Token[]) })
        }
        return answers
      } finally {
        await context.dispose()
      }
    } finally {
      await model.dispose()
    }
  } finally {
    await llama.dispose()
  }
}
