// `npm run test:scale`: the suites in test/scale/ that run real redis-server and nginx processes
// (scripts/test-scale.sh installs them when missing). The ordinary `npm test` leaves them out.
// Everything else is vitest.config.ts's (the built package, forks with --expose-gc).
import base from './vitest.config'

export default {
  ...base,
  test: { ...base.test, include: ['test/scale/**/*.test.ts'], exclude: ['**/node_modules/**'], maxWorkers: 1, testTimeout: 120_000 },
}
