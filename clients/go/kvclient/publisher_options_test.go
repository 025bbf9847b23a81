package kvclient_test

import (
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/kvrouter/kvrouter/clients/go/kvclient"
	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
)

// TestNewPublisherChecksTheHello: options the router would refuse fail in NewPublisher, before a
// stream opens, with the router's status and words (clients/gotest compares them with the real
// router's).
func TestNewPublisherChecksTheHello(t *testing.T) {
	conn, err := grpc.NewClient("127.0.0.1:1", grpc.WithTransportCredentials(insecure.NewCredentials())) // never dialled
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	hello := func(endpoint string, none bool) *kvrouterv1.WorkerHello {
		return &kvrouterv1.WorkerHello{WorkerId: 1, Model: "m", Role: kvrouterv1.WorkerRole_WORKER_ROLE_AGGREGATED, BlockSize: 4,
			Endpoint: endpoint, NoEndpoint: none}
	}
	for _, tc := range []struct {
		name  string
		hello *kvrouterv1.WorkerHello
		code  codes.Code
		msg   string
	}{
		{"no endpoint", hello("", false), codes.InvalidArgument,
			"hello.endpoint: must be set to the address frontends reach the worker at (or set hello.no_endpoint for a fleet whose frontends find workers by worker_id)"},
		{"no hello", nil, codes.Unknown, "kvclient: PublisherOptions needs Hello and at least one of Conns"},
		{"an endpoint", hello("10.0.0.1:8000", false), codes.OK, ""},
		{"no endpoint on purpose", hello("", true), codes.OK, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := kvclient.NewPublisher(kvclient.PublisherOptions{Hello: tc.hello, Conns: []grpc.ClientConnInterface{conn}})
			if p != nil {
				_ = p.Close(t.Context())
			}
			if got := status.Convert(err); got.Code() != tc.code || got.Message() != tc.msg {
				t.Errorf("NewPublisher() = %v, want %v %q", err, tc.code, tc.msg)
			}
		})
	}
}
