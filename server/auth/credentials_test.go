package auth

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvrouter/kvrouter/kvstate"
)

const hashA = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08" // sha256("test")

// TestParseCredentials: every rule of the credentials file, each refusal naming the entry and the
// field, and never the token hash.
func TestParseCredentials(t *testing.T) {
	tests := []struct {
		name, file, want string
	}{
		{"unknown field", "credentials:\n  - name: a\n    roles: [admin]\n    token: hunter2\n", "field token not found"},
		{"no name", "credentials:\n  - roles: [admin]\n    token_sha256: " + hashA + "\n", `credentials[0]: name: must be 1 to 64 letters`},
		{"bad name", "credentials:\n  - name: 'a b'\n    roles: [admin]\n    token_sha256: " + hashA + "\n", `credentials[0] ("a b"): name: must be`},
		{"no roles", "credentials:\n  - name: a\n    token_sha256: " + hashA + "\n", "roles: must list at least one of worker, frontend, admin"},
		{"unknown role", "credentials:\n  - name: a\n    roles: [root]\n    token_sha256: " + hashA + "\n", `roles: "root" is not a role`},
		{"no proof", "credentials:\n  - name: a\n    roles: [admin]\n", "needs token_sha256"},
		{"plain token", "credentials:\n  - name: a\n    roles: [admin]\n    token_sha256: hunter2\n", "token_sha256: must be 64 hex digits"},
		{"worker without ids", "credentials:\n  - name: a\n    roles: [worker]\n    token_sha256: " + hashA + "\n", "worker_ids: a worker credential must list"},
		{"ids and any", "credentials:\n  - name: a\n    roles: [worker]\n    any_worker: true\n    worker_ids: [1]\n    token_sha256: " + hashA + "\n", "set one, not both"},
		{"ids without the role", "credentials:\n  - name: a\n    roles: [frontend]\n    worker_ids: [1]\n    token_sha256: " + hashA + "\n", "only a credential with role worker"},
		{"worker id 0", "credentials:\n  - name: a\n    roles: [worker]\n    worker_ids: [0]\n    token_sha256: " + hashA + "\n", "0 is not a worker id"},
		{"negative rate", "credentials:\n  - name: a\n    roles: [frontend]\n    route_rate_limit: -1\n    token_sha256: " + hashA + "\n", "route_rate_limit: must be >= 0"},
		{"zero streams", "credentials:\n  - name: a\n    roles: [worker]\n    any_worker: true\n    max_publish_streams: 0\n    token_sha256: " + hashA + "\n", "max_publish_streams: must be >= 1"},
		{"negative booked blocks", "credentials:\n  - name: a\n    roles: [frontend]\n    max_booked_blocks: -1\n    token_sha256: " + hashA + "\n", "max_booked_blocks: must be >= 0"},
		{"name twice", "credentials:\n  - name: a\n    roles: [admin]\n    identity: x\n  - name: a\n    roles: [admin]\n    identity: y\n", `credentials[1] ("a"): name: "a" is used twice`},
		{"token twice", "credentials:\n  - name: a\n    roles: [admin]\n    token_sha256: " + hashA + "\n  - name: b\n    roles: [admin]\n    token_sha256: " + strings.ToUpper(hashA) + "\n", `the same token is also "a"'s`},
		{"identity twice", "credentials:\n  - name: a\n    roles: [admin]\n    identity: spiffe://x\n  - name: b\n    roles: [frontend]\n    identity: spiffe://x\n", `identity: "spiffe://x" is also "a"'s`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := parseCredentials([]byte(tt.file))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("parseCredentials() = %v, want an error containing %q", err, tt.want)
			}
			if strings.Contains(strings.ToLower(err.Error()), hashA) {
				t.Errorf("the error shows a token hash: %v", err)
			}
		})
	}
	tab, err := parseCredentials([]byte("credentials:\n  - name: w\n    roles: [worker, admin]\n    worker_ids: [9, 3]\n    models: [llama]\n    token_sha256: " + hashA + "\n    identity: spiffe://fleet/w\n"))
	if err != nil {
		t.Fatal(err)
	}
	c := tab.all[0]
	got := struct {
		Roles   string
		Workers []uint64
		Models  []string
		Same    bool
	}{c.Roles.String(), c.Workers, c.Models, tab.byIdentity["spiffe://fleet/w"] == c && len(tab.byToken) == 1}
	want := struct {
		Roles   string
		Workers []uint64
		Models  []string
		Same    bool
	}{"worker,admin", []uint64{3, 9}, []string{"llama"}, true}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("parsed credential (-want +got):\n%s", diff)
	}
	if err := c.MayPublishFor(3, "llama"); err != nil {
		t.Errorf("MayPublishFor(3, llama) = %v", err)
	}
	for _, bad := range []struct {
		id    uint64
		model string
	}{{4, "llama"}, {3, "mistral"}} {
		if err := c.MayPublishFor(bad.id, bad.model); err == nil {
			t.Errorf("MayPublishFor(%d, %s) = nil, want refused", bad.id, bad.model)
		}
	}
}

