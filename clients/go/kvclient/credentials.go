package kvclient

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// CredentialOptions say how a client proves who the router is and who the client is: TLS with the
// router's CA, a client certificate for mutual TLS, and a bearer token, in any combination the
// router's credentials file accepts. The zero value is TLS against the system's roots, without a
// client certificate or token.
type CredentialOptions struct {
	// CAFile is a PEM file of the roots that sign the router's certificate (its private CA). Empty:
	// the system's roots. It is read once, by DialCredentials.
	CAFile string
	// CertFile and KeyFile are the client certificate and its key, PEM, for mutual TLS; both or
	// neither. They are read again at the next TLS handshake after either file's modification time,
	// size or identity (a rename, a secret volume's symlink swap) changes, so a rotated certificate is
	// presented on the next connection without a restart.
	CertFile, KeyFile string
	// ServerName, when set, is the name the router's certificate must carry, instead of the host of
	// the target dialled (a router reached through an address its certificate does not name).
	ServerName string
	// TokenFile is a file holding the bearer token (surrounding whitespace, such as the trailing
	// newline, is trimmed). It is looked at no more than once a second and read again when it
	// changed, so a rotated token is sent by the next calls; while it is missing or empty (a rotation
	// under way) the last token read is sent.
	TokenFile string
	// Token is a literal bearer token, for programs that get it elsewhere; not with TokenFile.
	Token string
	// Plaintext turns TLS off (h2c), as for a router on loopback serving without TLS. Not with
	// CAFile, CertFile, KeyFile or ServerName.
	Plaintext bool
	// AllowTokenWithoutTLS permits Plaintext with a token. Anyone who can read the traffic can read
	// the token and call the router as this client, so it is for loopback and other paths no one else
	// sees; DialCredentials refuses the combination without it.
	AllowTokenWithoutTLS bool
}

// DialCredentials returns the grpc.NewClient options that apply o: the transport credentials
// (TLS, at least 1.2, or plaintext) and, with a token, per-call credentials that send the metadata
// "authorization: Bearer <token>", as the router expects. It reads every file once, so that a wrong
// path or a malformed file fails here, at start, rather than at the first call; an error names the
// file or the fields, never the contents of a key or a token.
func DialCredentials(o CredentialOptions) ([]grpc.DialOption, error) {
	if err := o.validate(); err != nil {
		return nil, err
	}
	var opts []grpc.DialOption
	if o.Plaintext {
		opts = append(opts, grpc.WithTransportCredentials(insecure.NewCredentials()))
	} else {
		cfg, err := o.tlsConfig()
		if err != nil {
			return nil, err
		}
		opts = append(opts, grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	}
	if o.Token != "" || o.TokenFile != "" {
		tc, err := newTokenCredentials(o)
		if err != nil {
			return nil, err
		}
		opts = append(opts, grpc.WithPerRPCCredentials(tc))
	}
	return opts, nil
}

// validate checks the combinations of fields, before any file is read.
func (o CredentialOptions) validate() error {
	hasToken := o.Token != "" || o.TokenFile != ""
	switch {
	case (o.CertFile == "") != (o.KeyFile == ""):
		return errors.New("kvclient: CredentialOptions.CertFile and CredentialOptions.KeyFile go together: set both (the client certificate and its key) or neither")
	case o.Token != "" && o.TokenFile != "":
		return errors.New("kvclient: CredentialOptions.Token and CredentialOptions.TokenFile: set one, not both")
	case o.Plaintext && (o.CAFile != "" || o.CertFile != "" || o.ServerName != ""):
		return errors.New("kvclient: CredentialOptions.Plaintext turns TLS off, so CAFile, CertFile, KeyFile and ServerName cannot apply: drop Plaintext or them")
	case o.Plaintext && hasToken && !o.AllowTokenWithoutTLS:
		return errors.New("kvclient: CredentialOptions.Plaintext with Token or TokenFile sends the bearer token unencrypted, readable by anyone on the path: use TLS (drop Plaintext), or set AllowTokenWithoutTLS when the path is private (loopback)")
	}
	return nil
}

// tlsConfig is the client's TLS configuration: the roots of CAFile, and the client certificate of
// CertFile and KeyFile, loaded now and reloaded when they change. It sets no session cache: a
// resumed session would keep presenting the certificate of the session's first handshake.
func (o CredentialOptions) tlsConfig() (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: o.ServerName}
	if o.CAFile != "" {
		pem, err := os.ReadFile(o.CAFile)
		if err != nil {
			return nil, fmt.Errorf("kvclient: CredentialOptions.CAFile: %w", err)
		}
		cfg.RootCAs = x509.NewCertPool()
		if !cfg.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("kvclient: CredentialOptions.CAFile %s: holds no PEM certificate", o.CAFile)
		}
	}
	if o.CertFile != "" {
		kp := &keyPairFiles{certFile: o.CertFile, keyFile: o.KeyFile}
		if _, err := kp.get(); err != nil {
			return nil, err
		}
		cfg.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return kp.get() }
	}
	return cfg, nil
}

