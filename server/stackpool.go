package server

import (
	"context"
	"runtime"
	"slices"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
)

// handlerPool runs unary calls on long-lived goroutines whose stacks have already grown.
//
// Profile lesson (docs/BENCHMARKS.md, "Route over gRPC"): gRPC starts every call on a new goroutine
// with a 2 KiB stack, and a Route call goes about 8 KiB deep (the interceptors, the dispatcher, the
// decision), so each call grew its stack three times (2, 4, 8, 16 KiB), copying and re-walking
// every frame: 8-11% of the router's CPU per Route. gRPC's own NumStreamWorkers would reuse
// goroutines too, but for every stream alike: the long-lived Publish streams would hold its workers
// for their lifetimes. Here only unary calls go to the pool, and a call that finds every pooled
// goroutine busy (a burst, or bookings waiting on the shared log) runs on its own goroutine as
// before, so the pool never queues or delays a call.
type handlerPool struct {
	codec encoding.CodecV2 // marshals a pooled call's response (encodedMessage)
	calls chan *pooledCall
	jobs  sync.Pool // *pooledCall
	stop  chan struct{}
	once  sync.Once
	done  sync.WaitGroup
}

// pooledCall is one unary call handed to a pooled goroutine, with its answer.
type pooledCall struct {
	handler grpc.MethodHandler
	srv     any
	ctx     context.Context
	dec     func(any) error
	icpt    grpc.UnaryServerInterceptor
	resp    any
	err     error
	ready   chan struct{} // receives when resp and err are set
}

// run makes the call and marshals its response with codec, so that gRPC, on its own goroutine,
// only sends the bytes (encodedMessage): marshaling there grew that goroutine's stack in turn.
func (c *pooledCall) run(codec encoding.CodecV2) {
	c.resp, c.err = c.handler(c.srv, c.ctx, c.dec, c.icpt)
	if c.err != nil || codec == nil {
		return
	}
	data, err := codec.Marshal(c.resp)
	if err != nil {
		return // gRPC's own Marshal fails the same way and reports it
	}
	c.resp = &encodedMessage{data: data}
}

// encodedMessage is a response marshaled already (pooledCall.run); limitingCodec sends its bytes.
type encodedMessage struct{ data mem.BufferSlice }

// handlerPoolSize is how many goroutines a pool keeps: enough for every core to run a call while
// as many more wait on a lock or the network; a call beyond them runs on its own goroutine.
func handlerPoolSize() int { return 4 * runtime.GOMAXPROCS(0) }

// newHandlerPool starts n pooled goroutines that marshal responses with codec (nil: gRPC does);
// close stops them.
func newHandlerPool(n int, codec encoding.CodecV2) *handlerPool {
	p := &handlerPool{codec: codec, calls: make(chan *pooledCall), stop: make(chan struct{})}
	p.done.Add(n)
	for range n {
		go p.serve()
	}
	return p
}

func (p *handlerPool) serve() {
	defer p.done.Done()
	for {
		select {
		case c := <-p.calls:
			c.run(p.codec)
			c.ready <- struct{}{}
		case <-p.stop:
			return
		}
	}
}

// close stops the pooled goroutines once they finish the calls they run; later calls run on
// their own goroutines. It may be called more than once.
func (p *handlerPool) close() {
	p.once.Do(func() { close(p.stop) })
	p.done.Wait()
}

// wrap returns a copy of desc whose unary methods run on the pool: the request's decoding, the
// interceptors and the handler, everything gRPC does after it picks the method, so the recovery
// interceptor still runs on the goroutine that may panic. A call that finds no pooled goroutine
// idle runs where gRPC started it. Streaming methods are left as they are.
func (p *handlerPool) wrap(desc *grpc.ServiceDesc) *grpc.ServiceDesc {
	d := *desc
	d.Methods = slices.Clone(desc.Methods)
	for i := range d.Methods {
		handler := d.Methods[i].Handler
		d.Methods[i].Handler = func(srv any, ctx context.Context, dec func(any) error, icpt grpc.UnaryServerInterceptor) (any, error) {
			c, _ := p.jobs.Get().(*pooledCall)
			if c == nil {
				c = &pooledCall{ready: make(chan struct{}, 1)}
			}
			c.handler, c.srv, c.ctx, c.dec, c.icpt = handler, srv, ctx, dec, icpt
			select {
			case p.calls <- c:
				<-c.ready
			default:
				c.run(p.codec)
			}
			resp, err := c.resp, c.err
			*c = pooledCall{ready: c.ready}
			p.jobs.Put(c)
			return resp, err
		}
	}
	return &d
}
