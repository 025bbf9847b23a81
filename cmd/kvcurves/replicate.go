package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
	"github.com/kvrouter/kvrouter/kvstate/logstore/redisstore"
)

// replicas holds one AdminService client per kvrouter replica.
type replicas struct {
	addrs   []string
	conns   []*grpc.ClientConn
	clients []kvrouterv1.AdminServiceClient
}

func dialReplicas(list string) (*replicas, error) {
	r := &replicas{}
	for _, a := range strings.Split(list, ",") {
		if a = strings.TrimSpace(a); a == "" {
			continue
		}
		conn, err := grpc.NewClient(a, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			r.close()
			return nil, err
		}
		r.addrs, r.conns = append(r.addrs, a), append(r.conns, conn)
		r.clients = append(r.clients, kvrouterv1.NewAdminServiceClient(conn))
	}
	if len(r.addrs) == 0 {
		return nil, errors.New("no replica addresses")
	}
	return r, nil
}

func (r *replicas) close() {
	for _, c := range r.conns {
		c.Close()
	}
}

func (r *replicas) state(ctx context.Context, i int) (*kvrouterv1.GetStateResponse, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	return r.clients[i].GetState(ctx, &kvrouterv1.GetStateRequest{})
}

// streamID is a Redis stream entry id: milliseconds, then a sequence number.
type streamID struct{ ms, seq uint64 }

func parseStreamID(s string) (streamID, error) {
	a, b, ok := strings.Cut(s, "-")
	ms, err1 := strconv.ParseUint(a, 10, 64)
	seq, err2 := strconv.ParseUint(b, 10, 64)
	if !ok || err1 != nil || err2 != nil {
		return streamID{}, fmt.Errorf("stream id %q: want <ms>-<seq>", s)
	}
	return streamID{ms, seq}, nil
}

func (a streamID) atLeast(b streamID) bool { return a.ms > b.ms || a.ms == b.ms && a.seq >= b.seq }

