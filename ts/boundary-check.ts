// Compile-time checks that the public types (types.ts, duplex/events.ts: written by hand, with
// their documentation) and the shapes the core answers with (generated from the Rust side into
// ts/generated/boundary.ts) are the same: a field added on one side only fails the build.

import type { SessionState } from './duplex/events'
import type { Fence } from './duplex/events'
import type { ConfigView, ContinuationInput, ContinuationView, ExecutorStatsView, FenceView, SessionView, StatsView } from './generated/boundary'
import type { NodePlacementView } from './binding'
import type { EngineConfig, EngineStats, ExecutorStats, NodePlacement } from './types'

/** True when A and B are the same type; else never, which makes the `satisfies` below fail. */
type Same<A, B> = [A] extends [B] ? ([B] extends [A] ? true : never) : never

true satisfies Same<EngineConfig, ConfigView>
true satisfies Same<EngineStats, StatsView>
true satisfies Same<ExecutorStats, ExecutorStatsView>
true satisfies Same<NodePlacement, NodePlacementView>
true satisfies Same<Fence, FenceView>
true satisfies Same<SessionState, SessionView['state']>
// A session store hands back, as the input of a restore, the very object the core gave it.
true satisfies Same<ContinuationView, ContinuationInput>
