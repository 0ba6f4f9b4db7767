// Where ortex keeps what it downloads and imports: ${ORTEX_CACHE_DIR:-${XDG_CACHE_HOME:-~/.cache}/ortex}.

import { homedir } from 'node:os'
import { join } from 'node:path'

export function cacheRoot(): string {
  if (process.env.ORTEX_CACHE_DIR) return process.env.ORTEX_CACHE_DIR
  return join(process.env.XDG_CACHE_HOME || join(homedir(), '.cache'), 'ortex')
}
