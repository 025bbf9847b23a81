package redistest

import (
	"net"
	"sync"
	"testing"
)

// Proxy forwards TCP connections to a Redis server, and can cut them off as a network partition
// does: Cut stops every byte both ways, on the connections open and on those opened meanwhile
// (they are accepted and then hang, as a dial into a partition does until its timeout); Heal
// closes what the partition held (the clients' timeouts would have) and forwards again. A replica
// pointed at the proxy is cut off from Redis while every other replica still reaches it.
type Proxy struct {
	Addr   string
	target string
	lis    net.Listener
	t      testing.TB

	mu    sync.Mutex
	cut   bool
	mute  bool                  // replies are dropped; requests still reach Redis
	conns map[net.Conn]struct{} // both sides of every connection, to close at Heal or Close
	held  map[net.Conn]struct{} // connections opened during a cut, forwarding nothing
	wg    sync.WaitGroup
}

// StartProxy forwards a loopback port to target until the test ends.
func StartProxy(t testing.TB, target string) *Proxy {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("proxy listen: %v", err)
	}
	p := &Proxy{Addr: lis.Addr().String(), target: target, lis: lis, t: t,
		conns: make(map[net.Conn]struct{}), held: make(map[net.Conn]struct{})}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.lis.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		if p.cut {
			p.held[c] = struct{}{}
			p.mu.Unlock()
			continue
		}
		p.mu.Unlock()
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns[c], p.conns[up] = struct{}{}, struct{}{}
		p.mu.Unlock()
		p.wg.Add(2)
		go p.pipe(up, c, false)
		go p.pipe(c, up, true)
	}
}

// pipe copies from src to dst until either side closes; during a cut the bytes read are dropped,
// and so are Redis's replies (replies) while they are muted.
func (p *Proxy) pipe(dst, src net.Conn, replies bool) {
	defer p.wg.Done()
	defer func() {
		dst.Close()
		src.Close()
		p.mu.Lock()
		delete(p.conns, dst)
		delete(p.conns, src)
		p.mu.Unlock()
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			cut := p.cut || replies && p.mute
			p.mu.Unlock()
			if !cut {
				if _, werr := dst.Write(buf[:n]); werr != nil {
					return
				}
			}
		}
		if err != nil {
			return
		}
	}
}

// Cut partitions the proxied clients from Redis.
func (p *Proxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = true
}

// MuteReplies lets requests through to Redis but drops its replies, as a connection that breaks
// after a command was sent: the client cannot tell whether the command ran (it did). Heal ends it.
func (p *Proxy) MuteReplies() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.mute = true
}

// Heal ends the partition (or the muting): the connections it held are closed (their clients
// reconnect), and new ones are forwarded.
func (p *Proxy) Heal() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut, p.mute = false, false
	for c := range p.conns {
		c.Close()
	}
	for c := range p.held {
		c.Close()
	}
	clear(p.conns)
	clear(p.held)
}

func (p *Proxy) close() {
	p.lis.Close()
	p.Heal()
	p.wg.Wait()
}