// fileVersion tells one version of a file from the next: its identity (which a rename or a symlink
// swap changes), modification time and size.
type fileVersion struct{ fi os.FileInfo }

func statVersion(path string) (fileVersion, error) {
	fi, err := os.Stat(path) // follows symlinks, as a Kubernetes secret volume's files are
	return fileVersion{fi}, err
}

func (v fileVersion) same(w fileVersion) bool {
	return v.fi != nil && w.fi != nil && os.SameFile(v.fi, w.fi) && v.fi.ModTime().Equal(w.fi.ModTime()) && v.fi.Size() == w.fi.Size()
}

// keyPairFiles is a client certificate kept in step with its files.
type keyPairFiles struct {
	certFile, keyFile string

	mu              sync.Mutex
	certVer, keyVer fileVersion
	cert            *tls.Certificate // the last pair that loaded
	lastErr         error            // why the files as they are now do not load
	lastErrCertVer  fileVersion
	lastErrKeyVer   fileVersion
}

// get returns the certificate of the files as they are now, reading them again when either
// changed. A pair that does not load (a rotation half done: the new certificate, the old key) leaves
// the last good certificate in use, and is tried again at the next change; without one, get fails
// with an error that names the files.
func (k *keyPairFiles) get() (*tls.Certificate, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	cv, cerr := statVersion(k.certFile)
	kv, kerr := statVersion(k.keyFile)
	if k.cert != nil && cv.same(k.certVer) && kv.same(k.keyVer) {
		return k.cert, nil
	}
	if k.lastErr != nil && cv.same(k.lastErrCertVer) && kv.same(k.lastErrKeyVer) {
		return k.fallback()
	}
	err := errors.Join(cerr, kerr)
	var pair tls.Certificate
	if err == nil {
		pair, err = tls.LoadX509KeyPair(k.certFile, k.keyFile)
	}
	if err != nil {
		// LoadX509KeyPair's errors describe the PEM blocks found, not their contents.
		k.lastErr = fmt.Errorf("kvclient: client certificate CertFile %s with KeyFile %s: %w", k.certFile, k.keyFile, err)
		k.lastErrCertVer, k.lastErrKeyVer = cv, kv
		return k.fallback()
	}
	k.cert, k.certVer, k.keyVer, k.lastErr = &pair, cv, kv, nil
	return k.cert, nil
}

func (k *keyPairFiles) fallback() (*tls.Certificate, error) {
	if k.cert != nil {
		return k.cert, nil
	}
	return nil, k.lastErr
}

// tokenCheckInterval is the least time between two looks at TokenFile.
const tokenCheckInterval = time.Second

// tokenCredentials sends "authorization: Bearer <token>" with every call. A call reads the header
// without a lock; the one call a second that finds the next look at the file due takes it.
type tokenCredentials struct {
	file       string // "" for a literal token
	requireTLS bool

	header    atomic.Pointer[string] // "Bearer <token>"
	nextCheck atomic.Int64           // when the file is looked at next, Unix nanoseconds

	mu  sync.Mutex  // held while looking at the file
	ver fileVersion // of the file the token was read from
}