// TestBucket: a burst passes, then takes wait or are refused with the time until they would pass.
func TestBucket(t *testing.T) {
	t0 := time.Unix(1000, 0)
	b := newBucket(10, 20, t0)
	type take struct {
		n       float64
		at      time.Duration
		maxWait time.Duration
		wait    time.Duration
		ok      bool
	}
	steps := []take{
		{20, 0, 0, 0, true},                                 // the whole burst
		{1, 0, 0, 100 * time.Millisecond, false},            // empty: 1 token is 100 ms away
		{5, 0, time.Second, 500 * time.Millisecond, true},   // in debt, paid by waiting
		{10, 0, time.Second, 500 * time.Millisecond, false}, // 1.5 s away, 0.5 s past the wait allowed
		{10, 2 * time.Second, 0, 0, true},                   // refilled (15 of 20)
		{1, 2 * time.Second, 0, 0, true},
	}
	for i, s := range steps {
		wait, ok := b.take(s.n, t0.Add(s.at), s.maxWait)
		if wait != s.wait || ok != s.ok {
			t.Errorf("step %d: take(%v) = %v, %v; want %v, %v", i, s.n, wait, ok, s.wait, s.ok)
		}
	}
	if wait, ok := newBucket(0, 0, t0).take(1e9, t0, 0); wait != 0 || !ok {
		t.Errorf("a bucket of rate 0 limited: %v, %v", wait, ok)
	}
	// A tiny rate: the wait for a second token would overflow a Duration (it passed, before).
	tiny := newBucket(1e-12, 1, t0)
	tiny.take(1, t0, 0)
	if wait, ok := tiny.take(1, t0, time.Second); ok || wait != maxBucketWait-time.Second {
		t.Errorf("a bucket of rate 1e-12/s, empty: take(1) = %v, %v; want refused, retry in %v", wait, ok, maxBucketWait-time.Second)
	}
}

// TestRouteTokenRate: a credential's booked prompt tokens are limited by route_token_rate_limit,
// after a burst of at least the longest prompt, with RESOURCE_EXHAUSTED and RetryInfo past it.
func TestRouteTokenRate(t *testing.T) {
	now := time.Unix(1000, 0)
	path := filepath.Join(t.TempDir(), "credentials.yaml")
	if err := os.WriteFile(path, []byte("credentials:\n  - name: fe\n    roles: [frontend]\n    token_sha256: "+strings.Repeat("ab", 32)+"\n    route_token_rate_limit: 1000\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	a, err := New(Options{CredentialsFile: path, RouteTokenBurst: 4000, Clock: kvstate.ClockFunc(func() time.Time { return now })})
	if err != nil {
		t.Fatal(err)
	}
	var c *Caller
	for _, cand := range a.table.Load().byToken {
		c = cand
	}
	if err := c.TakeRouteTokens(4000); err != nil {
		t.Fatalf("a prompt of the burst's 4,000 tokens = %v, want it taken", err)
	}
	err = c.TakeRouteTokens(500)
	if status.Code(err) != codes.ResourceExhausted || retryDelayOf(err) != 500*time.Millisecond {
		t.Fatalf("500 more tokens at once = %v (retry %v), want RESOURCE_EXHAUSTED, retry in 500ms", err, retryDelayOf(err))
	}
	now = now.Add(500 * time.Millisecond)
	if err := c.TakeRouteTokens(500); err != nil {
		t.Errorf("500 tokens half a second later = %v, want them taken", err)
	}
	if err := (*Caller)(nil).TakeRouteTokens(1 << 20); err != nil {
		t.Errorf("without an Authenticator = %v, want no limit", err)
	}
}

// TestCallerBookings: a credential's bookings are owned by its name and bounded by its own
// max_booked_blocks or else the default; without a credentials file no caller owns bookings (every
// caller is Anonymous, and one bound for all would only shrink max_booked_blocks).
func TestCallerBookings(t *testing.T) {
	path := filepath.Join(t.TempDir(), "credentials.yaml")
	file := "credentials:\n" +
		"  - name: big\n    roles: [frontend]\n    token_sha256: " + strings.Repeat("ab", 32) + "\n    max_booked_blocks: 5000\n" +
		"  - name: plain\n    roles: [frontend]\n    token_sha256: " + strings.Repeat("cd", 32) + "\n" +
		"  - name: unbounded\n    roles: [frontend]\n    token_sha256: " + strings.Repeat("ef", 32) + "\n    max_booked_blocks: 0\n"
	if err := os.WriteFile(path, []byte(file), 0o600); err != nil {
		t.Fatal(err)
	}
	a, err := New(Options{CredentialsFile: path, MaxBookedBlocks: 1000})
	if err != nil {
		t.Fatal(err)
	}
	type bound struct {
		Owner string
		Max   int
	}
	got := map[string]bound{}
	for _, c := range a.table.Load().byToken {
		owner, most := c.Bookings()
		got[c.Name] = bound{owner, most}
	}
	open, err := New(Options{MaxBookedBlocks: 1000})
	if err != nil {
		t.Fatal(err)
	}
	owner, most := open.table.Load().anonymous.Bookings()
	got["without a file"] = bound{owner, most}
	owner, most = (*Caller)(nil).Bookings()
	got["nil"] = bound{owner, most}
	want := map[string]bound{"big": {"big", 5000}, "plain": {"plain", 1000}, "unbounded": {"unbounded", 0}, "without a file": {}, "nil": {}}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("Bookings() by credential (-want +got):\n%s", diff)
	}
}

// retryDelayOf returns the RetryInfo delay of err's status (0 without one).
func retryDelayOf(err error) time.Duration {
	for _, d := range status.Convert(err).Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok {
			return ri.GetRetryDelay().AsDuration()
		}
	}
	return 0
}
