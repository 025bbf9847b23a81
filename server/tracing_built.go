//go:build !kvrouter_notracing

package server

// tracingBuilt is false only in a build with the kvrouter_notracing tag, which leaves tracing out
// of every call path (no stats handler, no span lookups) whatever the options say. It exists to
// measure what tracing costs when off: `OLD_TAGS=kvrouter_notracing scripts/bench-compare.sh HEAD .`
// compares such a build with the normal one (docs/BENCHMARKS.md). Nothing ships with it.
const tracingBuilt = true
