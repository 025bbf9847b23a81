// kvrouter's block hashing, the one the router keys its index with. A module of its own so that the
// Go client (clients/go) hashes as the router does without the server's module.
module github.com/kvrouter/kvrouter/kvstate/blockhash

go 1.26.0

require (
	github.com/google/go-cmp v0.7.0
	github.com/zeebo/xxh3 v1.1.0
)

require (
	github.com/klauspost/cpuid/v2 v2.2.10 // indirect
	golang.org/x/sys v0.30.0 // indirect
)
