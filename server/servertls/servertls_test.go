package servertls

import (
	"net"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/server/servertest/testpki"
)

// TestExpiredCertificateRefused: a certificate that has expired is refused at start, and a reload
// that would put one in place fails and leaves the good version serving (before, it was swapped
// in, and every handshake failed from then on).
func TestExpiredCertificateRefused(t *testing.T) {
	dir := t.TempDir()
	ca := testpki.NewCA(t, "test CA")
	expired := func() *testpki.Leaf {
		return ca.Issue(t, testpki.Options{CommonName: "localhost", IPs: []net.IP{net.IPv4(127, 0, 0, 1)}, Server: true, NotAfter: time.Now().Add(-time.Minute)})
	}
	cert, key := expired().Write(t, dir, "old")
	if _, err := Load(Files{Cert: cert, Key: key}); err == nil || !strings.Contains(err.Error(), "not now") {
		t.Fatalf("Load(an expired certificate) = %v, want it refused", err)
	}
	cert, key = ca.Server(t).Write(t, dir, "server")
	src, err := Load(Files{Cert: cert, Key: key})
	if err != nil {
		t.Fatal(err)
	}
	good := src.NotAfter()
	expired().Write(t, dir, "server") // rotated in place, to an expired one
	if err := src.Reload(); err == nil {
		t.Fatal("Reload(an expired certificate) = nil, want an error")
	}
	if got := src.NotAfter(); !got.Equal(good) {
		t.Errorf("after a refused reload the certificate serving expires %v, want the good one's %v", got, good)
	}
}
