//go:build kvrouter_notracing

package server

// tracingBuilt: see tracing_built.go.
const tracingBuilt = false