// runReady is `kvcurves ready`: it waits until every replica answers GetState and reports its
// state complete (joined the shared log), so that a measurement starts with every replica
// tailing.
func runReady(ctx context.Context, args []string, stderr io.Writer) int {
	fs := newFlagSet("ready", stderr, "kvcurves ready -replicas ADDR,ADDR,... [-timeout 30s]")
	list := fs.String("replicas", "", "the replicas' gRPC addresses, comma-separated")
	timeout := fs.Duration("timeout", 30*time.Second, "how long to wait")
	if code, done := parse(fs, args); done {
		return code
	}
	r, err := dialReplicas(*list)
	if err != nil {
		fmt.Fprintf(stderr, "kvcurves: %v\n", err)
		return 1
	}
	defer r.close()
	deadline := time.Now().Add(*timeout)
	for i := range r.addrs {
		for {
			st, err := r.state(ctx, i)
			if err == nil && st.GetSharedStateComplete() {
				break
			}
			if time.Now().After(deadline) || ctx.Err() != nil {
				fmt.Fprintf(stderr, "kvcurves: replica %s not ready after %v (last: %v)\n", r.addrs[i], *timeout, err)
				return 1
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	return 0
}

// runReplicate is `kvcurves replicate`: the measurement of one point of the Redis curve. kvload
// seeds one replica; this waits for kvload's --out file, which kvload writes once the router acked
// every event (in Redis mode: once every event is in the Redis stream), and takes that moment as
// the last ack. It then reads the stream's last entry id from Redis and polls every replica's
// AdminService/GetState until its last applied entry (log_last_id) is at or past it: from then on
// that replica's index holds every published block. The lags are measured from the last ack;
// replicated-blocks/s is the blocks over the ack time plus the slowest replica's lag. Finally every
// replica must report the same digest, or the point fails.
func runReplicate(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("replicate", stderr, "kvcurves replicate -redis ADDR -replicas ADDR,... -ack-file FILE -log KVLOAD_OUTPUT -name NAME [-pid KVLOAD_PID]")
	redisAddr := fs.String("redis", "", "the Redis server the replicas share")
	prefix := fs.String("prefix", "kvr:{default}", "the replicas' --redis-prefix")
	list := fs.String("replicas", "", "the replicas' gRPC addresses, comma-separated; the first is the one kvload publishes to")
	ackFile := fs.String("ack-file", "", "kvload's --out file, written once every event is acked")
	logPath := fs.String("log", "", "kvload's output, with its seeding line")
	name := fs.String("name", "", "benchmark name of the point (without the Benchmark prefix)")
	pid := fs.Int("pid", 0, "kvload's process id: fail at once if it exits without writing the ack file")
	poll := fs.Duration("poll", 5*time.Millisecond, "interval between two GetState calls to one replica")
	timeout := fs.Duration("timeout", 5*time.Minute, "how long to wait for the ack, then for the replicas")
	if code, done := parse(fs, args); done {
		return code
	}
	fail := func(err error) int {
		fmt.Fprintf(stderr, "kvcurves replicate: %v\n", err)
		return 1
	}
	if *redisAddr == "" || *ackFile == "" || *logPath == "" || *name == "" {
		return fail(errors.New("-redis, -ack-file, -log and -name are required"))
	}
	r, err := dialReplicas(*list)
	if err != nil {
		return fail(err)
	}
	defer r.close()
	store := redisstore.Dial(*redisAddr)
	defer store.Close()

	// Connect to every replica and to Redis before the clock starts: a gRPC client dials on its
	// first call, which would otherwise count in the first poll's lag.
	for i := range r.addrs {
		if _, err := r.state(ctx, i); err != nil {
			return fail(fmt.Errorf("replica %s: %v", r.addrs[i], err))
		}
	}
	if err := store.Ping(ctx); err != nil {
		return fail(fmt.Errorf("redis %s: %v", *redisAddr, err))
	}
	deadline := time.Now().Add(*timeout)
	for {
		if _, err := os.Stat(*ackFile); err == nil {
			break
		}
		if *pid != 0 && syscall.Kill(*pid, 0) != nil {
			return fail(fmt.Errorf("kvload (pid %d) exited without writing %s", *pid, *ackFile))
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fail(fmt.Errorf("no ack file %s after %v", *ackFile, *timeout))
		}
		time.Sleep(time.Millisecond)
	}
	acked := time.Now()
	head, err := store.Log(*prefix).Head(ctx)
	if err != nil || head.Length == 0 {
		return fail(fmt.Errorf("reading the stream's last entry: %v (%d entries)", err, head.Length))
	}
	target, err := parseStreamID(head.Last)
	if err != nil {
		return fail(err)
	}

	lags := make([]time.Duration, len(r.addrs))
	errs := make([]error, len(r.addrs))
	var wg sync.WaitGroup
	for i := range r.addrs {
		wg.Go(func() {
			for {
				st, err := r.state(ctx, i)
				if err == nil && st.GetLogLastId() != "" {
					id, perr := parseStreamID(st.GetLogLastId())
					if perr != nil {
						errs[i] = perr
						return
					}
					if id.atLeast(target) {
						lags[i] = time.Since(acked)
						return
					}
				}
				if time.Now().After(deadline) || ctx.Err() != nil {
					errs[i] = fmt.Errorf("replica %s did not reach entry %s within %v (last: %v)", r.addrs[i], head.Last, *timeout, err)
					return
				}
				time.Sleep(*poll)
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return fail(err)
	}

	// Every replica now holds the log up to the target; they must agree once they apply the same
	// entries (nothing more is appended while kvload holds its streams idle).
	var states []*kvrouterv1.GetStateResponse
	for {
		states = states[:0]
		same := true
		for i := range r.addrs {
			st, err := r.state(ctx, i)
			if err != nil {
				return fail(err)
			}
			states = append(states, st)
			same = same && st.GetDigest() == states[0].GetDigest() && st.GetLogLastId() == states[0].GetLogLastId()
		}
		if same {
			break
		}
		if time.Now().After(deadline) {
			return fail(fmt.Errorf("replicas' digests differ: %v", states))
		}
		time.Sleep(50 * time.Millisecond)
	}

	logText, err := os.ReadFile(*logPath)
	if err != nil {
		return fail(err)
	}
	blocks, ackTime, err := parseSeeded(logText)
	if err != nil {
		return fail(err)
	}
	slowest := time.Duration(0)
	for _, l := range lags {
		slowest = max(slowest, l)
	}
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	fmt.Fprintf(stdout, "Benchmark%s \t1 \t%d published-blocks \t%.0f acked-blocks/s \t%.1f ack-ms \t%.1f lag-first-ms \t%.1f lag-all-ms \t%.0f replicated-blocks/s \t%d index-blocks\n",
		*name, blocks, float64(blocks)/ackTime.Seconds(), ms(ackTime), ms(lags[0]), ms(slowest),
		float64(blocks)/(ackTime+slowest).Seconds(), states[0].GetIndexBlocks())
	return 0
}
