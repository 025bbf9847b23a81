package kvclient

import (
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
)

// Keepalive are the client keepalive parameters for a connection to the router: a ping after 15 s
// without traffic, and the connection failed when no answer comes within 10 s. Without them a
// Publish stream to a router that vanished without closing its connection (a crashed host, a
// partition) waits forever; with them it fails within about 25 s and the Publisher moves on to the
// next of its Conns. The router accepts a ping every 10 s, so shorter intervals get the connection
// closed by the router.
var Keepalive = keepalive.ClientParameters{Time: 15 * time.Second, Timeout: 10 * time.Second, PermitWithoutStream: true}

// WithKeepalive is the dial option that applies Keepalive: pass it to grpc.NewClient for every
// connection a Publisher or Router uses.
func WithKeepalive() grpc.DialOption { return grpc.WithKeepaliveParams(Keepalive) }
