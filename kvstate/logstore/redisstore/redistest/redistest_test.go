package redistest

import (
	"context"
	"net"
	"strconv"
	"strings"
	"testing"
)

// holdBusPort finds a free port whose bus port (port+10000) is free, and listens on the bus port
// until the test ends, as another test's process might: the port itself stays free.
func holdBusPort(t *testing.T) int {
	t.Helper()
	for range 100 {
		port := freePort(t)
		if port+busPortOffset > 65535 {
			continue
		}
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port+busPortOffset))
		if err != nil {
			continue
		}
		t.Cleanup(func() { l.Close() })
		return port
	}
	t.Fatal("no free port with a free bus port to hold")
	return 0
}

// firstThen is a port picker that gives first, then what then gives, and counts its calls.
func firstThen(first int, then func(testing.TB) int, calls *int) func(testing.TB) int {
	return func(t testing.TB) int {
		*calls++
		if *calls == 1 {
			return first
		}
		return then(t)
	}
}

func portOf(t *testing.T, addr string) int {
	t.Helper()
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("net.SplitHostPort(%q) = %v", addr, err)
	}
	port, err := strconv.Atoi(p)
	if err != nil {
		t.Fatalf("port of %q = %v", addr, err)
	}
	return port
}

// TestClusterPortSkipsAHeldBusPort: a candidate port whose bus port another process holds is
// passed over; the port chosen has its bus port free.
func TestClusterPortSkipsAHeldBusPort(t *testing.T) {
	held := holdBusPort(t)
	calls := 0
	got := clusterPort(t, firstThen(held, freePort, &calls))
	if got == held {
		t.Fatalf("clusterPort() = %d, whose bus port %d the test holds", got, held+busPortOffset)
	}
	if calls < 2 {
		t.Errorf("clusterPort() asked for %d candidates, want the held one and another", calls)
	}
	l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(got+busPortOffset))
	if err != nil {
		t.Fatalf("bus port %d of the chosen port %d is not free: %v", got+busPortOffset, got, err)
	}
	l.Close()
}

// TestStartRetriesWhenTheBusPortIsTaken: a cluster node whose bus port was taken after its port
// was picked (here: the picker's first port, whose bus port the test holds) cannot bind and exits;
// start runs it again on another port, where it serves as a cluster node.
func TestStartRetriesWhenTheBusPortIsTaken(t *testing.T) {
	held := holdBusPort(t)
	calls := 0
	args := []string{"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"}
	s := start(t, Options{Args: args}, firstThen(held, freeClusterPort, &calls))
	if port := portOf(t, s.Addr); port == held || calls != 2 {
		t.Fatalf("start() runs on port %d after %d picks, want another port than %d on the second pick", port, calls, held)
	}
	info, err := s.Client().Info(context.Background(), "cluster").Result()
	if err != nil || !strings.Contains(info, "cluster_enabled:1") {
		t.Fatalf("INFO cluster = %q, %v; want cluster_enabled:1", info, err)
	}
}

// TestStartRetriesWhenAnotherRedisHoldsThePort: when another test's redis-server holds the port
// picked, it answers the readiness PING while the new server exits; start must not take it for the
// new one, and runs the new one on another port.
func TestStartRetriesWhenAnotherRedisHoldsThePort(t *testing.T) {
	other := Start(t)
	calls := 0
	s := start(t, Options{}, firstThen(portOf(t, other.Addr), freePort, &calls))
	if s.Addr == other.Addr || calls != 2 {
		t.Fatalf("start() runs on %s after %d picks, want another address than %s on the second pick", s.Addr, calls, other.Addr)
	}
	ctx := context.Background()
	if err := s.Client().Set(ctx, "k", "new", 0).Err(); err != nil {
		t.Fatalf("SET on the new server = %v", err)
	}
	if n, err := other.Client().Exists(ctx, "k").Result(); err != nil || n != 0 {
		t.Errorf("EXISTS k on the other server = %d, %v; want 0 (the key went to the new one)", n, err)
	}
}

// TestRestartKeepsTheAddress: Restart runs the server again on its own port, empty.
func TestRestartKeepsTheAddress(t *testing.T) {
	s := Start(t)
	ctx := context.Background()
	if err := s.Client().Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET = %v", err)
	}
	addr := s.Addr
	s.Restart()
	if s.Addr != addr {
		t.Fatalf("Restart() moved the server from %s to %s", addr, s.Addr)
	}
	if n, err := s.Client().Exists(ctx, "k").Result(); err != nil || n != 0 {
		t.Errorf("EXISTS k after Restart = %d, %v; want 0 (persistence is off)", n, err)
	}
}
