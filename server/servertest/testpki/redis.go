package testpki

import "testing"

// RedisPKI is the certificates of a secured Redis and of its clients, written to a directory.
type RedisPKI struct {
	Dir                   string
	ServerCA              *CA
	ServerCAFile          string // what kvrouter trusts: --redis-tls-ca-file
	ServerCert, ServerKey string
	ClientCA              *CA
	ClientCAFile          string // what Redis trusts: --tls-ca-cert-file
	ClientCert, ClientKey string // kvrouter's client certificate
	ClientLeaf            *Leaf
	OtherCAFile           string // a CA that signed nothing here
}

// NewRedisPKI makes the certificates in a temporary directory.
func NewRedisPKI(t testing.TB) *RedisPKI {
	t.Helper()
	p := &RedisPKI{Dir: t.TempDir(), ServerCA: NewCA(t, "redis server CA"), ClientCA: NewCA(t, "redis client CA")}
	p.ServerCAFile = p.ServerCA.WriteCert(t, p.Dir, "server-ca.crt")
	p.ServerCert, p.ServerKey = p.ServerCA.Server(t).Write(t, p.Dir, "redis")
	p.ClientCAFile = p.ClientCA.WriteCert(t, p.Dir, "client-ca.crt")
	p.ClientLeaf = p.ClientCA.Client(t, "spiffe://kvrouter/replica")
	p.ClientCert, p.ClientKey = p.ClientLeaf.Write(t, p.Dir, "kvrouter")
	p.OtherCAFile = NewCA(t, "unrelated CA").WriteCert(t, p.Dir, "other-ca.crt")
	return p
}
