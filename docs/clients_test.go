package docs

import (
	"archive/zip"
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/mod/module"
	modzip "golang.org/x/mod/zip"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvrouter/kvrouter/server/servertest/testpki"
)

// The programs of docs/clients.md. Every ```go, ```python and ```ts block of that page belongs to
// one, named in its info string (```go program=quickstart); the blocks of one language and program,
// in page order, are one program, which TestClientsDocPrograms runs against a real `kvrouter serve`:
//
//   - quickstart: a plaintext router on loopback, embedded, with nothing registered; its address
//     is in the environment variable KVROUTER_ADDR.
//   - credentials: a router with TLS (client certificates optional) and a credentials file; the
//     page's file paths and its address kvrouter.serving.svc:50051 are replaced with the test's
//     (docCredentialPaths), nothing else.
//
// The Go programs build in a scratch module that requires the client's module from a module proxy
// made of this checkout (as a release would serve it), never the server's module; the Python ones
// run with the virtualenv's interpreter that clients/python/install.sh made ($KVROUTER_CLIENT_PYTHON),
// the TypeScript ones in the scratch project clients/ts/pack.sh made ($KVROUTER_CLIENT_TS_DIR).
// scripts/test.sh makes both and sets KVROUTER_REQUIRE_CLIENTS=1, so that a missing one fails.

const clientsDoc = "clients.md"

// docProgramTimeout bounds one program's run; each takes a few seconds.
const docProgramTimeout = 2 * time.Minute

// docServerName is the router's address on the page's credentials examples.
const docServerName = "kvrouter.serving.svc:50051"

// docCredentialPaths are the files the page's credentials examples read, by the name each gets in
// the test's directory.
var docCredentialPaths = map[string]string{
	"/etc/kvrouter/ca.crt":            "ca.crt",
	"/etc/kvrouter/client.crt":        "client.crt",
	"/etc/kvrouter/client.key":        "client.key",
	"/var/run/secrets/kvrouter/token": "token",
}

// docProgram is the blocks of one language and program.
type docProgram struct {
	lang, name string
	line       int // of the first block
	source     strings.Builder
}

var docFenceInfoRE = regexp.MustCompile("^```([a-z]+)(.*)$")

// docPrograms reads the programs of doc, in page order, and reports blocks that belong to none.
func docPrograms(t *testing.T, doc string) []*docProgram {
	t.Helper()
	data, err := os.ReadFile(doc)
	if err != nil {
		t.Fatal(err)
	}
	var (
		programs []*docProgram
		byKey    = map[string]*docProgram{}
		current  *docProgram
		inFence  bool
	)
	sc := bufio.NewScanner(bytes.NewReader(data))
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if !inFence {
			m := docFenceInfoRE.FindStringSubmatch(strings.TrimSpace(line))
			if !strings.HasPrefix(strings.TrimSpace(line), "```") {
				continue
			}
			inFence, current = true, nil
			if m == nil || (m[1] != "go" && m[1] != "python" && m[1] != "ts") {
				continue
			}
			name := ""
			for _, f := range strings.Fields(m[2]) {
				if v, ok := strings.CutPrefix(f, "program="); ok {
					name = v
				}
			}
			if name != "quickstart" && name != "credentials" {
				t.Errorf("%s:%d: a %s block with program=%q: every block of the page runs, as part of program=quickstart or program=credentials", doc, n, m[1], name)
				continue
			}
			key := m[1] + "/" + name
			if byKey[key] == nil {
				byKey[key] = &docProgram{lang: m[1], name: name, line: n}
				programs = append(programs, byKey[key])
			}
			current = byKey[key]
			continue
		}
		if strings.TrimSpace(line) == "```" {
			inFence = false
			if current != nil {
				current.source.WriteString("\n")
			}
			continue
		}
		if current != nil {
			current.source.WriteString(line + "\n")
		}
	}
	return programs
}

