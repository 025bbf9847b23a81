// The Go client of kvrouter: kvclient (a router that frees every booking, a publisher that resumes
// across replicas), the engine bridge and its feed decoding. Its own module, as etcd's client is,
// so that a program using it needs neither the server's module nor its dependencies; its tests
// against a real server in process live in the server's module (clients/gotest).
module github.com/kvrouter/kvrouter/clients/go

go 1.26.0

require (
	github.com/cenkalti/backoff/v5 v5.0.3
	github.com/cespare/xxhash/v2 v2.3.0
	github.com/go-zeromq/zmq4 v0.17.0
	github.com/google/go-cmp v0.7.0
	github.com/kvrouter/kvrouter/gen v0.1.0
	github.com/kvrouter/kvrouter/kvstate/blockhash v0.1.0
	github.com/prometheus/client_golang v1.25.0
	github.com/vmihailenco/msgpack/v5 v5.4.1
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260817212433-ac3dfec99bb1
	google.golang.org/grpc v1.85.0
	google.golang.org/protobuf v1.36.12
)

require (
	github.com/beorn7/perks v1.0.1 // indirect
	github.com/go-zeromq/goczmq/v4 v4.2.2 // indirect
	github.com/klauspost/cpuid/v2 v2.2.10 // indirect
	github.com/munnerz/goautoneg v0.0.0-20191010083416-a7dc8b61c822 // indirect
	github.com/prometheus/client_model v0.6.3 // indirect
	github.com/prometheus/common v0.72.0 // indirect
	github.com/prometheus/procfs v0.22.0 // indirect
	github.com/vmihailenco/tagparser/v2 v2.0.0 // indirect
	github.com/zeebo/xxh3 v1.1.0 // indirect
	golang.org/x/net v0.60.0 // indirect
	golang.org/x/sync v0.23.0 // indirect
	golang.org/x/sys v0.48.0 // indirect
	golang.org/x/text v0.42.0 // indirect
)

// Inside this repository the client builds against the contract and hashing beside it; a module
// that requires the client gets the published versions (a replace applies only to the main module).
replace (
	github.com/kvrouter/kvrouter/gen => ../../gen
	github.com/kvrouter/kvrouter/kvstate/blockhash => ../../kvstate/blockhash
)
