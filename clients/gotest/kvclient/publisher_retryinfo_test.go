package kvclient_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/kvrouter/kvrouter/clients/go/kvclient"
	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
)

// streamScript says how the scripted server answers one Publish stream.
type streamScript struct {
	register   bool  // answer the hello with Registered before anything else
	afterBatch bool  // end the stream once the first event batch arrived
	end        error // the status that ends the stream; nil: register, ack every batch, until the client ends it
}

// streamRecord is what the scripted server saw of one stream.
type streamRecord struct {
	start, end time.Time
	batches    []int // events per batch
}

// scriptedWorkerService is a WorkerService on a loopback TCP port that ends the first streams as
// scripted and then accepts, like a router that registers the worker and acks every batch. It
// stands in for the router only in these status-injection tests, which need a stream ended with a
// given status and retry delay at a given moment; every other publisher test runs against the real
// router (servertest), and cmd/kvrouter's tests meet the real rate limits and credential checks.
type scriptedWorkerService struct {
	kvrouterv1.UnimplementedWorkerServiceServer
	script []streamScript // stream i follows script[i]; later ones accept

	mu      sync.Mutex
	streams []*streamRecord
}

func (s *scriptedWorkerService) Publish(stream grpc.BidiStreamingServer[kvrouterv1.PublishRequest, kvrouterv1.PublishResponse]) error {
	rec := &streamRecord{start: time.Now()}
	s.mu.Lock()
	n := len(s.streams)
	s.streams = append(s.streams, rec)
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		rec.end = time.Now()
		s.mu.Unlock()
	}()
	sc := streamScript{register: true}
	if n < len(s.script) {
		sc = s.script[n]
	}
	m, err := stream.Recv()
	if err != nil {
		return err
	}
	if m.GetHello() == nil {
		return status.Error(codes.FailedPrecondition, "the first message must be a hello")
	}
	if !sc.register {
		return sc.end
	}
	if err := stream.Send(&kvrouterv1.PublishResponse{Message: &kvrouterv1.PublishResponse_Registered{Registered: &kvrouterv1.Registered{}}}); err != nil {
		return err
	}
	if sc.end != nil && !sc.afterBatch {
		return sc.end
	}
	for {
		m, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		events := m.GetEvents().GetEvents()
		if len(events) == 0 {
			continue // a load report
		}
		s.mu.Lock()
		rec.batches = append(rec.batches, len(events))
		s.mu.Unlock()
		if sc.end != nil {
			return sc.end
		}
		last := events[len(events)-1].GetEventId()
		if err := stream.Send(&kvrouterv1.PublishResponse{Message: &kvrouterv1.PublishResponse_Ack{Ack: &kvrouterv1.Ack{EventId: last}}}); err != nil {
			return err
		}
	}
}

// records returns a copy of what the server saw of each stream so far.
func (s *scriptedWorkerService) records() []streamRecord {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]streamRecord, len(s.streams))
	for i, r := range s.streams {
		out[i] = *r
		out[i].batches = append([]int(nil), r.batches...)
	}
	return out
}

// startScripted serves svc on a loopback port and returns a connection to it.
func startScripted(t *testing.T, svc *scriptedWorkerService) *grpc.ClientConn {
	t.Helper()
	srv := grpc.NewServer()
	kvrouterv1.RegisterWorkerServiceServer(srv, svc)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(lis) }()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Close()
		srv.Stop()
	})
	return conn
}

// rateLimited is the router's answer to a credential over its KV event rate: RESOURCE_EXHAUSTED
// with a RetryInfo.
func rateLimited(t *testing.T, delay time.Duration) error {
	t.Helper()
	st, err := status.New(codes.ResourceExhausted, `credential "workers" is over its KV event rate limit (1000 blocks/s); retry in 300ms`).
		WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(delay)})
	if err != nil {
		t.Fatal(err)
	}
	return st.Err()
}

// TestRateLimitedStreamWaitsRetryDelayAndKeepsBatchSize: a stream ended for a rate limit
// (RESOURCE_EXHAUSTED with RetryInfo) is not a message too large: the publisher reconnects after
// the router's retry delay, and goes on sending as many events per message as before.
func TestRateLimitedStreamWaitsRetryDelayAndKeepsBatchSize(t *testing.T) {
	const delay = 300 * time.Millisecond
	svc := &scriptedWorkerService{script: []streamScript{{register: true, afterBatch: true, end: rateLimited(t, delay)}}}
	conn := startScripted(t, svc)
	var logs strings.Builder
	var logsMu sync.Mutex
	p := newPublisher(t, kvclient.PublisherOptions{Hello: hello(1), Conns: []grpc.ClientConnInterface{conn}, MaxBatchEvents: 8,
		Logger: slog.New(slog.NewTextHandler(lockedWriter{&logsMu, &logs}, nil))})
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	publish8 := func(from int) {
		t.Helper()
		events := make([]*kvrouterv1.KvEvent, 8)
		for i := range events {
			events[i] = storedEvent(from + i)
		}
		if err := p.Publish(ctx, events...); err != nil { // one call: the 8 events are queued at once
			t.Fatal(err)
		}
		if err := p.Flush(ctx); err != nil {
			t.Fatalf("Flush() = %v", err)
		}
	}
	publish8(0)
	publish8(8)
	if err := p.Close(ctx); err != nil {
		t.Fatalf("Close() = %v", err)
	}

	recs := svc.records()
	var batches [][]int
	for _, r := range recs {
		batches = append(batches, r.batches)
	}
	// The first stream took one batch of 8 and ended; the second got the same 8 again, then 8 more.
	if diff := cmp.Diff([][]int{{8}, {8, 8}}, batches); diff != "" {
		t.Errorf("events per batch, by stream (-want +got):\n%s", diff)
	}
	if len(recs) >= 2 {
		if gap := recs[1].start.Sub(recs[0].end); gap < delay {
			t.Errorf("the publisher reconnected %v after the rate limit, want at least the retry delay %v", gap, delay)
		}
	}
	logsMu.Lock()
	defer logsMu.Unlock()
	if !strings.Contains(logs.String(), "level=WARN") || !strings.Contains(logs.String(), "retry_delay=300ms") {
		t.Errorf("the publisher did not log the rate limit at warn with its retry delay; its log:\n%s", logs.String())
	}
}

