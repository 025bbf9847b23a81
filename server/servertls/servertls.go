// Package servertls is the gRPC port's TLS: a certificate, its key and, for mutual TLS, the CAs of
// client certificates, read from files that may be replaced while the server runs. Every handshake
// takes the newest good version (tls.Config.GetConfigForClient), so a rotated certificate or CA
// applies to the next connection without a restart; a replacement that does not load (a key that
// does not match, a truncated file) leaves the last good version serving.
package servertls

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"sync/atomic"
	"time"
)

// Files name the PEM files of the server's TLS.
type Files struct {
	Cert     string // certificate chain, leaf first
	Key      string // its private key
	ClientCA string // CAs that sign client certificates; "" means no client certificates (TLS, not mTLS)
	// ClientCertOptional lets clients without a certificate in (they authenticate otherwise, with a
	// bearer token); a certificate that is presented must still verify.
	ClientCertOptional bool
	// MinVersion is the oldest TLS version accepted (tls.VersionTLS12 by default).
	MinVersion uint16
}

// Source serves the newest good version of the files.
type Source struct {
	files Files
	cur   atomic.Pointer[loaded]
}

// loaded is one good version of the files.
type loaded struct {
	config   *tls.Config
	notAfter time.Time // the certificate's expiry
}

// Load reads the files; the server cannot start without a good first version.
func Load(f Files) (*Source, error) {
	if f.MinVersion == 0 {
		f.MinVersion = tls.VersionTLS12
	}
	s := &Source{files: f}
	if err := s.Reload(); err != nil {
		return nil, err
	}
	return s, nil
}

// Paths are the files to watch for changes.
func (s *Source) Paths() []string {
	paths := []string{s.files.Cert, s.files.Key}
	if s.files.ClientCA != "" {
		paths = append(paths, s.files.ClientCA)
	}
	return paths
}

// MutualTLS says whether clients must present a certificate.
func (s *Source) MutualTLS() bool { return s.files.ClientCA != "" }

// NotAfter is when the serving certificate expires.
func (s *Source) NotAfter() time.Time { return s.cur.Load().notAfter }

// Reload reads the files again; on an error the previous version keeps serving.
func (s *Source) Reload() error {
	cert, err := tls.LoadX509KeyPair(s.files.Cert, s.files.Key)
	if err != nil {
		return fmt.Errorf("--tls-cert-file %s, --tls-key-file %s: %w", s.files.Cert, s.files.Key, err)
	}
	c := &tls.Config{
		Certificates: []tls.Certificate{cert},
		MinVersion:   s.files.MinVersion,
		NextProtos:   []string{"h2"}, // gRPC is HTTP/2; the config a handshake gets must say so itself
	}
	if s.files.ClientCA != "" {
		pem, err := os.ReadFile(s.files.ClientCA)
		if err != nil {
			return fmt.Errorf("--tls-client-ca-file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return fmt.Errorf("--tls-client-ca-file %s: no PEM certificate found", s.files.ClientCA)
		}
		c.ClientCAs, c.ClientAuth = pool, tls.RequireAndVerifyClientCert
		if s.files.ClientCertOptional {
			c.ClientAuth = tls.VerifyClientCertIfGiven
		}
	}
	if cert.Leaf == nil {
		return errors.New("--tls-cert-file: the certificate does not parse")
	}
	// An expired certificate (or one not valid yet) would fail every handshake: it is refused like
	// a broken file, and the last good version keeps serving (before, it was swapped in).
	if now := time.Now(); now.After(cert.Leaf.NotAfter) || now.Before(cert.Leaf.NotBefore) {
		return fmt.Errorf("--tls-cert-file %s: the certificate is valid from %s to %s, not now (%s)", s.files.Cert,
			cert.Leaf.NotBefore.UTC().Format(time.RFC3339), cert.Leaf.NotAfter.UTC().Format(time.RFC3339), now.UTC().Format(time.RFC3339))
	}
	s.cur.Store(&loaded{config: c, notAfter: cert.Leaf.NotAfter})
	return nil
}

// Config is the tls.Config to serve with: each handshake gets the newest good version.
func (s *Source) Config() *tls.Config {
	return &tls.Config{
		MinVersion: s.files.MinVersion,
		NextProtos: []string{"h2"},
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			return s.cur.Load().config, nil
		},
	}
}
