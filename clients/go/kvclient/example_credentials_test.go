package kvclient_test

import (
	"context"
	"log"

	"google.golang.org/grpc"

	"github.com/kvrouter/kvrouter/clients/go/kvclient"
	kvrouterv1 "github.com/kvrouter/kvrouter/gen/kvrouter/v1"
)

// A frontend dials a router that serves TLS and checks client certificates and bearer tokens: the
// router's certificate is verified against its private CA, the frontend presents its own certificate
// (mutual TLS), and every call carries the token of the file. The certificate, its key and the token
// are read again when their files change, so rotating them needs no restart. A worker's Publisher
// takes a connection dialled the same way.
func ExampleDialCredentials() {
	creds, err := kvclient.DialCredentials(kvclient.CredentialOptions{
		CAFile:    "/etc/kvrouter/ca.crt",
		CertFile:  "/etc/kvrouter/client.crt",
		KeyFile:   "/etc/kvrouter/client.key",
		TokenFile: "/var/run/secrets/kvrouter/token",
	})
	if err != nil {
		log.Fatal(err) // it names the file or the fields at fault
	}
	conn, err := grpc.NewClient("dns:///kvrouter.serving.svc:50051", append(creds, kvclient.WithKeepalive())...)
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()

	router := kvclient.NewRouter(conn, kvclient.RouterOptions{})
	prompt := []uint32{1, 2, 3, 4, 5, 6, 7, 8}
	err = router.Do(context.Background(), &kvrouterv1.RouteRequest{Model: "llama", TokenIds: prompt},
		func(ctx context.Context, b *kvclient.Booking) error {
			log.Printf("send the request to %s", b.GetDecode().GetEndpoint())
			return nil
		})
	if err != nil {
		log.Fatal(err) // UNAUTHENTICATED or PERMISSION_DENIED: the router refused the credential
	}
}