func newTokenCredentials(o CredentialOptions) (*tokenCredentials, error) {
	tc := &tokenCredentials{file: o.TokenFile, requireTLS: !o.AllowTokenWithoutTLS}
	if tc.file == "" {
		token := strings.TrimSpace(o.Token)
		if err := checkToken(token); err != nil {
			return nil, fmt.Errorf("kvclient: CredentialOptions.Token: %w", err)
		}
		tc.setToken(token)
		return tc, nil
	}
	ver, err := statVersion(tc.file)
	if err != nil {
		return nil, fmt.Errorf("kvclient: CredentialOptions.TokenFile: %w", err)
	}
	token, err := readToken(tc.file)
	if err != nil {
		return nil, err
	}
	tc.setToken(token)
	tc.ver = ver
	tc.nextCheck.Store(time.Now().Add(tokenCheckInterval).UnixNano())
	return tc, nil
}

func (tc *tokenCredentials) setToken(token string) {
	h := "Bearer " + token
	tc.header.Store(&h)
}

// readToken reads the token of a token file.
func readToken(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("kvclient: CredentialOptions.TokenFile: %w", err)
	}
	token := strings.TrimSpace(string(b))
	if err := checkToken(token); err != nil {
		return "", fmt.Errorf("kvclient: CredentialOptions.TokenFile %s: %w", path, err)
	}
	return token, nil
}

// checkToken refuses what cannot be sent as one metadata value after "Bearer ".
func checkToken(token string) error {
	if token == "" {
		return errors.New("holds no token")
	}
	for i := 0; i < len(token); i++ {
		if c := token[i]; c <= ' ' || c > '~' {
			return fmt.Errorf("the token holds a space, a control or a non-ASCII character (at byte %d): it must be one line of printable ASCII", i)
		}
	}
	return nil
}

// GetRequestMetadata returns the authorization metadata of one call. With a token file it first
// looks at the file, at most once a second, and reads it again when it changed; a file that is
// missing, empty or malformed leaves the last token in use, since a rotation may be under way.
func (tc *tokenCredentials) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	if now := time.Now().UnixNano(); tc.file != "" && now >= tc.nextCheck.Load() && tc.mu.TryLock() {
		// Calls that find another looking at the file send the token they have.
		tc.nextCheck.Store(now + int64(tokenCheckInterval))
		if ver, err := statVersion(tc.file); err == nil && !ver.same(tc.ver) {
			if token, err := readToken(tc.file); err == nil {
				tc.setToken(token)
				tc.ver = ver
			}
		}
		tc.mu.Unlock()
	}
	return map[string]string{"authorization": *tc.header.Load()}, nil
}

// RequireTransportSecurity reports whether gRPC must refuse to send the token over a connection
// without TLS: always, unless CredentialOptions.AllowTokenWithoutTLS.
func (tc *tokenCredentials) RequireTransportSecurity() bool { return tc.requireTLS }

// LoopbackTarget reports whether a gRPC target (host:port, [::1]:port, or a URI such as
// dns:///localhost:50051 or unix:///run/kvrouter.sock) reaches this host only: a loopback address
// (127.0.0.0/8, ::1), the name localhost, or a Unix socket. Only there does traffic without TLS stay
// out of other hosts' reach, so programs use it to decide when plaintext, and a token over it, may
// be allowed.
func LoopbackTarget(target string) bool {
	target = strings.TrimSpace(target)
	if u, err := url.Parse(target); err == nil && u.Scheme != "" && u.Opaque == "" && (u.Host != "" || strings.HasPrefix(target, u.Scheme+":///")) {
		switch u.Scheme {
		case "unix", "unix-abstract":
			return true
		}
		target = strings.TrimPrefix(u.Path, "/")
	} else if strings.HasPrefix(target, "unix:") || strings.HasPrefix(target, "unix-abstract:") {
		return true
	}
	host, _, err := net.SplitHostPort(target)
	if err != nil {
		host = strings.Trim(target, "[]") // no port
	}
	if strings.EqualFold(strings.TrimSuffix(host, "."), "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