// TestRefusedCredentialKeepsReconnectingWithGrowingBackoff: a stream refused for its credential
// (UNAUTHENTICATED before the registration, or PERMISSION_DENIED after it) does not stop the
// publisher, since a rotated credential may mend it, but each attempt waits longer than the one
// before and is logged at error with the router's message. Once the router accepts, every event
// arrives.
func TestRefusedCredentialKeepsReconnectingWithGrowingBackoff(t *testing.T) {
	const refusals = 6
	for _, tc := range []struct {
		name     string
		register bool
		end      error
		logged   string // of the router's message, as the log shows it
	}{
		{"UNAUTHENTICATED before the registration", false, status.Error(codes.Unauthenticated, "invalid bearer token: it is not in the credentials file"),
			"invalid bearer token: it is not in the credentials file"},
		{"PERMISSION_DENIED after the registration", true, status.Error(codes.PermissionDenied, `credential "frontends" (role frontend) may not publish`),
			"(role frontend) may not publish"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			svc := &scriptedWorkerService{}
			for range refusals {
				svc.script = append(svc.script, streamScript{register: tc.register, end: tc.end})
			}
			conn := startScripted(t, svc)
			var logs strings.Builder
			var logsMu sync.Mutex
			p := newPublisher(t, kvclient.PublisherOptions{Hello: hello(1), Conns: []grpc.ClientConnInterface{conn},
				Logger: slog.New(slog.NewTextHandler(lockedWriter{&logsMu, &logs}, nil))})
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()
			for i := range 10 {
				if err := p.Publish(ctx, storedEvent(i)); err != nil {
					t.Fatal(err)
				}
			}
			if err := p.Flush(ctx); err != nil {
				t.Fatalf("Flush() = %v, want every event acked once the router accepts", err)
			}
			recs := svc.records()
			if len(recs) != refusals+1 {
				t.Fatalf("the router saw %d streams, want %d refused and 1 accepted", len(recs), refusals)
			}
			var gaps []time.Duration
			for i := 1; i < len(recs); i++ {
				gaps = append(gaps, recs[i].start.Sub(recs[i-1].end))
			}
			// The backoff starts at 50 ms (±50% jitter) and grows 1.5x an attempt: the sixth wait is
			// 190 to 570 ms, where a backoff reset after every attempt stays under 75 ms.
			if last := gaps[len(gaps)-1]; last < 150*time.Millisecond {
				t.Errorf("waits between attempts %v: want them to grow, the last over 150ms", gaps)
			}
			logsMu.Lock()
			defer logsMu.Unlock()
			if n := strings.Count(logs.String(), "level=ERROR"); n != refusals || !strings.Contains(logs.String(), tc.logged) {
				t.Errorf("the publisher logged %d errors, want %d with the router's message %q; its log:\n%s", n, refusals, tc.logged, logs.String())
			}
		})
	}
}

// TestResourceExhaustedBeforeRegistrationIsRetried: RESOURCE_EXHAUSTED without RetryInfo ending a
// stream before its registration cannot be a message too large (no event went out): it is a bound
// such as max_publish_streams or max_workers_per_model. The publisher neither halves its batches nor
// stops; it tries again after its backoff.
func TestResourceExhaustedBeforeRegistrationIsRetried(t *testing.T) {
	full := status.Error(codes.ResourceExhausted, `credential "workers" holds 4 Publish streams, the most it may (max_publish_streams 4); close one first`)
	svc := &scriptedWorkerService{script: []streamScript{{end: full}, {end: full}}}
	conn := startScripted(t, svc)
	p := newPublisher(t, kvclient.PublisherOptions{Hello: hello(1), Conns: []grpc.ClientConnInterface{conn}, MaxBatchEvents: 8})
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	events := make([]*kvrouterv1.KvEvent, 8)
	for i := range events {
		events[i] = storedEvent(i)
	}
	if err := p.Publish(ctx, events...); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(ctx); err != nil {
		t.Fatalf("Close() = %v, want every event acked once the router accepts", err)
	}
	recs := svc.records()
	var batches [][]int
	for _, r := range recs {
		batches = append(batches, r.batches)
	}
	if diff := cmp.Diff([][]int{nil, nil, {8}}, batches); diff != "" {
		t.Errorf("events per batch, by stream (-want +got):\n%s", diff)
	}
	if len(recs) == 3 {
		if gap := recs[1].start.Sub(recs[0].end); gap < 20*time.Millisecond {
			t.Errorf("the publisher tried again %v after the refusal, want its backoff (25 ms at least)", gap)
		}
	}
}
