package main

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvrouter/kvrouter/kvstate/kvtest"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore/redistest"
)

// TestReplicasShareState runs two kvrouter processes on one private redis-server: a worker publishes
// to replica A, and replica B routes with its overlap; the request B books shows in A's load.
func TestReplicasShareState(t *testing.T) { onEveryRedis(t, testReplicasShareState) }

// redisTarget is a private Redis for process tests: its flags for kvrouter, a client, and how to
// freeze it.
type redisTarget struct {
	flags         []string
	client        redis.UniversalClient
	pause, resume func()
}

// defaultStream is the log stream of replicas started with the default prefix.
const defaultStream = "kvr:{default}:log"

// onEveryRedis runs a process test against a private redis-server and a private 3-master Redis
// Cluster.
func onEveryRedis(t *testing.T, test func(t *testing.T, r redisTarget)) {
	t.Run("single", func(t *testing.T) {
		s := redistest.Start(t)
		test(t, redisTarget{flags: []string{"--redis-addr", s.Addr}, client: s.Client(), pause: s.Pause, resume: s.Resume})
	})
	t.Run("cluster", func(t *testing.T) {
		if testing.Short() {
			t.Skip("Redis Cluster runs skipped in -short mode")
		}
		c := redistest.StartCluster(t, 3)
		test(t, redisTarget{flags: []string{"--redis-cluster-addrs", strings.Join(c.Addrs, ",")}, client: c.Client(), pause: c.Pause, resume: c.Resume})
	})
}

func testReplicasShareState(t *testing.T, r redisTarget) {
	grpcurl := grpcurlPath(t)
	bin := buildBinary(t)
	a, _ := startServer(t, bin, append(r.flags, "--replica-id", "a")...)
	b, _ := startServer(t, bin, append(r.flags, "--replica-id", "b")...)

	prompt := tokenRange(1, 1024)
	publishFleet(t, grpcurl, a, prompt) // P1, D1 caching 15 of 16 blocks, D2

	var got routeAnswer
	if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool {
		got = routeVia(t, grpcurl, b, map[string]any{"model": "llama", "tokenIds": prompt, "queryOnly": true, "explain": true})
		return got.Decode == "11"
	}) {
		t.Fatalf("replica B never routed to D1 by its cache: last answer %+v", got)
	}
	// Replica B books a request; replica A's ListWorkers shows it on the decode worker.
	booked := routeVia(t, grpcurl, b, map[string]any{"requestId": "shared-1", "model": "llama", "tokenIds": prompt})
	if booked.Mode != "ROUTE_MODE_DISAGGREGATED" {
		t.Fatalf("B's Route = %+v, want disaggregated (conditional disagg is off)", booked)
	}
	var out string
	if !kvtest.Poll(defaultTestTimeout, 20*time.Millisecond, func() bool {
		out = grpcurlCall(t, grpcurl, a, "kvrouter.v1.AdminService/ListWorkers", `{"model": "llama"}`)
		var resp struct {
			Workers []struct {
				Worker struct {
					WorkerID string `json:"workerId"`
				} `json:"worker"`
				Load struct {
					ActiveRequests string `json:"activeRequests"`
				} `json:"load"`
			} `json:"workers"`
		}
		if err := json.Unmarshal([]byte(out), &resp); err != nil {
			t.Fatalf("ListWorkers output: %v\n%s", err, out)
		}
		var busy []string
		for _, w := range resp.Workers {
			if w.Load.ActiveRequests == "1" {
				busy = append(busy, w.Worker.WorkerID)
			}
		}
		return strings.Join(busy, ",") == "1,"+booked.Decode
	}) {
		t.Fatalf("replica A never showed B's booking on P1 and D%s:\n%s", booked.Decode, out)
	}
}
