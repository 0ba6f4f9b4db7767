#!/usr/bin/env bash
# `npm run test:scale`: the suites of test/scale/ with the real parts on loopback: redis-server,
# three `ortex serve` processes with --session-store, and nginx with docs/scaling.md's
# configuration. Installs Debian's nginx-light and redis-server when missing (setup.sh scale),
# builds the addon and the TypeScript (incremental), then runs vitest.scale.config.ts (the chaos
# test's two seeds included). About 25 s once installed. scripts/test.sh runs it as its `scale` stage, after its own build (--no-build).
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ORTEX_ROOT"
bash scripts/setup.sh scale
if [ "${1:-}" != --no-build ]; then bash scripts/build.sh native ts; fi
npx vitest run --config vitest.scale.config.ts