// TestClientsDocPrograms runs every program of docs/clients.md, in each language, against a real
// `kvrouter serve`, so that the page cannot drift from the clients.
func TestClientsDocPrograms(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the router and the programs")
	}
	programs := docPrograms(t, clientsDoc)
	for _, want := range []string{"go/quickstart", "python/quickstart", "ts/quickstart", "go/credentials", "python/credentials", "ts/credentials"} {
		found := false
		for _, p := range programs {
			found = found || p.lang+"/"+p.name == want
		}
		if !found {
			t.Errorf("%s has no %s program", clientsDoc, want)
		}
	}
	bin := buildRouter(t)
	pki := newDocPKI(t)
	gs := newGoScratch(t)
	for _, p := range programs {
		t.Run(p.lang+"/"+p.name, func(t *testing.T) {
			var run func(t *testing.T, p *docProgram, env []string) []byte
			switch p.lang {
			case "go":
				run = gs.run
			case "python":
				run = needClient(t, "KVROUTER_CLIENT_PYTHON", "clients/python/install.sh", runPythonProgram)
			case "ts":
				run = needClient(t, "KVROUTER_CLIENT_TS_DIR", "clients/ts/pack.sh", runTSProgram)
			}
			var env []string
			if p.name == "quickstart" {
				env = append(env, "KVROUTER_ADDR="+startDocRouter(t, bin, nil))
			} else {
				addr := startDocRouter(t, bin, pki)
				src := strings.ReplaceAll(p.source.String(), docServerName, "localhost:"+portOf(t, addr))
				for doc, name := range docCredentialPaths {
					src = strings.ReplaceAll(src, doc, filepath.Join(pki.dir, name))
				}
				p = &docProgram{lang: p.lang, name: p.name, line: p.line}
				p.source.WriteString(src)
				env = append(env, "NODE_EXTRA_CA_CERTS="+filepath.Join(pki.dir, "ca.crt"))
			}
			out := run(t, p, env)
			t.Logf("%s program (%s:%d) printed:\n%s", p.lang, clientsDoc, p.line, out)
		})
	}
}

// needClient returns run when the installed client's location is in the environment variable
// name, and otherwise skips the test (fails it under KVROUTER_REQUIRE_CLIENTS=1).
func needClient(t *testing.T, name, script string, run func(t *testing.T, p *docProgram, env []string, where string) []byte) func(*testing.T, *docProgram, []string) []byte {
	where := os.Getenv(name)
	if where == "" {
		msg := fmt.Sprintf("$%s is not set: %s makes the installed client (scripts/test.sh runs it)", name, script)
		if os.Getenv("KVROUTER_REQUIRE_CLIENTS") == "1" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return func(t *testing.T, p *docProgram, env []string) []byte { return run(t, p, env, where) }
}

var (
	routerOnce sync.Once
	routerBin  string
	routerErr  error
)

// buildRouter builds cmd/kvrouter once per test run.
func buildRouter(t *testing.T) string {
	t.Helper()
	routerOnce.Do(func() {
		dir, err := os.MkdirTemp("", "kvrouter-docs")
		if err != nil {
			routerErr = err
			return
		}
		routerBin = filepath.Join(dir, "kvrouter")
		if out, err := exec.Command("go", "build", "-o", routerBin, "../cmd/kvrouter").CombinedOutput(); err != nil {
			routerErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if routerErr != nil {
		t.Fatal(routerErr)
	}
	return routerBin
}

// docPKI is the credentials program's router's TLS files and credentials, in one directory.
type docPKI struct {
	dir                string
	serverCrt, serverK string
	credentials        string
}

// newDocPKI writes a CA, the router's certificate, a client certificate and a token, and a
// credentials file with one credential that may publish as worker 7 and route, proven by the
// certificate or by the token.
func newDocPKI(t *testing.T) *docPKI {
	dir := t.TempDir()
	ca := testpki.NewCA(t, "docs CA")
	ca.WriteCert(t, dir, "ca.crt")
	p := &docPKI{dir: dir}
	p.serverCrt, p.serverK = ca.Server(t).Write(t, dir, "server")
	ca.Client(t, "spiffe://fleet.example/docs").Write(t, dir, "client") // client.crt, client.key
	const token = "docs-token-0123456789abcdef0123456789abcdef"
	if err := os.WriteFile(filepath.Join(dir, "token"), []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256([]byte(token))
	p.credentials = filepath.Join(dir, "credentials.yaml")
	yaml := fmt.Sprintf(`credentials:
  - name: docs
    roles: [worker, frontend]
    token_sha256: %s
    identity: spiffe://fleet.example/docs
    worker_ids: [7]
`, hex.EncodeToString(sum[:]))
	if err := os.WriteFile(p.credentials, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// startDocRouter starts `kvrouter serve` on free loopback ports, with TLS and credentials when pki
// is set, waits until its health is SERVING and returns its address. It is stopped at cleanup.
func startDocRouter(t *testing.T, bin string, pki *docPKI) string {
	t.Helper()
	addr := "127.0.0.1:" + freeDocPort(t)
	if pki != nil {
		addr = "localhost:" + portOf(t, addr) // the name the router's certificate carries
	}
	args := []string{"serve", "--listen", addr, "--metrics-listen", "127.0.0.1:" + freeDocPort(t)}
	dial := grpc.WithTransportCredentials(insecure.NewCredentials())
	if pki != nil {
		args = append(args, "--tls-cert-file", pki.serverCrt, "--tls-key-file", pki.serverK,
			"--tls-client-ca-file", filepath.Join(pki.dir, "ca.crt"), "--tls-client-auth", "optional",
			"--credentials-file", pki.credentials)
		creds, err := credentials.NewClientTLSFromFile(filepath.Join(pki.dir, "ca.crt"), "")
		if err != nil {
			t.Fatal(err)
		}
		dial = grpc.WithTransportCredentials(creds)
	}
	var logs lockedLog
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			t.Logf("kvrouter's log:\n%s", logs.String())
		}
	})
	conn, err := grpc.NewClient(addr, dial)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	deadline := time.Now().Add(time.Minute)
	for {
		select {
		case err := <-exited:
			t.Fatalf("kvrouter serve exited: %v\n%s", err, logs.String())
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
		cancel()
		if err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			return addr
		}
		if time.Now().After(deadline) {
			t.Fatalf("kvrouter serve not SERVING after a minute (%v)\n%s", err, logs.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// lockedLog collects a process's output.
type lockedLog struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *lockedLog) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(b)
}

func (l *lockedLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

func freeDocPort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return portOf(t, l.Addr().String())
}

func portOf(t *testing.T, addr string) string {
	t.Helper()
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	return port
}

// runProgram runs cmd with env added, in dir, within docProgramTimeout, and fails the test unless it
// exits 0.
func runProgram(t *testing.T, p *docProgram, dir string, env []string, name string, args ...string) []byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), docProgramTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Dir, cmd.Env = dir, append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the %s program of %s:%d: %s %s = %v\n%s\n--- the program:\n%s", p.lang, clientsDoc, p.line, name, strings.Join(args, " "), err, out, p.source.String())
	}
	return out
}

// runPythonProgram runs a Python program with the installed client's interpreter, from a
// directory outside the source tree.
func runPythonProgram(t *testing.T, p *docProgram, env []string, python string) []byte {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "program.py"), []byte(p.source.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	return runProgram(t, p, dir, append(env, "PYTHONPATH=", "PYTHONDONTWRITEBYTECODE=1"), python, "program.py")
}

// runTSProgram compiles a TypeScript program in the scratch project where the packed client is
// installed (src/ to dist/, with the project's own tsc and strict tsconfig.json), and runs it.
func runTSProgram(t *testing.T, p *docProgram, env []string, project string) []byte {
	name := "docs-" + p.name
	src, js := filepath.Join(project, "src", name+".ts"), filepath.Join(project, "dist", name+".js")
	if err := os.MkdirAll(filepath.Dir(src), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(src, []byte(p.source.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(src); os.Remove(js) })
	runProgram(t, p, project, nil, filepath.Join(project, "node_modules", ".bin", "tsc"), "-p", project)
	return runProgram(t, p, project, env, "node", js)
}

// clientModules are the repository's modules a program using the Go client needs, by directory.
// The server's module is not one of them: the proxy cannot serve it.
var clientModules = map[string]string{
	"../clients/go":        "github.com/kvrouter/kvrouter/clients/go",
	"../gen":               "github.com/kvrouter/kvrouter/gen",
	"../kvstate/blockhash": "github.com/kvrouter/kvrouter/kvstate/blockhash",
}

// goScratch builds Go programs as a user's module would: a scratch module requiring the client's
// module from a module proxy that holds the client, the contract and the hashing of this checkout
// at the release in VERSION, and the other modules from this machine's module cache (or its
// proxy), with a module cache of its own, so that the proxy's modules never enter the machine's.
type goScratch struct {
	version, proxy, modcache, upstream string
}

func newGoScratch(t *testing.T) *goScratch {
	gs := &goScratch{version: "v" + strings.TrimSpace(string(mustRead(t, "../VERSION"))), proxy: t.TempDir(), modcache: t.TempDir()}
	for dir, path := range clientModules {
		writeProxyModule(t, gs.proxy, dir, module.Version{Path: path, Version: gs.version})
	}
	cache := strings.TrimSpace(string(goEnv(t, "GOMODCACHE")))
	gs.upstream = "file://" + filepath.ToSlash(gs.proxy) + ",file://" + filepath.ToSlash(filepath.Join(cache, "cache", "download")) +
		"," + strings.TrimSpace(string(goEnv(t, "GOPROXY")))
	return gs
}

// run builds p in a new scratch module, checks that the module needs no replace, no Go newer than
// the client's and nothing of the server's module, and runs the program with env.
func (gs *goScratch) run(t *testing.T, p *docProgram, env []string) []byte {
	scratch := t.TempDir()
	gomod := "module example.com/docs\n\ngo 1.26.0\n\nrequire github.com/kvrouter/kvrouter/clients/go " + gs.version + "\n"
	if err := os.WriteFile(filepath.Join(scratch, "go.mod"), []byte(gomod), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(scratch, "main.go"), []byte(p.source.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	goenv := []string{
		"GOPROXY=" + gs.upstream, "GOMODCACHE=" + gs.modcache,
		// The machine's cache was checked against the checksum database when it was filled; the
		// client's modules are this checkout's.
		"GOSUMDB=off", "GOFLAGS=-mod=mod -modcacherw", "GOWORK=off", "GOTOOLCHAIN=local",
	}
	runProgram(t, p, scratch, goenv, "go", "mod", "tidy")
	mod := string(mustRead(t, filepath.Join(scratch, "go.mod")))
	list := string(runProgram(t, p, scratch, goenv, "go", "list", "-m", "all"))
	for _, line := range strings.Split(list, "\n") {
		if f := strings.Fields(line); len(f) > 0 && (f[0] == "github.com/kvrouter/kvrouter" || f[0] == "github.com/redis/go-redis/v9") {
			t.Errorf("the scratch module's build list holds %s, of the server's module:\n%s", line, list)
		}
	}
	if strings.Contains(mod, "replace") || !strings.Contains(mod, "\ngo 1.26.0\n") {
		t.Errorf("the scratch module's go.mod needs a replace or a newer Go than the client's:\n%s", mod)
	}
	bin := filepath.Join(scratch, "program")
	runProgram(t, p, scratch, goenv, "go", "build", "-o", bin, ".")
	return runProgram(t, p, scratch, env, bin)
}

// writeProxyModule writes the module in dir at v into a file-based module proxy (GOPROXY=file://),
// as a module proxy serves a tagged release: its go.mod, its zip and its version list.
func writeProxyModule(t *testing.T, proxy, dir string, v module.Version) {
	t.Helper()
	esc, err := module.EscapePath(v.Path)
	if err != nil {
		t.Fatal(err)
	}
	at := filepath.Join(proxy, esc, "@v")
	if err := os.MkdirAll(at, 0o755); err != nil {
		t.Fatal(err)
	}
	var zipped bytes.Buffer
	if err := modzip.CreateFromDir(&zipped, v, dir); err != nil {
		t.Fatalf("zipping %s: %v", dir, err)
	}
	if _, err := zip.NewReader(bytes.NewReader(zipped.Bytes()), int64(zipped.Len())); err != nil {
		t.Fatal(err)
	}
	files := map[string][]byte{
		v.Version + ".mod":  mustRead(t, filepath.Join(dir, "go.mod")),
		v.Version + ".zip":  zipped.Bytes(),
		v.Version + ".info": fmt.Appendf(nil, `{"Version":%q,"Time":%q}`, v.Version, time.Now().UTC().Format(time.RFC3339)),
		"list":              []byte(v.Version + "\n"),
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(at, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func goEnv(t *testing.T, name string) []byte {
	t.Helper()
	out, err := exec.Command("go", "env", name).Output()
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
